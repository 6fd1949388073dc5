"""The layout of the compiled score kernel's input weights and outputs
(``olproute.pricing._score``), declared once: the kernel imports these numbers, and its
twin (``reward.score_reference``), ``reward.reward_weights`` and ``bid_price`` read the
rows by these names.

``Scorer.score`` returns (F (NUM_F, N, G) float64, I (NUM_I, N, G) int64, on time
(N, G) bool): F's rows are ``F_*`` (named in ``FLOAT_ROWS``), I's rows ``I_*`` (named
in ``INT_ROWS``, the usage column's slots); the weights vector it is built with has
``W_*`` entries (named in ``WEIGHTS``).

Adding a reward term means editing exactly these places:

1. here: its ``F_`` row, with the rows after it renumbered, its name in ``FLOAT_ROWS``
   (and a ``W_`` weight with its name in ``WEIGHTS`` if it has one of its own);
2. the kernel, ``olproute/pricing/_score.pyx``: import the new names, compute the term,
   add it to ``reward`` in the twin's order and write its row (then rebuild with
   ``python setup.py build_ext --inplace``);
3. the twin, ``olproute/pricing/reward.py``: the term in ``RewardTerms`` /
   ``reward_terms`` (what the twin and the price step read), its row in
   ``score_reference``'s ``rows``, and its weight in ``reward_weights``.

``bid_price``'s explanation reads a row by name (its ``_TERM_ROWS``): add the term's key
there to explain it. ``tests/unit/test_score_kernel.py`` holds the kernel to these
numbers and to the twin.
"""

from __future__ import annotations

from typing import Final

# rows of the float output (NUM_F, N, G)
F_TTFT: Final = 0
F_TPOT: Final = 1
F_KV_A: Final = 2
F_KV_B: Final = 3
F_COMPUTE_A: Final = 4
F_QPS: Final = 5
F_THROUGHPUT: Final = 6
F_EEL_SAVED: Final = 7
F_TTFT_SAVED: Final = 8
F_EEL_SLO: Final = 9
F_TTFT_SLO: Final = 10
F_UTILITY: Final = 11
F_REWARD: Final = 12
F_PRICE: Final = 13
F_LAGRANGIAN: Final = 14
F_FINITE_TTFT: Final = 15
FLOAT_ROWS: Final = ("ttft", "tpot", "kv_a", "kv_b", "compute_a", "qps", "throughput",
                     "eel_saved", "ttft_saved", "eel_slo", "ttft_slo", "utility", "reward",
                     "price", "lagrangian", "finite_ttft")
NUM_F: Final = 16

# rows of the integer output (NUM_I, N, G): the usage column's slots
I_START: Final = 0
I_END: Final = 1
I_PRE_START: Final = 2
I_PRE_END: Final = 3
INT_ROWS: Final = ("start", "end", "pre_start", "pre_end")
NUM_I: Final = 4

# the weights vector
W_SIGMA: Final = 0
W_ALPHA: Final = 1
W_TOKEN_NORM: Final = 2
W_BETA: Final = 3
W_GAMMA: Final = 4
W_ZETA1: Final = 5
W_EEL_THRESHOLD: Final = 6
W_ZETA2: Final = 7
W_TTFT_THRESHOLD: Final = 8
W_OMEGA: Final = 9
W_DELTA: Final = 10
WEIGHTS: Final = ("sigma", "alpha", "token_norm", "beta", "gamma", "zeta1", "eel_threshold",
                  "zeta2", "ttft_threshold", "omega", "delta")
NUM_W: Final = 11
