"""LightGBM heads on the request path: models evaluated row by row on the C API's
single-row fast path (``RowHeads``), called from a compiled kernel."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.predict._rowheads import predict_rows
from olproute.predict.features import PredictorError

FloatArray = npt.NDArray[np.float64]


def _lightgbm_library() -> ctypes.CDLL:
    """The shared library inside the installed ``lightgbm`` package, with the prototypes
    of the public C API calls used here (``c_api.h``)."""
    import lightgbm

    root = Path(lightgbm.__file__).resolve().parent
    found = sorted(root.glob("**/lib_lightgbm.*"))
    if not found:
        raise PredictorError(f"cannot find lib_lightgbm under {root}")
    lib = ctypes.CDLL(str(found[0]))  # the library lightgbm already loaded (same dlopen)
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.LGBM_GetLastError.restype = ctypes.c_char_p
    lib.LGBM_BoosterLoadModelFromString.argtypes = [ctypes.c_char_p, ctypes.POINTER(i32),
                                                    ctypes.POINTER(p)]
    lib.LGBM_BoosterPredictForMatSingleRowFastInit.argtypes = [
        p, i32, i32, i32, i32, ctypes.c_int32, ctypes.c_char_p, ctypes.POINTER(p)]
    lib.LGBM_BoosterPredictForMatSingleRowFast.argtypes = [
        p, p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)]
    lib.LGBM_FastConfigFree.argtypes = [p]
    lib.LGBM_BoosterFree.argtypes = [p]
    return lib


def _free_heads(lib: ctypes.CDLL, boosters: list[ctypes.c_void_p],
                configs: list[ctypes.c_void_p]) -> None:
    for fc in configs:  # a fast config points into its booster: free it first
        lib.LGBM_FastConfigFree(fc)
    for handle in boosters:
        lib.LGBM_BoosterFree(handle)


class RowHeads:
    """LightGBM models evaluated row by row on the C API's single-row fast path
    (``LGBM_BoosterPredictForMatSingleRowFast``), configured once with ``num_threads=1``
    and called from the compiled kernel ``olproute.predict._rowheads``.

    ``Booster.predict`` rebuilds its predictor and re-parses parameters on every call:
    measured here ~50 us per call on the request path, against ~5 us per row through
    ctypes and ~2-3 us per row from the kernel (the trees themselves), with identical
    outputs. The handles are our own, loaded from the model text through the public C
    API. Not thread-safe (a fast config holds one row buffer): use one ``Predictor`` per
    thread.
    """

    __slots__ = ("__weakref__", "_configs", "_function", "_lib", "_num_features")

    def __init__(self, model_texts: Sequence[str], num_features: int) -> None:
        lib = self._lib = _lightgbm_library()
        boosters: list[ctypes.c_void_p] = []
        self._configs: list[ctypes.c_void_p] = []
        weakref.finalize(self, _free_heads, lib, boosters, self._configs)
        for text in model_texts:
            handle, num_iterations, config = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_void_p()
            self._check(lib, lib.LGBM_BoosterLoadModelFromString(
                text.encode(), ctypes.byref(num_iterations), ctypes.byref(handle)))
            boosters.append(handle)
            # predict_type 0 = normal, data_type 1 = float64, all iterations
            self._check(lib, lib.LGBM_BoosterPredictForMatSingleRowFastInit(
                handle, 0, 0, -1, 1, num_features, b"num_threads=1", ctypes.byref(config)))
            self._configs.append(config)
        # the kernel calls the function at this address, in the library lightgbm loaded
        address = ctypes.cast(lib.LGBM_BoosterPredictForMatSingleRowFast, ctypes.c_void_p)
        self._function = int(address.value or 0)
        self._num_features = num_features

    @staticmethod
    def _check(lib: ctypes.CDLL, code: int) -> None:
        if code != 0:
            raise PredictorError(f"LightGBM: {lib.LGBM_GetLastError().decode()}")

    def predict(self, head: int, x: FloatArray) -> list[float]:
        """Outputs of model ``head`` for each row of a C-contiguous float64 matrix."""
        try:
            return predict_rows(self._function, int(self._configs[head].value or 0), x,
                                self._num_features)
        except RuntimeError as exc:
            raise PredictorError(f"{exc}: {self._lib.LGBM_GetLastError().decode()}") from None
