"""Stub of the compiled decision kernel (olproute/pricing/_score.pyx)."""

import numpy as np
import numpy.typing as npt

F_TTFT: int
F_TPOT: int
F_KV_A: int
F_KV_B: int
F_COMPUTE_A: int
F_QPS: int
F_THROUGHPUT: int
F_EEL_SAVED: int
F_TTFT_SAVED: int
F_EEL_SLO: int
F_TTFT_SLO: int
F_UTILITY: int
F_REWARD: int
F_PRICE: int
F_LAGRANGIAN: int
F_FINITE_TTFT: int
NUM_F: int
I_START: int
I_END: int
I_PRE_START: int
I_PRE_END: int
W_SIGMA: int
W_ALPHA: int
W_TOKEN_NORM: int
W_BETA: int
W_GAMMA: int
W_ZETA1: int
W_EEL_THRESHOLD: int
W_ZETA2: int
W_TTFT_THRESHOLD: int
W_OMEGA: int
W_DELTA: int
NUM_W: int

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]

def fits_column(free: _F, s: int, e: int, ba: float, ka: float, kb: float, ps: int, pe: int,
                k: int, horizon: int) -> bool: ...
def subtract_column(free: _F, s: int, e: int, ba: float, ka: float, kb: float, ps: int, pe: int,
                    ca: float, k: int, horizon: int) -> None: ...

class Scorer:
    def __init__(self, beta: _F, batch_cap: _F, kv_cap: _F, budget: _F, w: _F,
                 slot_s: float, horizon: int) -> None: ...
    def score(self, loads: _F, idx: _I, prompt: _F, decode: _F, utility: _F, ttft: _F,
              waited: _F, target: _F, pp: _F, shift: int,
              cached: _F | None = ...) -> tuple[_F, _I, npt.NDArray[np.bool_]]: ...
