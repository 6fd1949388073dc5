# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""LightGBM's single-row fast path called row by row from C, not through ctypes.

Kernels only, no policy. ``olproute.predict.heads.RowHeads`` loads the models and makes
their fast configs through the public C API and hands this kernel the address of
``LGBM_BoosterPredictForMatSingleRowFast`` (in the library the ``lightgbm`` package
loaded) and a config's handle; the values are LightGBM's own. A ctypes call costs about
1.3 us of argument conversion per row, more than a small head's trees.
"""

from libc.stdint cimport int64_t, uintptr_t

ctypedef int (*SingleRowFast)(void* config, const void* row, int64_t* out_len,
                              double* out) noexcept nogil


def predict_rows(uintptr_t function, uintptr_t config, const double[:, ::1] x,
                 Py_ssize_t num_features):
    """One head's output for each row of ``x`` (float64, C-contiguous, ``num_features``
    columns, the count its fast config was made for). RuntimeError names the row whose
    call failed; LightGBM's last error says why."""
    cdef SingleRowFast call = <SingleRowFast>function
    cdef int64_t out_len
    cdef double out
    cdef Py_ssize_t i
    cdef list result = []
    if x.shape[1] != num_features or not function or not config:
        raise ValueError(f"rows have {x.shape[1]} features, the head {num_features}")
    for i in range(x.shape[0]):
        if call(<void*>config, &x[i, 0], &out_len, &out) != 0:
            raise RuntimeError(f"LightGBM single-row prediction failed on row {i}")
        result.append(out)
    return result
