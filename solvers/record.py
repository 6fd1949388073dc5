"""A ``bid_price`` simulation with what the exact LP needs recorded, and the LP of a
window of it.

The policy is not modified: ``Recorder`` wraps the BidPrice object from outside (as
``olproute.sim.estimate_eval.EstimatorProbe`` wraps policies) and the cluster is run
here. It records, per request, what bid_price saw at its first decision (the
per-instance TTFT estimate and time per output token from the decision's explanation,
the same inputs its reward and usage columns were built from) and, at every tick, the
free capacity and the prices after the update with their origin (``price_view``: price
slot 0 starts at the PriceBook's origin, see ``solvers.certificate.absolute_prices``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from olproute.assembly import policy_env
from olproute.config import LoadedConfig
from olproute.policies import REGISTRY, Policy
from olproute.policies.bid_price import BidPrice
from olproute.sim.cluster import ProgressFn, SimResult
from olproute.sim.scenario import CalibrationSource, build_requests, make_cluster, streams
from olproute.types import Decision, EngineSnapshot, Outcome, RoutingContext
from solvers.certificate import PriceUpdate
from solvers.problem import LpProblem

FloatArray = npt.NDArray[np.float64]


@dataclass
class Recorder(Policy):
    """Decides, observes and ticks exactly as the wrapped bid_price, and records."""

    inner: BidPrice
    first_seen_s: dict[int, float] = field(default_factory=dict)
    ttft_hat_s: dict[int, tuple[float, ...]] = field(default_factory=dict)
    tpot_s: dict[int, tuple[float, ...]] = field(default_factory=dict)
    updates: list[PriceUpdate] = field(default_factory=list)
    free: list[tuple[float, FloatArray]] = field(default_factory=list)
    needs_snapshots: bool = True
    name: str = "bid_price"

    def __post_init__(self) -> None:
        self.tick_s = self.inner.tick_s

    def decide(self, ctx: RoutingContext) -> Decision:
        decision = self.inner.decide(ctx)
        rid = ctx.request.request_id
        if rid not in self.first_seen_s:
            self.first_seen_s[rid] = ctx.now_s
            self.ttft_hat_s[rid] = decision.explanation["ttft_s"]
            self.tpot_s[rid] = decision.explanation["tpot_s"]
        return decision

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        self.inner.tick(now_s, snapshots)
        view = self.inner.price_view()
        # price slot 0 starts at the book's origin (set by its first update)
        if view.origin_s is not None and view.num_updates > 0:
            self.updates.append(PriceUpdate(now_s, view.origin_s, view.prices))
        self.free.append((now_s, view.free))


@dataclass(frozen=True, slots=True)
class Recording:
    """One recorded bid_price run. Per-request arrays are indexed by request id."""

    loaded: LoadedConfig
    result: SimResult
    first_seen_s: FloatArray         # (N,)
    ttft_hat_s: FloatArray           # (N, G) BEA estimate at the first decision
    tpot_s: FloatArray               # (N, G) time per output token at the first decision
    decode_tokens: FloatArray        # (N, G) predicted output tokens (outlook)
    utility: FloatArray              # (N, G) quality - lambda * cost (outlook)
    exec_ttft_s: FloatArray          # (N, G) prompt / profiled prefill throughput
    updates: tuple[PriceUpdate, ...]
    free: tuple[tuple[float, FloatArray], ...]

    @property
    def slot_s(self) -> float:
        return self.loaded.config.router.slot_ms / 1e3

    @property
    def horizon(self) -> int:
        return self.loaded.config.router.horizon_slots


def record_bid_price(loaded: LoadedConfig, seed: int | None = None,
                     calibration: CalibrationSource | None = None,
                     progress: ProgressFn | None = None) -> Recording:
    """Run bid_price on the configured workload (as ``simulate`` would) and record."""
    cfg = loaded.config
    run_seed = cfg.sim.seed if seed is None else seed
    reqs = build_requests(loaded, run_seed)
    st = streams(run_seed, len(loaded.specs))
    source = calibration or CalibrationSource(loaded)
    env = policy_env(loaded, "bid_price", st.policy, source)
    inner = REGISTRY.create("bid_price", env)
    if not isinstance(inner, BidPrice):
        raise TypeError("the registered bid_price policy is not olproute's BidPrice")
    rec = Recorder(inner)
    res = make_cluster(loaded, rec, run_seed, record_batches=False).run(reqs, progress)
    n, g = len(reqs), len(loaded.specs)
    outlook = env.outlook()
    decode = np.empty((n, g))
    utility = np.empty((n, g))
    for r in reqs:
        out = outlook(r)
        decode[r.request_id] = out.decode_tokens
        utility[r.request_id] = out.utility(cfg.reward.cost_lambda)
    theta = np.array([c.prefill_tokens_per_s for c in source()], dtype=np.float64)
    prompt = np.array([r.prompt_tokens for r in reqs], dtype=np.float64)
    ttft_hat = np.full((n, g), np.nan)
    tpot = np.full((n, g), np.nan)
    seen = np.full(n, np.nan)
    for rid, t in rec.first_seen_s.items():
        seen[rid] = t
        ttft_hat[rid] = rec.ttft_hat_s[rid]
        tpot[rid] = rec.tpot_s[rid]
    return Recording(loaded=loaded, result=res, first_seen_s=seen, ttft_hat_s=ttft_hat,
                     tpot_s=tpot, decode_tokens=decode, utility=utility,
                     exec_ttft_s=prompt[:, None] / theta[None, :],
                     updates=tuple(rec.updates), free=tuple(rec.free))


def window_problem(rec: Recording, t0_s: float | None = None, t1_s: float | None = None,
                   max_delay: int | None = None, max_delay_cap: int = 200,
                   tail_slots: int | None = None) -> tuple[LpProblem, npt.NDArray[np.int64]]:
    """The LP of the requests arriving in [t0, t1) (default: the whole run, from its
    first tick), and their request ids.

    - Grid: slot 0 starts at t0; K covers the window plus ``tail_slots`` (default: the
      max delay), so that the last arrivals keep their whole start window.
    - Initial occupancy: the free capacity bid_price computed at the last tick at or
      before t0 (its residents' predicted usage), moved by the slots since; 1 past its
      horizon.
    - Max delay: the largest realised wait to the first token in the window, in slots
      (so the LP can start a request as late as the online policy did), capped at
      ``max_delay_cap``; or as given.
    - TTFT of a start without waiting: prompt over the profiled prefill throughput;
      time per output token: what bid_price used at the request's first decision.
    """
    res = rec.result
    slot, h = rec.slot_s, rec.horizon
    ticks = [t for t, _ in rec.free]
    if t0_s is None:
        t0_s = ticks[0] if ticks else float(res.requests[0].arrival_s)
    arrival = np.array([r.arrival_s for r in res.requests])
    if t1_s is None:
        t1_s = float(arrival.max()) + slot
    ids = np.nonzero((arrival >= t0_s) & (arrival < t1_s) & np.isfinite(rec.first_seen_s))[0]
    if len(ids) == 0:
        raise ValueError(f"no request arrives in [{t0_s}, {t1_s})")
    if max_delay is None:
        wait = res.first_token_s[ids] - arrival[ids]
        wait = wait[np.isfinite(wait)]
        max_delay = min(math.ceil(wait.max() / slot) if len(wait) else 0, max_delay_cap)
    tail = max_delay if tail_slots is None else tail_slots
    k = math.ceil((t1_s - t0_s) / slot - 1e-9) + tail
    g = len(rec.loaded.specs)
    free = np.ones((g, k, 2))
    before = [(t, c) for t, c in rec.free if t <= t0_s + 1e-12]
    if before:
        t_tick, c = before[-1]
        shift = int((t0_s - t_tick) // slot)
        avail = c[:, shift:]
        m = min(avail.shape[1], k)
        free[:, :m] = avail[:, :m]
    specs = rec.loaded.specs
    reqs = [res.requests[i] for i in ids]
    prob = LpProblem(
        slot_s=slot, num_slots=k, horizon=h, t0_s=float(t0_s), arrival_s=arrival[ids],
        prompt_tokens=np.array([r.prompt_tokens for r in reqs], dtype=np.float64),
        ttft_target_s=np.array([r.ttft_target_s for r in reqs], dtype=np.float64),
        decode_tokens=rec.decode_tokens[ids], utility=rec.utility[ids],
        tpot_s=rec.tpot_s[ids], exec_ttft_s=rec.exec_ttft_s[ids],
        batch_cap=np.array([s.max_num_seqs for s in specs], dtype=np.float64),
        kv_cap=np.array([s.kv_capacity_tokens for s in specs], dtype=np.float64),
        free=free, reward=rec.loaded.config.reward, max_delay=int(max_delay))
    return prob, ids.astype(np.int64)
