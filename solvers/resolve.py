"""Re-solved duals as prices (``prices.resolve_period_s``): the exact LP of the recent
demand, replayed from now on, hands its duals to bid_price's price book.

Every period the requests that arrived in the last ``prices.resolve_window_s`` (with
the per-instance figures bid_price decided them with) are moved forward in time so that
the window starts at the latest tick, and the LP of [tick, tick + window) is solved on
the free capacity of that tick (the residents of now, at their load-aware decode
speed): the re-solving of Li and Ye, "Online Linear Programming: Dual Convergence, New
Algorithms, and Regret Bounds" (remaining capacity, demand estimated by the recent
window). Each request may start up to the book's largest sample delay later than its
earliest slot, as the demand samples the steps take may
(``prices.sample_delays_slots``), so the LP and the steps price the same model. Its
duals are absolute prices from the tick on; ``PriceBook.warm_start`` takes them as the
book's prices and the first-order steps refine them until the next solve.

The same function serves the simulator (:class:`Resolving`, which records a run as
``solvers.record.Recorder`` does and re-solves at its ticks, in simulated time) and the
server (:func:`resolve_live`, run in the live certificate's kind of worker process on a
window ``olproute.server.capture.pack_recent`` copies out). A solve that fails or runs
past ``prices.resolve_time_limit_s`` hands back no prices: the book keeps its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from olproute.config.loader import LoadedConfig
from olproute.config.schema import PriceConfig
from olproute.policies.base import Policy
from olproute.policies.bid_price import BidPrice
from olproute.pricing.reward import NUM_RESOURCES
from olproute.routing.live_window import (
    EMPTY,
    FAILED,
    OK,
    SLOW,
    LiveWindow,
    Resolution,
    max_delay_slots,
)
from olproute.sim.cluster import ProgressFn
from olproute.sim.scenario import CalibrationSource
from olproute.types import Decision, EngineSnapshot, Request, RoutingContext
from solvers.lp import solve
from solvers.problem import LpProblem
from solvers.record import (
    PREDICTIONS,
    Recorder,
    Recording,
    WindowLog,
    build_window,
    empty_log,
    record_bid_price,
)

FloatArray = npt.NDArray[np.float64]

LP_THREADS = 1   # the solve shares the machine with the router


def forward_problem(log: WindowLog, t0_s: float, t1_s: float, free_s: float,
                    free: FloatArray, max_delay: int) -> LpProblem:
    """The LP of the requests of [t0, t1) moved forward by ``free_s - t0`` (the window
    then starts at the tick ``free_s``), on the tick's free capacity ``free`` (G, H, 3;
    1 past its horizon), each start at most ``max_delay`` slots late."""
    prob, _ = build_window(log, t0_s, t1_s, max_delay=max_delay, tail_slots=max_delay)
    shift = free_s - t0_s
    grid = np.ones((prob.num_instances, prob.num_slots, NUM_RESOURCES))
    m = min(free.shape[1], prob.num_slots)
    grid[:, :m] = free[:, :m]
    return replace(prob, t0_s=free_s, arrival_s=prob.arrival_s + shift, free=grid,
                   _derived={})


def resolve_log(log: WindowLog, t0_s: float, t1_s: float, free_s: float, free: FloatArray,
                max_delay: int, time_limit_s: float) -> Resolution:
    """Solve ``forward_problem`` within ``time_limit_s``: its duals, or why there are none."""
    wall = time.perf_counter()
    try:
        prob = forward_problem(log, t0_s, t1_s, free_s, free, max_delay)
    except ValueError as exc:   # no request in the window
        return Resolution(EMPTY, free_s, None, 0.0, 0, 0.0, str(exc))
    try:
        sol = solve(prob, time_limit_s=time_limit_s, threads=LP_THREADS)
    except Exception as exc:  # a solver error must not stop pricing: the book keeps its own
        return Resolution(FAILED, free_s, None, 0.0, prob.num_requests,
                          time.perf_counter() - wall, f"{type(exc).__name__}: {exc}")
    spent = time.perf_counter() - wall
    if sol.status != "Optimal" or not np.all(np.isfinite(sol.p)):
        slow = spent >= time_limit_s or "time" in sol.status.lower()
        return Resolution(SLOW if slow else FAILED, free_s, None, 0.0, prob.num_requests,
                          spent, f"HiGHS: {sol.status}")
    return Resolution(OK, free_s, sol.p, float(sol.objective), prob.num_requests, spent)


def resolve_live(window: LiveWindow) -> Resolution:
    """The server's re-solve of a window ``pack_recent`` copied out: the requests of
    [t0, t1) moved forward to the latest tick (``free_s``, its ``free``), each start at
    most ``max_delay_slots`` (``max_delay_slots(prices)``) late, within its time limit."""
    from solvers.live import to_log

    if window.max_delay_slots is None:
        raise ValueError("a re-solve's window sets max_delay_slots (pack_recent does)")
    return resolve_log(to_log(window), window.t0_s, window.t1_s, window.free_s, window.free,
                       window.max_delay_slots, window.time_limit_s)


@dataclass
class Resolving(Recorder):
    """bid_price in the simulator with re-solves: records as ``Recorder`` does (and the
    requests themselves), and at the first tick ``resolve_period_s`` after the last
    re-solve (the first once ``resolve_window_s`` has passed since the first decision)
    solves the window and warm-starts the book. The solve's wall time is kept, not
    simulated: in the server it runs in a process of its own."""

    cfg: PriceConfig = field(default_factory=PriceConfig)
    base: WindowLog | None = None   # the run's constants (slot, caps, reward); no requests
    requests: dict[int, Request] = field(default_factory=dict)
    resolutions: list[tuple[float, Resolution]] = field(default_factory=list)
    _next_s: float = math.inf

    def decide(self, ctx: RoutingContext) -> Decision:
        rid = ctx.request.request_id
        if rid not in self.first_seen_s:
            self.requests[rid] = ctx.request
            if not self.first_seen_s:
                self._next_s = ctx.now_s + self.cfg.resolve_window_s
        return super().decide(ctx)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        super().tick(now_s, snapshots)
        period = self.cfg.resolve_period_s
        if period is None or now_s < self._next_s:
            return
        self._next_s = now_s + period
        res = resolve_log(self.log_so_far(), now_s - self.cfg.resolve_window_s, now_s,
                          now_s, self.free[-1][1], max_delay_slots(self.cfg),
                          self.cfg.resolve_time_limit_s)
        self.resolutions.append((now_s, res))
        if res.p is not None:
            self.inner.book.warm_start(res.t0_s, res.p, now_s)

    def log_so_far(self) -> WindowLog:
        """The requests decided so far, as a WindowLog (outcomes unknown: not needed)."""
        ids = sorted(self.requests)
        n, g = (max(ids) + 1 if ids else 0), self.inner.book.num_instances
        arr = np.full((n, 3), np.nan)
        seen = np.full(n, np.nan)
        for rid in ids:
            r = self.requests[rid]
            arr[rid] = (r.arrival_s, r.prompt_tokens, r.ttft_target_s)
            seen[rid] = self.first_seen_s[rid]
        per = {k: self.per_request(k, n, g) for k in PREDICTIONS}
        if self.base is None:
            raise ValueError("Resolving needs the run's constants (base)")
        return replace(
            self.base, compute_cap=np.asarray(self.inner.price_view().compute_budget,
                                              dtype=np.float64),
            arrival_s=arr[:, 0], prompt_tokens=arr[:, 1], ttft_target_s=arr[:, 2],
            first_seen_s=seen, ttft_hat_s=per["ttft_s"], tpot_s=per["tpot_s"],
            decode_tokens=per["decode_tokens"], utility=per["utility"],
            exec_ttft_s=per["exec_ttft_s"], instance=np.full(n, -1, dtype=np.int64),
            first_token_s=np.full(n, np.nan), finish_s=np.full(n, np.nan),
            updates=(), free=())


def resolving(policy: Policy, loaded: LoadedConfig) -> Policy:
    """``olproute.sim.scenario.simulate``'s ``wrap``: bid_price on mixed instances with
    the config's re-solves (``Resolving``); any other policy as it is (only bid_price's
    book on mixed instances takes LP duals)."""
    if not isinstance(policy, BidPrice) or loaded.config.prices.resolve_period_s is None:
        return policy
    return Resolving(policy, cfg=loaded.config.prices, base=empty_log(loaded))


def record_resolving(loaded: LoadedConfig, seed: int | None = None,
                     calibration: CalibrationSource | None = None,
                     progress: ProgressFn | None = None
                     ) -> tuple[Recording, list[tuple[float, Resolution]]]:
    """``record_bid_price`` with the config's re-solves (``prices.resolve_period_s``, which
    must be set): the recording and the run's re-solves (tick time, outcome)."""
    cfg = loaded.config.prices
    if cfg.resolve_period_s is None:
        raise ValueError("prices.resolve_period_s is null: nothing to re-solve")
    made: list[Resolving] = []

    def wrap(inner: BidPrice, base: WindowLog) -> Recorder:
        made.append(Resolving(inner, cfg=cfg, base=base))
        return made[-1]

    rec = record_bid_price(loaded, seed, calibration=calibration, progress=progress,
                           recorder=wrap)
    return rec, made[0].resolutions


def record_as_configured(loaded: LoadedConfig, seed: int | None = None,
                         calibration: CalibrationSource | None = None,
                         progress: ProgressFn | None = None) -> Recording:
    """A recorded bid_price run as its config says: with re-solves when
    ``prices.resolve_period_s`` is set (``record_resolving``), else
    ``record_bid_price``."""
    if loaded.config.prices.resolve_period_s is None:
        return record_bid_price(loaded, seed, calibration=calibration, progress=progress)
    return record_resolving(loaded, seed, calibration, progress)[0]
