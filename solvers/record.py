"""A ``bid_price`` simulation with what the exact LP needs recorded (``WindowLog``),
and the LP of a window of it (``build_window``).

The policy is not modified: ``Recorder`` wraps the BidPrice object from outside (as
``olproute.sim.estimate_eval.EstimatorProbe`` wraps policies) and the cluster is run
here. It records, per request, what bid_price saw at its first decision (from the
decision's explanation: the per-instance TTFT estimate, time per output token, predicted
output tokens, utility and queue-free TTFT, the same inputs its reward and usage columns
were built from) and, at every tick, the free capacity and the prices after the update
with their origin (``price_view``: price slot 0 starts at the PriceBook's origin, see
``solvers.certificate.absolute_prices``).

``WindowLog`` is plain arrays only (no config, no simulation result), so a log can be
built by hand, saved, or come from the server as well as from the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from olproute.config.loader import LoadedConfig
from olproute.config.schema import RewardConfig
from olproute.policies import REGISTRY, Policy
from olproute.policies.bid_price import BidPrice
from olproute.pricing.reward import NUM_RESOURCES
from olproute.routing.assembly import policy_env
from olproute.sim.cluster import ProgressFn, SimResult
from olproute.sim.scenario import CalibrationSource, build_requests, make_cluster, streams
from olproute.types import Decision, EngineSnapshot, Outcome, Request, RoutingContext
from solvers.certificate import PriceUpdate
from solvers.problem import LpProblem

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# per-instance predictions read from bid_price's decision explanation, (N, G) each
PREDICTIONS = ("ttft_s", "tpot_s", "decode_tokens", "utility", "exec_ttft_s")


@dataclass(frozen=True, slots=True)
class WindowLog:
    """What the exact LP of a window needs from a run, as plain arrays; per-request
    arrays are indexed by request id (N requests, G instances, H price slots)."""

    slot_s: float
    horizon: int
    reward: RewardConfig
    batch_cap: FloatArray          # (G,) batch slots
    kv_cap: FloatArray             # (G,) KV tokens
    compute_cap: FloatArray        # (G,) prefill tokens per slot
    arrival_s: FloatArray          # (N,)
    prompt_tokens: FloatArray      # (N,)
    ttft_target_s: FloatArray      # (N,)
    first_seen_s: FloatArray       # (N,) nan = never decided
    ttft_hat_s: FloatArray         # (N, G) TTFT estimate at the first decision
    tpot_s: FloatArray             # (N, G) time per output token at the first decision
    decode_tokens: FloatArray      # (N, G) predicted output tokens
    utility: FloatArray            # (N, G) quality - lambda * cost (unweighted)
    exec_ttft_s: FloatArray        # (N, G) queue-free TTFT
    instance: IntArray             # (N,) -1 = not served
    first_token_s: FloatArray      # (N,) inf/nan = none
    finish_s: FloatArray           # (N,) inf/nan = none
    updates: tuple[PriceUpdate, ...]
    free: tuple[tuple[float, FloatArray], ...]   # (tick time, free capacity (G, H, 3))

    @property
    def num_instances(self) -> int:
        return int(self.batch_cap.shape[0])


@dataclass
class Recorder(Policy):
    """Decides, observes and ticks exactly as the wrapped bid_price, and records."""

    inner: BidPrice
    first_seen_s: dict[int, float] = field(default_factory=dict)
    predictions: dict[int, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    updates: list[PriceUpdate] = field(default_factory=list)
    free: list[tuple[float, FloatArray]] = field(default_factory=list)
    needs_snapshots: bool = True
    name: str = "bid_price"

    def __post_init__(self) -> None:
        self.tick_s = self.inner.tick_s
        self.joint_release = self.inner.joint_release

    def decide(self, ctx: RoutingContext) -> Decision:
        decision = self.inner.decide(ctx)
        rid = ctx.request.request_id
        if rid not in self.first_seen_s:
            self.first_seen_s[rid] = ctx.now_s
            self.predictions[rid] = {k: decision.explanation[k] for k in PREDICTIONS}
        return decision

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        return self.inner.decide_held(requests, context)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        self.inner.tick(now_s, snapshots)
        view = self.inner.price_view()
        # price slot 0 starts at the book's origin (set by its first update)
        if view.origin_s is not None and view.num_updates > 0:
            self.updates.append(PriceUpdate(now_s, view.origin_s, view.prices))
        self.free.append((now_s, view.free))

    def per_request(self, name: str, n: int, g: int) -> FloatArray:
        """(n, g) prediction ``name`` at each request's first decision; nan if none."""
        out = np.full((n, g), np.nan)
        for rid, pred in self.predictions.items():
            out[rid] = pred[name]
        return out


@dataclass(frozen=True, slots=True)
class Recording:
    """One recorded bid_price run: its config, the simulation result and the log."""

    loaded: LoadedConfig
    result: SimResult
    log: WindowLog


def record_bid_price(loaded: LoadedConfig, seed: int | None = None,
                     calibration: CalibrationSource | None = None,
                     progress: ProgressFn | None = None,
                     schedule: tuple[float, FloatArray] | None = None,
                     recorder: Callable[[BidPrice, WindowLog], Recorder] | None = None
                     ) -> Recording:
    """Run bid_price on the configured workload (as ``simulate`` would) and record; with
    ``schedule`` (t0_s, absolute prices (G, K, 3)), bid_price replays those prices
    instead of learning its own (``PriceBook.set_schedule``: oracle prices).
    ``recorder`` builds the recording wrapper from the policy and the run's constants
    (a log with no requests; default ``Recorder``)."""
    cfg = loaded.config
    if recorder is None and schedule is None and cfg.prices.resolve_period_s is not None:
        raise ValueError("prices.resolve_period_s is set: record with "
                         "solvers.resolve.record_resolving, which re-solves")
    run_seed = cfg.sim.seed if seed is None else seed
    reqs = build_requests(loaded, run_seed)
    st = streams(run_seed, len(loaded.specs))
    env = policy_env(loaded, "bid_price", st.policy, calibration or CalibrationSource(loaded))
    inner = REGISTRY.create("bid_price", env)
    if not isinstance(inner, BidPrice):
        raise TypeError("the registered bid_price policy is not olproute's BidPrice")
    if schedule is not None:
        inner.book.set_schedule(*schedule)
    base = empty_log(loaded)
    rec = Recorder(inner) if recorder is None else recorder(inner, base)
    res = make_cluster(loaded, rec, run_seed, record_batches=False).run(reqs, progress)
    n, g = len(reqs), len(loaded.specs)
    seen = np.full(n, np.nan)
    for rid, t in rec.first_seen_s.items():
        seen[rid] = t
    log = replace(
        base,
        # the budget bid_price priced compute with (at the end of the run)
        compute_cap=np.asarray(inner.price_view().compute_budget, dtype=np.float64),
        arrival_s=np.array([r.arrival_s for r in reqs], dtype=np.float64),
        prompt_tokens=np.array([r.prompt_tokens for r in reqs], dtype=np.float64),
        ttft_target_s=np.array([r.ttft_target_s for r in reqs], dtype=np.float64),
        first_seen_s=seen, ttft_hat_s=rec.per_request("ttft_s", n, g),
        tpot_s=rec.per_request("tpot_s", n, g),
        decode_tokens=rec.per_request("decode_tokens", n, g),
        utility=rec.per_request("utility", n, g),
        exec_ttft_s=rec.per_request("exec_ttft_s", n, g),
        instance=np.asarray(res.instance, dtype=np.int64),
        first_token_s=np.asarray(res.first_token_s, dtype=np.float64),
        finish_s=np.asarray(res.finish_s, dtype=np.float64),
        updates=tuple(rec.updates), free=tuple(rec.free))
    return Recording(loaded=loaded, result=res, log=log)


def empty_log(loaded: LoadedConfig) -> WindowLog:
    """A log of the configured cluster with no request: the run's constants."""
    cfg, specs = loaded.config, loaded.specs
    g = len(specs)
    none = np.empty((0, g))
    return WindowLog(
        slot_s=cfg.router.slot_ms / 1e3, horizon=cfg.router.horizon_slots, reward=cfg.reward,
        batch_cap=np.array([s.max_num_seqs for s in specs], dtype=np.float64),
        kv_cap=np.array([s.kv_capacity_tokens for s in specs], dtype=np.float64),
        compute_cap=np.zeros(g), arrival_s=np.empty(0), prompt_tokens=np.empty(0),
        ttft_target_s=np.empty(0), first_seen_s=np.empty(0), ttft_hat_s=none,
        tpot_s=none, decode_tokens=none, utility=none, exec_ttft_s=none,
        instance=np.empty(0, dtype=np.int64), first_token_s=np.empty(0),
        finish_s=np.empty(0), updates=(), free=())


def build_window(log: WindowLog, t0_s: float | None = None, t1_s: float | None = None,
                 max_delay: int | None = None, max_delay_cap: int = 200,
                 tail_slots: int | None = None) -> tuple[LpProblem, IntArray]:
    """The LP of the requests arriving in [t0, t1) (default: the whole run, from its
    first tick) and decided at least once, and their request ids.

    - Grid: slot 0 starts at t0; K covers the window plus ``tail_slots`` (default: the
      max delay), so that the last arrivals keep their whole start window.
    - Initial occupancy: the free capacity bid_price computed at the last tick at or
      before t0 (its residents' predicted usage), moved by the slots since; 1 past its
      horizon.
    - Max delay: the largest realised wait to the first token in the window, in slots
      (so the LP can start a request as late as the online policy did), capped at
      ``max_delay_cap``; or as given.
    - Predictions (queue-free TTFT, time per output token, output tokens, utility): what
      bid_price used at the request's first decision.
    """
    slot = log.slot_s
    if t0_s is None:
        t0_s = log.free[0][0] if log.free else float(np.min(log.arrival_s))
    if t1_s is None:
        t1_s = float(np.max(log.arrival_s)) + slot
    arrival = log.arrival_s
    ids = np.nonzero((arrival >= t0_s) & (arrival < t1_s) & np.isfinite(log.first_seen_s))[0]
    if len(ids) == 0:
        raise ValueError(f"no request arrives in [{t0_s}, {t1_s})")
    if max_delay is None:
        wait = log.first_token_s[ids] - arrival[ids]
        wait = wait[np.isfinite(wait)]
        max_delay = min(math.ceil(wait.max() / slot) if len(wait) else 0, max_delay_cap)
    tail = max_delay if tail_slots is None else tail_slots
    k = math.ceil((t1_s - t0_s) / slot - 1e-9) + tail
    free = initial_free(log, float(t0_s), k)
    prob = LpProblem(
        slot_s=slot, num_slots=k, horizon=log.horizon, t0_s=float(t0_s),
        arrival_s=arrival[ids], prompt_tokens=log.prompt_tokens[ids],
        ttft_target_s=log.ttft_target_s[ids], decode_tokens=log.decode_tokens[ids],
        utility=log.utility[ids], tpot_s=log.tpot_s[ids], exec_ttft_s=log.exec_ttft_s[ids],
        batch_cap=log.batch_cap, kv_cap=log.kv_cap, compute_cap=log.compute_cap, free=free,
        reward=log.reward, max_delay=int(max_delay))
    return prob, ids.astype(np.int64)


def initial_free(log: WindowLog, t0_s: float, num_slots: int) -> FloatArray:
    """(G, K, 3) free capacity on a grid starting at t0: the last tick's at or before t0,
    moved by the whole slots since; 1 where it has none (before the first tick, past
    its horizon)."""
    free = np.ones((log.num_instances, num_slots, NUM_RESOURCES))
    before = [(t, c) for t, c in log.free if t <= t0_s + 1e-12]
    if before:
        t_tick, c = before[-1]
        # whole slots since the tick, robust to t0 - tick landing a rounding error short
        avail = c[:, math.floor((t0_s - t_tick) / log.slot_s + 1e-9):]
        m = min(avail.shape[1], num_slots)
        free[:, :m] = avail[:, :m]
    return free


def window_problem(rec: Recording, t0_s: float | None = None, t1_s: float | None = None,
                   max_delay: int | None = None, max_delay_cap: int = 200,
                   tail_slots: int | None = None) -> tuple[LpProblem, IntArray]:
    """``build_window`` on a recording's log."""
    return build_window(rec.log, t0_s, t1_s, max_delay, max_delay_cap, tail_slots)
