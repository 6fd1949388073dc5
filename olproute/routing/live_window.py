"""The window of a live ``bid_price`` run that the exact LP checks: what the server
captured (``olproute.server.capture``), packed as one picklable message for the
certifying or re-solving process (``solvers.live``, ``solvers.resolve``, injected by
the CLI: the server never imports the solvers); and what a re-solve hands back
(``Resolution``), in the simulator as in the server.

Times are seconds on the server's clock (``ServerState.now``). Per-request arrays are
(N,) or (N, G), in arrival order; the price updates are in tick order, one (G, H, R)
array each, kept apart (stacking a minute of them would copy tens of megabytes on the
event loop). NaN marks what did not happen (no first token, no finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config.schema import PriceConfig, RewardConfig

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class LiveWindow:
    """Requests that arrived in [t0_s, t1_s); the price updates of the ticks from the
    last one at or before t0_s on (none in a re-solve's window), and the free capacity
    of a tick (the LP's initial occupancy); the bounds of the LP solve."""

    t0_s: float
    t1_s: float
    slot_s: float
    horizon: int
    reward: RewardConfig
    batch_cap: FloatArray          # (G,) batch slots B_g
    kv_cap: FloatArray             # (G,) KV tokens M_g
    compute_cap: FloatArray        # (G,) prefill tokens per slot b_g
    # per request, at its first decision
    arrival_s: FloatArray          # (N,)
    prompt_tokens: FloatArray      # (N,)
    ttft_target_s: FloatArray      # (N,)
    first_seen_s: FloatArray       # (N,)
    ttft_hat_s: FloatArray         # (N, G) bid_price's TTFT estimate
    tpot_s: FloatArray             # (N, G) time per output token
    decode_tokens: FloatArray      # (N, G) predicted output tokens
    utility: FloatArray            # (N, G) quality - lambda * cost
    exec_ttft_s: FloatArray        # (N, G) queue-free TTFT
    # per request, its outcome: instance -1 when not served
    instance: IntArray             # (N,)
    first_token_s: FloatArray      # (N,)
    finish_s: FloatArray           # (N,)
    # per tick with a price update: the prices after it, slot i starting at origin + i slots
    update_s: FloatArray                 # (U,) tick times
    origin_s: FloatArray                 # (U,) time of price slot 0
    prices: tuple[FloatArray, ...]       # U arrays (G, H, R)
    # the free capacity (G, H, R) bid_price computed at the tick at free_s (the
    # certificate's: the last at or before t0_s; a re-solve's: the latest)
    free_s: float
    free: FloatArray
    # the LP solve: its relative gap tolerance, time limit, and how many slots late it
    # may start a request (None: as late as the online policy did, the certificate's)
    gap_tol: float
    time_limit_s: float
    max_delay_slots: int | None = None

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def num_instances(self) -> int:
        return int(self.batch_cap.shape[0])


# what a re-solve reports (``Resolution.outcome``, the metric's label)
OK, SLOW, FAILED, EMPTY = "ok", "slow", "failed", "empty"


@dataclass(frozen=True, slots=True)
class Resolution:
    """One re-solve (``solvers.resolve``): its outcome, and with ``ok`` the duals ``p``
    (G, K, 3), slot k starting at ``t0_s + k * slot_s``; the LP's value, requests and
    wall seconds; why there are no duals."""

    outcome: str
    t0_s: float
    p: FloatArray | None
    lp_value: float
    requests: int
    solve_s: float
    error: str | None = None


def max_delay_slots(cfg: PriceConfig) -> int:
    """How late a re-solved LP may start a request, in slots: the price steps' largest
    sample delay, so that the LP and the steps price the same model."""
    return int(max(cfg.sample_delays_slots))
