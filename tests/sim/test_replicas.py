"""Router replicas in the simulator (``olproute.sim.replicas``, issue 21): one replica is
the one router; with no staleness every replica sees the one router's view; with a sync
another replica's requests are seen exactly ``staleness`` late; with no sync never; the
leader's prices reach the followers ``staleness`` late; no replica reads the truth."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from olproute.config.loader import LoadedConfig
from olproute.policies import Policy
from olproute.pricing.book import PriceBook
from olproute.routing.tracked import router_view
from olproute.sim.cluster import Cluster, SimResult
from olproute.sim.replicas import Sync, replica_of
from olproute.sim.scenario import (
    CalibrationSource,
    build_requests,
    make_cluster,
    make_policy,
    make_replicas,
    simulate,
    simulate_replicas,
)
from olproute.types import (
    SNAP_OUTPUT,
    Decision,
    EngineSnapshot,
    Outcome,
    Request,
    RoutingContext,
)
from tests.sim.test_no_ground_truth import _homogeneous, _pools, perturbed, same

SEED = 3
EPS = 1e-9
_cache: dict[str, tuple[LoadedConfig, CalibrationSource, list[Request]]] = {}


def scenario(kind: str) -> tuple[LoadedConfig, CalibrationSource, list[Request]]:
    """Four Llama-2-7B engines past saturation (``mixed``) or configs/pd.yaml's pools
    (``pools``), as the no-ground-truth test builds them, with the router's view of the
    engines; the calibration profiled once."""
    if kind not in _cache:
        base = _homogeneous() if kind == "mixed" else _pools()
        if kind == "mixed":   # past saturation: the router holds some requests
            base = base.with_updates(workload=base.config.workload.model_copy(
                update={"rate_per_s": 40.0}))
        loaded = base.with_updates(sim=base.config.sim.model_copy(
            update={"snapshot_view": "router"}))
        cal = CalibrationSource(loaded)
        cal()
        _cache[kind] = (loaded, cal, build_requests(loaded, SEED))
    return _cache[kind]


@dataclass
class Seen(Policy):
    """Stands in for one replica's policy: records every context it decides on (and the
    decision), after ``check(ctx)``; notes its dispatches in ``dispatched`` (instance ->
    request -> time: the run carries a decision out at its context's time);
    ``price_books`` forwarded only when ``share``."""

    inner: Policy
    check: Callable[[RoutingContext], None] | None = None
    share: bool = True
    dispatched: dict[int, dict[int, float]] = field(default_factory=dict)
    contexts: list[tuple[RoutingContext, Decision]] = field(default_factory=list)
    calls: list[tuple[str, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.inner.name
        self.needs_snapshots = self.inner.needs_snapshots
        self.tick_s = self.inner.tick_s
        self.joint_release = self.inner.joint_release

    def decide(self, ctx: RoutingContext) -> Decision:
        if self.check is not None:
            self.check(ctx)
        decision = self.inner.decide(ctx)
        if decision.instance is not None:
            self.dispatched.setdefault(decision.instance, {})[decision.request_id] = ctx.now_s
        self.contexts.append((ctx, decision))
        self.calls.append(("decide", (ctx, decision)))
        return decision

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        assert not self.joint_release, "these tests decide held requests one by one"
        return super().decide_held(requests, context)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)
        self.calls.append(("observe", outcome))

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        self.inner.tick(now_s, snapshots)
        self.calls.append(("tick", (now_s, snapshots)))

    def price_books(self) -> tuple[PriceBook, ...]:
        return self.inner.price_books() if self.share else ()


def _replicas(kind: str, n: int, sync: Sync, check: Callable[[Cluster], Callable[
        [RoutingContext], None]] | None = None, share: bool = True
              ) -> tuple[SimResult, list[Seen]]:
    """``n`` bid_price replicas on the scenario, each wrapped in ``Seen``; ``check``
    builds each replica's check from the cluster before the run."""
    loaded, cal, requests = scenario(kind)
    seen = [Seen(p, share=share) for p in make_replicas(loaded, "bid_price", n, SEED, cal)]
    cluster = make_cluster(loaded, seen, SEED, sync=sync)
    if check is not None:
        for s in seen:
            s.check = check(cluster)
    return cluster.run(requests), seen


# -- one replica -------------------------------------------------------------------------
def _same_run(a: SimResult, b: SimResult) -> None:
    for name in ("instance", "decode_instance", "dispatch_s", "first_token_s", "finish_s",
                 "prefill_end_s", "kv_arrival_s", "num_preemptions", "decode_tokens", "shed",
                 "batch_log", "in_system_t", "in_system_n"):
        x, y = getattr(a, name), getattr(b, name)
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    assert (a.end_s, a.num_events) == (b.end_s, b.num_events)


@pytest.mark.parametrize("kind", ["mixed", "pools"])
def test_one_replica_is_the_one_router(kind: str) -> None:
    """One replica through the replicas' views and sync gives the one router's run (the
    router's view of the engines, ``sim.snapshot_view: router``) to the last event."""
    loaded, cal, requests = scenario(kind)
    one = simulate(loaded, "bid_price", requests, SEED, calibration=cal)
    assert one.shed.sum() > 0 or np.nanmax(one.dispatch_s - [
        r.arrival_s for r in requests]) > 0.1, "nothing held or shed: too easy a test"
    for sync in (Sync(0.0), Sync(0.2), Sync(None)):
        _same_run(one, simulate_replicas(loaded, "bid_price", 1, sync, requests, SEED,
                                         calibration=cal))


# -- what each replica sees ----------------------------------------------------------------
def _intervals(res: SimResult) -> dict[tuple[str, int], list[tuple[int, float, float]]]:
    """Per (``engine`` or ``inbound``, instance): (request, from, until) of every request
    while it was there: on a mixed or prefill engine from its dispatch to its finish or
    its prefill's end, on a decode engine from its KV's arrival to its finish, inbound on
    its decode instance from its dispatch to its KV's arrival."""
    out: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for r in np.flatnonzero(~res.shed):
        g, d = int(res.instance[r]), int(res.decode_instance[r])
        if d < 0:
            out.setdefault(("engine", g), []).append(
                (r, res.dispatch_s[r], res.finish_s[r]))
            continue
        out.setdefault(("engine", g), []).append((r, res.dispatch_s[r], res.prefill_end_s[r]))
        out.setdefault(("inbound", d), []).append((r, res.dispatch_s[r], res.kv_arrival_s[r]))
        out.setdefault(("engine", d), []).append((r, res.kv_arrival_s[r], res.finish_s[r]))
    return out


def _check_visibility(res: SimResult, seen: Sequence[Seen], staleness_s: float | None
                      ) -> int:
    """Every context of every replica k holds exactly the requests it should: its own
    while they are there now, another's while they were there ``staleness_s`` ago (never
    without a sync); moments within EPS of an edge are skipped. Another's request on a
    mixed engine runs in the view iff it had its first token by then. Returns the number
    of (context, request) pairs checked where the request was another replica's and seen."""
    n = len(seen)
    spans = _intervals(res)
    num_others_seen = 0
    for k, replica in enumerate(seen):
        for ctx, _ in replica.contexts:
            t = ctx.now_s
            for (where, g), rows in spans.items():
                if where == "engine":
                    assert ctx.snapshots is not None
                    snap = ctx.snapshots[g]
                    ids = snap.request_ids.tolist()
                    visible = set(ids)
                else:
                    inbound = ctx.inbound[g] if ctx.inbound is not None else None
                    visible_t = [] if inbound is None else sorted(inbound[:, 2].tolist())
                expected_t = []
                for r, t0, t1 in rows:
                    own = replica_of(int(r), n) == k
                    if not own and staleness_s is None:
                        inside: bool | None = False
                    else:
                        h = t if own else t - (staleness_s or 0.0)
                        near = min(abs(h - t0), abs(h - t1) if np.isfinite(t1) else np.inf)
                        inside = None if near < EPS else t0 < h < t1
                    if inside is None:
                        if where == "inbound":
                            break   # the multiset of dispatch times is ambiguous then
                        continue
                    if where == "inbound":
                        if inside:
                            expected_t.append(float(res.dispatch_s[r]))
                        continue
                    assert (int(r) in visible) == inside, (k, t, g, int(r), own)
                    if inside and not own:
                        num_others_seen += 1
                    if inside and not own and res.decode_instance[r] < 0:
                        h = t - (staleness_s or 0.0)
                        first = res.first_token_s[r]
                        if abs(first - h) > EPS:
                            running = snap.table[ids.index(int(r)), SNAP_OUTPUT] > 0
                            assert running == (first < h), (k, t, int(r))
                else:
                    if where == "inbound":
                        assert visible_t == sorted(expected_t), (k, t, g)
    return num_others_seen


@pytest.mark.parametrize("kind", ["mixed", "pools"])
def test_without_sync_a_replica_sees_only_its_own_requests(kind: str) -> None:
    res, seen = _replicas(kind, 2, Sync(None))
    assert _check_visibility(res, seen, None) == 0
    for k, replica in enumerate(seen):
        for ctx, _ in replica.contexts:
            assert ctx.snapshots is not None
            for snap in ctx.snapshots:
                assert all(replica_of(r, 2) == k for r in snap.request_ids.tolist())


@pytest.mark.parametrize("kind", ["mixed", "pools"])
def test_another_replicas_requests_are_seen_staleness_late(kind: str) -> None:
    """Sync 200 ms: a dispatch by replica A is invisible to B for 200 ms and visible
    after, until 200 ms after it left the engine (or reached its decode instance); its
    tokens as streamed 200 ms ago."""
    res, seen = _replicas(kind, 2, Sync(0.2))
    assert _check_visibility(res, seen, 0.2) > 1000


def _reference(cluster: Cluster, dispatched: dict[int, dict[int, float]]
               ) -> Callable[[RoutingContext], None]:
    """The check that a context's snapshots are the one router's view at that instant:
    ``router_view`` of each mixed or prefill engine's state, in the order of every
    replica's dispatches; a decode engine's rows as a set (their order is their KV's
    arrival, which no decision shows)."""
    def check(ctx: RoutingContext) -> None:
        assert ctx.snapshots is not None
        for g, engine in enumerate(cluster.engines):
            truth = engine.snapshot(ctx.now_s)
            mine = ctx.snapshots[g]
            assert ctx.instances[g].num_outstanding >= truth.num_resident
            if engine.spec.role == "decode":
                assert sorted(mine.request_ids.tolist()) == sorted(truth.request_ids.tolist())
                assert mine.num_free_blocks == router_view(
                    truth, {}, engine.spec).num_free_blocks
                continue
            ref = router_view(truth, dispatched.setdefault(g, {}), engine.spec)
            assert ctx.instances[g].num_outstanding == truth.num_resident
            for name in ("time_s", "num_running", "num_free_blocks", "inflight_start_s"):
                assert getattr(mine, name) == getattr(ref, name), name
            for name in ("table", "inflight", "request_ids"):
                assert np.array_equal(getattr(mine, name), getattr(ref, name)), name
    return check


@pytest.mark.parametrize("kind", ["mixed", "pools"])
def test_with_no_staleness_every_replica_sees_the_one_router_view(kind: str) -> None:
    """Sync 0: every context of either replica is the one router's view of the engines
    at that instant (``router_view`` of their exact state), and sees every request on
    its way to a decode instance."""
    dispatched: dict[int, dict[int, float]] = {}   # both replicas' dispatches
    loaded, cal, requests = scenario(kind)
    seen = [Seen(p, dispatched=dispatched)
            for p in make_replicas(loaded, "bid_price", 2, SEED, cal)]
    cluster = make_cluster(loaded, seen, SEED, sync=Sync(0.0))
    for s in seen:
        s.check = _reference(cluster, dispatched)
    res = cluster.run(requests)
    assert min(len(s.contexts) for s in seen) >= len(requests) // 2
    assert _check_visibility(res, seen, 0.0) > 1000


# -- prices ----------------------------------------------------------------------------
def test_the_followers_price_with_the_leaders_prices_staleness_late() -> None:
    """Sync 200 ms: replica 0 learns; replica 1 learns nothing and, at each decision,
    prices with the leader's book as the leader left it at its latest tick at least
    200 ms before; both windows hold the whole fleet's demand."""
    loaded, cal, requests = scenario("mixed")
    leader, follower = (Seen(p) for p in make_replicas(loaded, "bid_price", 2, SEED, cal))
    published: list[tuple[float, np.ndarray]] = []
    adopted: list[tuple[float, np.ndarray]] = []
    lead_tick = leader.tick

    def tick(now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        lead_tick(now_s, snapshots)
        published.append((now_s, leader.price_books()[0].p.copy()))

    def check(ctx: RoutingContext) -> None:
        adopted.append((ctx.now_s, follower.price_books()[0].p.copy()))

    leader.tick = tick  # type: ignore[method-assign]
    follower.check = check
    make_cluster(loaded, [leader, follower], SEED, sync=Sync(0.2)).run(requests)
    book0, book1 = leader.price_books()[0], follower.price_books()[0]
    assert book0.num_updates > 10 and book0.p.sum() > 0
    # the leader's last state may not have reached the follower when the run ended
    assert not book1.leading and book1.num_updates in (book0.num_updates - 1,
                                                        book0.num_updates)
    times = np.array([t for t, _ in published])
    checked = 0
    for t, p in adopted:
        i = int(np.searchsorted(times, t - 0.2, side="right")) - 1
        if i < 0 or min(abs(times - (t - 0.2))) < EPS:
            continue
        np.testing.assert_array_equal(p, published[i][1])
        checked += 1
    assert checked > len(adopted) // 2
    assert book0.num_samples == book1.num_samples == len(requests)


def test_without_sync_every_replica_learns_its_own_prices() -> None:
    requests = scenario("mixed")[2]
    seen = _replicas("mixed", 2, Sync(None))[1]
    books = [s.price_books()[0] for s in seen]
    assert all(b.leading and b.num_updates > 10 for b in books)
    assert not np.array_equal(books[0].p, books[1].p)
    assert [b.num_samples for b in books] == [len(requests) // 2] * 2


# -- the truth ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixed", "pools"])
def test_no_replica_reads_the_truth(kind: str) -> None:
    """Each replica's recorded calls (views 50 ms stale; prices learned alone, so that a
    replay needs no other replica) fed to a fresh copy with every request's truth
    replaced (``test_no_ground_truth``): every decision is the same."""
    loaded, cal, requests = scenario(kind)
    _, seen = _replicas(kind, 2, Sync(0.05), share=False)
    truth = perturbed(requests, seed=SEED + 2)
    other = loaded.with_updates(sim=loaded.config.sim.model_copy(
        update={"noise_cv": 0.2, "seed": SEED + 1}))
    twins = [make_policy(other, "bid_price", SEED, cal),
             *make_replicas(other, "bid_price", 2, SEED, cal)[1:]]
    num = 0
    for replica, twin in zip(seen, twins, strict=True):
        for kind_, arg in replica.calls:
            if kind_ == "observe":
                assert isinstance(arg, Outcome)
                twin.observe(arg)
            elif kind_ == "tick":
                twin.tick(*arg)  # type: ignore[misc]
            else:
                ctx, decision = arg  # type: ignore[misc]
                again = twin.decide(replace(ctx, request=truth[ctx.request.request_id]))
                assert same(again, decision), (ctx.now_s, decision, again)
                num += 1
    assert num >= len(requests)


def test_ledgers_shared_without_prices_leave_every_replica_its_own() -> None:
    """``Sync(s, prices=False)``: the views are the sync's, the prices each replica's."""
    requests = scenario("mixed")[2]
    res, seen = _replicas("mixed", 2, Sync(0.2, prices=False))
    assert _check_visibility(res, seen, 0.2) > 1000
    books = [s.price_books()[0] for s in seen]
    assert all(b.leading and b.num_updates > 10 for b in books)
    assert [b.num_samples for b in books] == [len(requests) // 2] * 2


def test_a_sync_needs_replicas_and_the_routers_view() -> None:
    loaded, cal, _ = scenario("mixed")
    policies = make_replicas(loaded, "bid_price", 2, SEED, cal)
    with pytest.raises(ValueError, match="give a sequence of policies"):
        make_cluster(loaded, policies[0], SEED, sync=Sync(0.05))
    with pytest.raises(ValueError, match="snapshot_age_s 0"):
        make_cluster(loaded, policies, SEED, snapshot_age_s=0.1, sync=Sync(0.05))
