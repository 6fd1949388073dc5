"""Discrete-event simulation of a cluster of engines behind one routing policy.

Events live on a heap of (time, priority, seq, kind, arg); ``seq`` is a counter owned by
the simulation, so ties break deterministically. At equal times a finishing batch is
handled before an arrival (it frees slots and blocks the arrival may use), an arrival
before the pass over the held requests, and that before a policy's periodic tick (price
updates, off the request path).

Requests reach an engine the instant they are dispatched; an idle engine starts a batch
at once, a busy one takes the request into its next batch. An arrival is decided at once;
a held request is decided again every slot (``slot_s``) after it was held, or, for a
policy with ``joint_release``, all held requests together at every slot boundary
(multiples of ``slot_s``) in one ``decide_held`` pass; a shed one is recorded and never
served. At most ``max_held`` requests are held at once, as in the server: an arrival the
policy would hold past that is shed.

With disaggregated pools (``olproute.routing.disagg``) a dispatch names a prefill and a decode
instance. The prefill engine runs the prompt and one token (not the client's); the KV
cache then moves for ``transfer(prompt tokens)`` seconds (a transfer event, handled with
the batch completions) and the decode engine admits the request with all but the last
prompt token computed; its first output token is the request's first token (TTFT).
Until its KV arrives the request counts as outstanding on the decode instance and shows
in the context's ``inbound`` rows there.

Given several policies instead of one, the cluster runs them as router replicas
(``olproute.sim.replicas``): request i goes to replica i mod N, which decides it, holds it
in its own buffer and hears its outcome; every replica ticks; what each sees is its own
ledger merged with the others' as the ``Sync`` says.

Each router keeps a prefix index (``olproute.routing.prefix_index``), built when the
first request with block hashes comes. ``prefix_index="approximate"``: the hashes it
sent where. ``"exact"``: what the engines say they hold, as a router fed by vLLM's KV
events knows it: the engines log their prefix caches' events, and after each batch an
engine finishes (vLLM publishes a step's events after the step) they go to every
router's index; an engine whose log overflowed is restored from its cache's contents.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from olproute.policies.base import Policy
from olproute.routing.disagg import Pools, decode_admission
from olproute.routing.prefix_index import PrefixIndex
from olproute.sim.engine import (
    BATCH_LOG_COLUMNS,
    FINISHED,
    FIRST_TOKEN,
    KV_STORED,
    BatchTimer,
    SimEngine,
)
from olproute.sim.replicas import Replicas, Sync, replica_of
from olproute.sim.snapshots import SnapshotFeed
from olproute.types import Decision, InstanceSpec, Outcome, Request, RoutingContext

_BATCH_DONE, _ARRIVAL, _RETRY, _TICK, _TRANSFER, _RELEASE = 0, 1, 2, 3, 4, 5
_heappush = heapq.heappush
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ProgressFn = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class SimResult:
    """Everything one run produced. Per-request arrays are indexed by request_id; NaN
    marks a time that never happened (shed requests), -1 an instance never chosen."""

    specs: tuple[InstanceSpec, ...]
    requests: tuple[Request, ...]
    instance: IntArray
    dispatch_s: FloatArray
    first_token_s: FloatArray
    finish_s: FloatArray
    num_preemptions: IntArray
    decode_tokens: IntArray          # output tokens actually generated (0 if shed)
    decode_instance: IntArray        # disaggregated pools: the decode instance (else -1)
    prefill_end_s: FloatArray        # when its prefill instance finished the prompt
    kv_arrival_s: FloatArray         # when its KV cache reached the decode instance
    shed: npt.NDArray[np.bool_]
    batch_log: FloatArray            # shape (num_batches, len(BATCH_LOG_COLUMNS))
    in_system_t: FloatArray          # times at which the number of requests in system changed
    in_system_n: IntArray            # the number from that time on
    end_s: float
    num_events: int
    # prompt tokens found in the prefix cache when first admitted (0 without block hashes;
    # on P/D pools, at the prefill instance); None in a result built without a run
    cached_prompt_tokens: IntArray | None = None
    # prompt tokens the router's prefix index expected cached at the instance it sent the
    # request to, when it sent it (0 without block hashes); None without a run
    expected_cached_tokens: IntArray | None = None


@dataclass(slots=True)
class _Records:
    """What one run records, per request (arrays indexed by request_id: NaN a time that
    never happened, -1 an instance never chosen) and over time (the number of requests in
    the system from each change on)."""

    instance: IntArray
    decode_instance: IntArray
    dispatch_s: FloatArray
    first_token_s: FloatArray
    prefill_end_s: FloatArray
    kv_arrival_s: FloatArray
    finish_s: FloatArray
    num_preemptions: IntArray
    decode_tokens: IntArray
    cached_prompt_tokens: IntArray
    expected_cached_tokens: IntArray
    shed: npt.NDArray[np.bool_]
    in_system_t: array[float]
    in_system_n: array[int]

    @staticmethod
    def empty(n: int) -> _Records:
        return _Records(
            instance=np.full(n, -1, dtype=np.int64),
            decode_instance=np.full(n, -1, dtype=np.int64),
            dispatch_s=np.full(n, np.nan), first_token_s=np.full(n, np.nan),
            prefill_end_s=np.full(n, np.nan), kv_arrival_s=np.full(n, np.nan),
            finish_s=np.full(n, np.nan), num_preemptions=np.zeros(n, dtype=np.int64),
            decode_tokens=np.zeros(n, dtype=np.int64),
            cached_prompt_tokens=np.zeros(n, dtype=np.int64),
            expected_cached_tokens=np.zeros(n, dtype=np.int64), shed=np.zeros(n, dtype=bool),
            in_system_t=array("d", [0.0]), in_system_n=array("q", [0]))


class Cluster:
    """Runs one policy, or several as router replicas, over a list of requests on engines
    built from specs."""

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        timers: Sequence[BatchTimer],
        policy: Policy | Sequence[Policy],
        slot_s: float,
        record_batches: bool = True,
        reference_core: bool = False,
        snapshot_age_s: float = 0.0,
        transfer: Callable[[int], float] | None = None,
        max_held: int | None = None,
        snapshot_view: Literal["engine", "router"] = "engine",
        sync: Sync | None = None,
        prefix_index: Literal["approximate", "exact"] = "approximate",
    ) -> None:
        """``policy``: one router's policy, or a sequence of them, one per router replica,
        whose views are their ledgers merged as ``sync`` says (default: no staleness);
        replicas see what a router rebuilds from its traffic (``snapshot_view`` must be
        ``router``, ``snapshot_age_s`` 0: the sync is their staleness). ``prefix_index``:
        what the routers' prefix indexes know (the module's docstring)."""
        if len(specs) != len(timers):
            raise ValueError("one timer per instance")
        if prefix_index not in ("approximate", "exact"):
            raise ValueError(f"prefix_index must be 'approximate' or 'exact', not "
                             f"{prefix_index!r}")
        self.exact_index = prefix_index == "exact"
        single = isinstance(policy, Policy)
        self.policies = (policy,) if isinstance(policy, Policy) else tuple(policy)
        if not self.policies:
            raise ValueError("no policy")
        if single and sync is not None:
            raise ValueError("a sync is for router replicas: give a sequence of policies")
        self.sync = None if single else sync or Sync(0.0)
        if self.sync is not None and (snapshot_view != "router" or snapshot_age_s != 0):
            raise ValueError("router replicas see their ledgers (snapshot_view 'router') "
                             "as fresh as their sync makes them (snapshot_age_s 0)")
        if len({(p.needs_snapshots, p.joint_release, p.tick_s) for p in self.policies}) > 1:
            raise ValueError("router replicas run one policy: the same needs_snapshots, "
                             "joint_release and tick_s")
        self.specs = tuple(specs)
        self.pools = Pools.of(specs)
        if self.pools.disaggregated and transfer is None:
            raise ValueError("disaggregated pools need a KV transfer time")
        self.transfer = transfer
        self.max_held = max_held
        self.roles = [s.role for s in specs]
        self._log: array[float] | None = array("d") if record_batches else None
        self.engines = [SimEngine(i, s, t, self._log, reference_core, self.exact_index)
                        for i, (s, t) in enumerate(zip(specs, timers, strict=True))]
        # each router's prefix index after the last run (None: it built none)
        self.prefix_indexes: tuple[PrefixIndex | None, ...] = ()
        self.policy = self.policies[0]
        self.slot_s = slot_s
        self.outstanding = [0] * len(specs)
        self.feed = SnapshotFeed(self.engines, snapshot_age_s, snapshot_view)
        self.needs_snapshots = self.policy.needs_snapshots
        self.joint_release = self.policy.joint_release
        # a policy with tick_s > 0 learns off the request path every tick_s seconds
        self.tick_s = self.policy.tick_s

    def run(self, requests: Sequence[Request], progress: ProgressFn | None = None) -> SimResult:
        """Every event in time order, each handled by the method of its kind."""
        run = _Run(self, requests, progress)
        handlers = (run.batch_done, run.arrival, run.retry, run.tick, run.transfer,
                    run.release)
        heap, pop = run.heap, heapq.heappop
        num_events, now = 0, 0.0
        while heap:
            now, _prio, _seq, kind, arg = pop(heap)
            num_events += 1
            handlers[kind](now, arg)
        self.prefix_indexes = tuple(r.prefixes for r in run.routers)
        return run.result(now, num_events)

    def batch_log(self) -> FloatArray:
        """Every batch the engines ran, one row each (``BATCH_LOG_COLUMNS``)."""
        width = len(BATCH_LOG_COLUMNS)
        return (np.frombuffer(self._log, dtype=np.float64).reshape(-1, width).copy()
                if self._log is not None else np.zeros((0, width)))

    def check_pair(self, g: int, d: int | None) -> int:
        """A disaggregated dispatch names a prefill and a decode instance."""
        if self.roles[g] != "prefill":
            raise ValueError(f"policy sent a request to {self.specs[g].name!r} "
                             f"(role {self.roles[g]}) for its prefill")
        if d is None or not 0 <= d < len(self.specs) or self.roles[d] != "decode":
            raise ValueError(f"policy named decode instance {d!r}, not one of the decode "
                             f"pool {self.pools.decode.tolist()}")
        return d


@dataclass(slots=True)
class _Router:
    """One router of a run: its policy, its buffer of held requests (ids, in the order
    they were held) and the time of its next pass over them (``joint_release``)."""

    index: int
    policy: Policy
    held: dict[int, None] = field(default_factory=dict)
    release_at: float | None = None
    # where it sent prompt prefixes (built when a request with block hashes comes)
    prefixes: PrefixIndex | None = None


class _Run:
    """One run of a cluster over its requests: the event heap (tuples of time, priority,
    seq, kind, arg, with ``seq`` counted here so ties break deterministically), the
    records, the routers (each with its buffer of held requests), and one method per
    event kind. A tick's and a joint release's arg is the router's index."""

    __slots__ = ("arrived", "cluster", "done", "engines", "exact", "feed", "heap", "in_system",
                 "inbound", "outstanding", "progress", "rec", "replicas", "requests",
                 "role", "routers", "seq")

    def __init__(self, cluster: Cluster, requests: Sequence[Request],
                 progress: ProgressFn | None) -> None:
        if any(r.request_id != i for i, r in enumerate(requests)):
            raise ValueError("request_id must equal the request's position in the list")
        self.cluster = cluster
        self.requests = requests
        self.progress = progress
        self.rec = _Records.empty(len(requests))
        self.engines = cluster.engines
        self.exact = cluster.exact_index
        self.outstanding, self.role = cluster.outstanding, cluster.roles
        self.routers = [_Router(k, p) for k, p in enumerate(cluster.policies)]
        self.replicas = None if cluster.sync is None else Replicas(
            cluster.engines, cluster.policies, cluster.sync, cluster.pools.disaggregated)
        self.feed: SnapshotFeed | Replicas = (cluster.feed if self.replicas is None
                                              else self.replicas)
        # per instance: request_id -> (dispatch time, prompt, predicted decode) of requests
        # bound for it as their decode instance whose KV has not arrived yet
        self.inbound: list[dict[int, tuple[float, int, int]]] = [{} for _ in cluster.engines]
        self.arrived = self.in_system = self.done = 0
        self.heap: list[tuple[float, int, int, int, int]] = [
            (r.arrival_s, _ARRIVAL, seq, _ARRIVAL, r.request_id)
            for seq, r in enumerate(requests)]
        self.seq = len(requests)
        if cluster.tick_s > 0 and requests:
            for k in range(len(self.routers)):
                self.heap.append((requests[0].arrival_s, _TICK, self.seq, _TICK, k))
                self.seq += 1
        heapq.heapify(self.heap)

    def _router(self, rid: int) -> _Router:
        """The router a request goes to (``replica_of``: round robin)."""
        return self.routers[replica_of(rid, len(self.routers))]

    def push(self, t: float, prio: int, kind: int, arg: int) -> None:
        _heappush(self.heap, (t, prio, self.seq, kind, arg))
        self.seq += 1

    # -- events ---------------------------------------------------------------------------
    def batch_done(self, now: float, g: int) -> None:
        """Engine g finished a batch: its requests' first tokens and finishes
        (``_finished``), then its next batch. The most frequent event: ``_start`` is
        written out here."""
        eng = self.engines[g]
        events = eng.finish_batch()
        if self.exact:
            self._kv_events(g)
        if events:
            self._finished(now, g, events)
        duration = eng.start_batch(now)
        self.feed.publish(g, now)
        if duration is not None:
            _heappush(self.heap, (now + duration, _BATCH_DONE, self.seq, _BATCH_DONE, g))
            self.seq += 1

    def _kv_events(self, g: int) -> None:
        """Engine g's KV events since its last batch, into every router's index (built
        if it was not yet); when its log overflowed, each index's view of g is its
        cache's contents instead."""
        eng = self.engines[g]
        kinds, hashes, dropped = eng.take_kv_events()
        if dropped == 0 and len(kinds) == 0:
            return
        contents = eng.cache_contents() if dropped > 0 else None
        for k in range(len(self.routers)):
            index = self._index(k)
            if contents is None:
                _apply_kv_events(index, g, kinds, hashes)
            else:
                index.clear(g)
                index.stored(g, [h for h, n in contents for _ in range(n)])

    def _finished(self, now: float, g: int, events: list[tuple[int, int, int]]) -> None:
        """Record first tokens and finishes; a prefill engine's finished prompts move on
        as KV transfers (``_prefilled``)."""
        rec = self.rec
        cached = self.engines[g].cached_prompt_tokens
        if cached:
            for rid, tokens in cached.items():
                rec.cached_prompt_tokens[rid] = tokens
            cached.clear()
        prefill_role = self.role[g] == "prefill"
        for rid, flags, npre in events:
            if prefill_role:
                self._prefilled(now, g, rid, npre)
                continue
            if flags & FIRST_TOKEN:
                rec.first_token_s[rid] = now
            if flags & FINISHED:
                rec.num_preemptions[rid] += npre
                self.feed.finished(g, rid)
                self._complete(rid, g, now)

    def _prefilled(self, now: float, g: int, rid: int, npre: int) -> None:
        """Its prompt is done (the one token is not the client's): the KV cache moves."""
        rec = self.rec
        rec.prefill_end_s[rid] = now
        rec.num_preemptions[rid] += npre
        self.feed.finished(g, rid)
        self.outstanding[g] -= 1
        transfer = self.cluster.transfer
        assert transfer is not None
        self.push(now + transfer(self.requests[rid].prompt_tokens), _BATCH_DONE, _TRANSFER, rid)

    def transfer(self, now: float, rid: int) -> None:
        """A request's KV cache reached its decode instance, which admits it."""
        rec = self.rec
        d = int(rec.decode_instance[rid])
        req = self.requests[rid]
        rec.kv_arrival_s[rid] = now
        _, _, predicted = self.inbound[d].pop(rid)
        prompt, out, computed = decode_admission(req.prompt_tokens, int(rec.decode_tokens[rid]))
        if self.replicas is not None:
            self.replicas.arrived(d, now, rid)
            self.replicas.dispatched(d, now, rid, prompt, predicted, computed)
        else:
            self.feed.dispatched(d, now, rid, prompt, predicted)
        self.engines[d].admit(rid, prompt, out, predicted, computed)
        if not self.engines[d].busy:
            self._start(d, now)

    def tick(self, now: float, k: int) -> None:
        """Router k's policy learns off the request path; its next tick while work
        remains."""
        if self.replicas is not None:
            self.replicas.tick(now, k)
        else:
            self.routers[k].policy.tick(now, self.cluster.feed.view(now)[0])
        if self.arrived < len(self.requests) or self.in_system > 0:
            self.push(now + self.cluster.tick_s, _TICK, _TICK, k)

    def arrival(self, now: float, rid: int) -> None:
        self.arrived += 1
        self.in_system += 1
        self.rec.in_system_t.append(now)
        self.rec.in_system_n.append(self.in_system)
        router = self._router(rid)
        decision = router.policy.decide(self._context(now, self.requests[rid], router.index))
        if decision.action == "hold":
            max_held = self.cluster.max_held
            if max_held is not None and len(router.held) >= max_held:
                decision = Decision(rid, "shed", None, f"buffer full ({max_held} "
                                    "requests held)", refusal="buffer_full")
            else:
                router.held[rid] = None
                self._next_retry(now, rid, router)
        self._carry_out(now, rid, decision)

    def retry(self, now: float, rid: int) -> None:
        """A held request decided again, a slot after the last time; the next a slot
        later while it is still held."""
        router = self._router(rid)
        decision = router.policy.decide(self._context(now, self.requests[rid], router.index))
        if decision.action == "hold":
            self._next_retry(now, rid, router)
        else:
            del router.held[rid]
            self._carry_out(now, rid, decision)

    def release(self, now: float, k: int) -> None:
        """A slot boundary, for a policy with ``joint_release``: router k decides its held
        requests in one pass (``Policy.decide_held``), each decision carried out before
        the next is asked for; the next pass a slot later while any is still held."""
        router = self.routers[k]
        router.release_at = None
        held = router.held
        requests = [self.requests[rid] for rid in held]
        for decision in router.policy.decide_held(
                requests, lambda r: self._context(now, r, k)):
            rid = decision.request_id
            if rid not in held:
                raise ValueError(f"policy decided request {rid}, which is not held")
            if decision.action != "hold":
                del held[rid]
                self._carry_out(now, rid, decision)
        if held:
            self._next_pass(now, router)

    def _next_retry(self, now: float, rid: int, router: _Router) -> None:
        """The request's next decision: a slot from now, or with ``joint_release`` the
        router's pass at the next slot boundary after now (one for all)."""
        if self.cluster.joint_release:
            self._next_pass(now, router)
        else:
            self.push(now + self.cluster.slot_s, _RETRY, _RETRY, rid)

    def _next_pass(self, now: float, router: _Router) -> None:
        """The router's pass over its held requests at the next slot boundary after now
        (once)."""
        if router.release_at is None:
            slot = self.cluster.slot_s
            router.release_at = (math.floor(now / slot + 1e-9) + 1) * slot
            self.push(router.release_at, _RETRY, _RELEASE, router.index)

    def _carry_out(self, now: float, rid: int, decision: Decision) -> None:
        if decision.action == "dispatch":
            self._dispatch(now, rid, decision)
        elif decision.action == "shed":
            self._shed(now, rid)

    # -- what the events do ---------------------------------------------------------------
    def _context(self, now: float, req: Request, k: int) -> RoutingContext:
        """What router k sees when it decides ``req`` now (with a request with block
        hashes, its prefix as router k's index finds it on each instance)."""
        prefixes = None if req.block_hashes is None else self._index(k).match(
            req.block_hashes, req.prompt_tokens)
        if self.replicas is not None:
            ctx = self.replicas.context(now, req, k)
            return ctx if prefixes is None else replace(ctx, prefixes=prefixes)
        c = self.cluster
        snaps, pending = c.feed.view(now) if c.needs_snapshots else (None, None)
        return RoutingContext(
            request=req, now_s=now, specs=c.specs,
            instances=tuple(e.load(self.outstanding[e.index]) for e in self.engines),
            snapshots=snaps, pending=pending,
            inbound=_rows(self.inbound) if c.pools.disaggregated else None,
            prefixes=prefixes)

    def _index(self, k: int) -> PrefixIndex:
        """Router k's prefix index, built the first time (exact: on every instance
        with prefix caching)."""
        router = self.routers[k]
        if router.prefixes is None:
            specs = self.cluster.specs
            router.prefixes = PrefixIndex(specs)
            if self.exact:
                for g, spec in enumerate(specs):
                    if spec.enable_prefix_caching:
                        router.prefixes.set_exact(g, block_size=spec.block_size)
        return router.prefixes

    def _dispatch(self, now: float, rid: int, decision: Decision) -> None:
        c, rec, req = self.cluster, self.rec, self.requests[rid]
        g = decision.instance
        assert g is not None
        if not 0 <= g < len(self.engines):
            raise ValueError(f"policy chose instance {g}, out of range")
        rec.instance[rid] = g
        rec.dispatch_s[rid] = now
        # what the index expected cached there: a stale snapshot's pending rows carry it,
        # and the router's view of a waiting request
        cached = 0 if req.block_hashes is None else self._index(
            replica_of(rid, len(self.routers))).sent(g, req.block_hashes, req.prompt_tokens)
        rec.expected_cached_tokens[rid] = cached
        self.outstanding[g] += 1
        model = c.specs[g].model
        predicted = req.predicted_decode_tokens_for(model)
        rec.decode_tokens[rid] = req.true_decode_tokens(model)
        if c.pools.disaggregated:
            d = c.check_pair(g, decision.decode_instance)
            rec.decode_instance[rid] = d
            self.outstanding[d] += 1
            self.inbound[d][rid] = (now, req.prompt_tokens, predicted)
            if self.replicas is not None:
                self.replicas.bound(d, now, rid, req.prompt_tokens, predicted)
            self.feed.dispatched(g, now, rid, req.prompt_tokens, 1)
            self._admit(g, req, 1, 1)
        else:
            self.feed.dispatched(g, now, rid, req.prompt_tokens, predicted, cached)
            self._admit(g, req, int(rec.decode_tokens[rid]), predicted)
        if not self.engines[g].busy:
            self._start(g, now)

    def _admit(self, g: int, req: Request, decode_tokens: int, predicted: int) -> None:
        """Engine g queues the request (its prefill, on P/D pools), with its block hashes
        when it has some (without, the call is the one before hashes existed)."""
        if req.block_hashes is None:
            self.engines[g].admit(req.request_id, req.prompt_tokens, decode_tokens, predicted)
        else:
            self.engines[g].admit(req.request_id, req.prompt_tokens, decode_tokens, predicted,
                                  block_hashes=req.block_hashes)

    def _shed(self, now: float, rid: int) -> None:
        self.rec.shed[rid] = True
        self._left(now)
        self._router(rid).policy.observe(_outcome(
            self.requests[rid], None, float("nan"), float("nan"), float("nan"), 0, 0))
        self._progress()

    def _start(self, g: int, t: float) -> None:
        duration = self.engines[g].start_batch(t)
        self.feed.publish(g, t)
        if duration is not None:
            _heappush(self.heap, (t + duration, _BATCH_DONE, self.seq, _BATCH_DONE, g))
            self.seq += 1

    def _complete(self, rid: int, g: int, t: float) -> None:
        rec = self.rec
        rec.finish_s[rid] = t
        self.outstanding[g] -= 1
        self._left(t)
        d = int(rec.decode_instance[rid])
        self._router(rid).policy.observe(_outcome(
            self.requests[rid], int(rec.instance[rid]), rec.dispatch_s[rid],
            rec.first_token_s[rid], t, int(rec.num_preemptions[rid]),
            int(rec.decode_tokens[rid]), None if d < 0 else d))
        self._progress()

    def _left(self, t: float) -> None:
        """A request left the system (finished or shed)."""
        self.in_system -= 1
        self.rec.in_system_t.append(t)
        self.rec.in_system_n.append(self.in_system)
        self.done += 1

    def _progress(self) -> None:
        if self.progress is not None:
            self.progress(self.done)

    def result(self, end_s: float, num_events: int) -> SimResult:
        rec = self.rec
        return SimResult(
            specs=self.cluster.specs, requests=tuple(self.requests), instance=rec.instance,
            dispatch_s=rec.dispatch_s, first_token_s=rec.first_token_s, finish_s=rec.finish_s,
            num_preemptions=rec.num_preemptions, decode_tokens=rec.decode_tokens,
            decode_instance=rec.decode_instance, prefill_end_s=rec.prefill_end_s,
            kv_arrival_s=rec.kv_arrival_s, shed=rec.shed, batch_log=self.cluster.batch_log(),
            in_system_t=np.frombuffer(rec.in_system_t, dtype=np.float64).copy(),
            in_system_n=np.frombuffer(rec.in_system_n, dtype=np.int64).copy(),
            end_s=end_s, num_events=num_events, cached_prompt_tokens=rec.cached_prompt_tokens,
            expected_cached_tokens=rec.expected_cached_tokens)


def _outcome(req: Request, g: int | None, dispatch: float, first: float, finish: float,
             preemptions: int, decode_tokens: int,
             decode_instance: int | None = None) -> Outcome:
    def opt(x: float) -> float | None:
        return None if x != x else float(x)  # NaN -> None
    return Outcome(
        request_id=req.request_id, instance=g, arrival_s=req.arrival_s,
        dispatch_s=opt(dispatch), first_token_s=opt(first), finish_s=opt(finish),
        prompt_tokens=req.prompt_tokens, decode_tokens=decode_tokens,
        predicted_decode_tokens=req.predicted_decode_tokens, num_preemptions=preemptions,
        decode_instance=decode_instance)


def _apply_kv_events(index: PrefixIndex, g: int, kinds: IntArray, hashes: IntArray) -> None:
    """An engine's events, in order, into instance g's exact index: each run of one kind
    as one ``stored`` or ``removed`` call (the order matters: a block stored and evicted
    within one batch is gone)."""
    cuts = (np.flatnonzero(np.diff(kinds)) + 1).tolist()
    for start, end in zip([0, *cuts], [*cuts, len(kinds)], strict=True):
        keys = hashes[start:end].tolist()
        if kinds[start] == KV_STORED:
            index.stored(g, keys)
        else:
            index.removed(g, keys)


def _rows(inbound: Sequence[dict[int, tuple[float, int, int]]]
          ) -> tuple[FloatArray | None, ...]:
    """Per instance, (prompt, predicted decode, dispatch time) rows of its inbound
    requests in dispatch order, or None when there are none."""
    out: list[FloatArray | None] = []
    for rows in inbound:
        if not rows:
            out.append(None)
            continue
        out.append(np.array([(p, o, t) for t, p, o in rows.values()], dtype=np.float64))
    return tuple(out)
