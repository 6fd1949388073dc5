"""Stub of the compiled decision kernel (olproute/pricing/_score.pyx)."""

import numpy as np
import numpy.typing as npt

# the output's rows and the weights vector: olproute.pricing.score_fields

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]

def fits_column(free: _F, s: int, e: int, ba: float, ka: float, kb: float, ps: int, pe: int,
                k: int, horizon: int) -> bool: ...
def subtract_column(free: _F, s: int, e: int, ba: float, ka: float, kb: float, ps: int, pe: int,
                    ca: float, k: int, horizon: int) -> None: ...

class Scorer:
    def __init__(self, beta: _F, batch_cap: _F, kv_cap: _F, budget: _F, w: _F,
                 slot_s: float, horizon: int, steady: _F | None = ...) -> None: ...
    def score(self, loads: _F, idx: _I, prompt: _F, decode: _F, utility: _F, ttft: _F,
              waited: _F, target: _F, pp: _F, shift: int,
              cached: _F | None = ...) -> tuple[_F, _I, npt.NDArray[np.bool_]]: ...
