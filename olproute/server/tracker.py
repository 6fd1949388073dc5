"""What the router knows of each backend, kept from the traffic it proxies.

Every dispatch is counted at once (before the backend has seen the request); the proxied
stream then reports each token, and the end of the request. From these the tracker
builds, per backend, the load summary and the EngineSnapshot the estimators replay
(``olproute.routing.tracked``: requests that have streamed a token are running decoders, context
= prompt + tokens; of the others, those the backend's scheduler has taken in by now (in
dispatch order while a batch slot and KV blocks for the prompt remain) run in prefill,
the rest wait; how far a prefill has got is not known, the replay then over-estimates
what remains of it, the safe side). Scraped gauges
(vLLM's ``vllm:kv_cache_usage_perc``) reconcile the KV estimate when they report more
use than the tracker sees. Health: failures take a backend out; it is probed again after
an exponentially growing backoff.

Disaggregated prefill/decode pools (``olproute.routing.disagg``): a dispatch names a prefill and a
decode backend. The prefill backend holds the request as a flight (prompt, one output
token, which is discarded) until its answer; the decode backend counts it as *inbound*
(outstanding, and a row of ``inbound_rows`` for the policies) from the dispatch until its
decode starts: the decode stream's first token or, for a non-streamed decode, the moment
the decode request is sent. It then becomes a flight there as the decode backend serves
it (``decode_view``: the whole prompt, all but its last token computed, all its outputs
to come). The decode answer's tokens are all new; its first one is the request's first
token (the client's TTFT): the decode stream's first token, or the arrival of a
non-streamed decode answer.

The *handoff* of a streamed decode is the time from the end of its prefill to its decode
stream's first token: the KV transfer, the decode backend's queueing, and its first step
(recompute the last prompt token, sample the first output). A non-streamed decode's first
token is only seen with its whole answer, so its handoff is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.estimate.streamcal import StreamRecorder
from olproute.routing.disagg import decode_admission
from olproute.routing.tracked import admitted, tracked_blocks, tracked_snapshot
from olproute.server.engine_config import EngineConfig
from olproute.types import EngineSnapshot, InstanceLoad, InstanceSpec, Request


@dataclass(slots=True)
class Flight:
    """One request in flight on a backend (mutable: owned by the tracker)."""

    request: Request
    dispatch_s: float
    tokens: int = 0
    first_token_s: float | None = None
    streamed: bool = True  # False: tokens are only known when the whole answer arrives
    # prompt tokens whose KV arrived computed (a decode flight), or that the router's
    # prefix index expected cached there (its snapshots count them computed while it waits)
    computed_tokens: int = 0
    origin: Inbound | None = None  # a decode flight: its time as inbound
    # prompt tokens the engine said it computed (its KV events stored their blocks): it is
    # in prefill, scheduled, before its first token streams
    prefilled_tokens: int = 0

    @property
    def running(self) -> bool:
        """Taken to be running: it streamed a token, its engine said it stored some of
        its prompt's blocks (in prefill), or (not streamed) it was dispatched; a
        non-streamed request would otherwise look queued for its whole life."""
        return self.tokens > 0 or not self.streamed or self.prefilled_tokens > 0


@dataclass(slots=True)
class Inbound:
    """A request bound for a decode backend whose decode has not started (mutable:
    owned by the tracker). ``request`` is the decode backend's view of it
    and the prompt tokens whose KV arrives computed (``decode_view``)."""

    request: Request
    computed_tokens: int
    dispatch_s: float
    prefill_end_s: float | None = None
    streamed: bool = True  # False once a non-streamed decode request was sent


@dataclass(frozen=True, slots=True)
class Handoff:
    """A disaggregated request's phases (seconds on the server's clock): dispatch, end
    of the prefill (its answer), start of the decode (its stream's first token, the
    request's first token); ``handoff_s`` the time between the last two (None when a
    phase was not seen): the KV transfer, the decode's queueing and its first step."""

    dispatch_s: float
    prefill_end_s: float | None
    decode_start_s: float | None

    @property
    def handoff_s(self) -> float | None:
        if self.prefill_end_s is None or self.decode_start_s is None:
            return None
        return self.decode_start_s - self.prefill_end_s


def decode_view(request: Request) -> tuple[Request, int]:
    """(the request as its decode backend serves it, its prompt tokens whose KV arrives
    computed), as ``olproute.routing.disagg.decode_admission`` says: the same prompt, all but its
    last token computed, and the same (predicted) output, all of it generated there."""
    prompt, decode, computed = decode_admission(max(request.prompt_tokens, 1),
                                                max(request.decode_tokens, 1))
    return replace(request, prompt_tokens=prompt, decode_tokens=decode), computed


def prefill_view(request: Request) -> Request:
    """The request as its prefill backend serves it: the prompt and one output token
    (discarded by the proxy)."""
    return replace(request, decode_tokens=1, predicted_decode_tokens=1,
                   predicted_decode_by_model=None)


@dataclass(frozen=True, slots=True)
class Remote:
    """Other router replicas' requests on one backend, as they last published them
    (``olproute.server.shared``): per request in flight there, its prompt tokens,
    predicted output on this backend's model, tokens streamed, prompt tokens whose KV
    arrived computed, whether it is taken to be running, and its dispatch time (this
    replica's clock); ``inbound`` the (prompt, predicted decode, dispatch time) rows of
    their requests bound for it whose decode has not started (None: none)."""

    prompt: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    computed: tuple[int, ...] = ()
    running: tuple[bool, ...] = ()
    dispatch_s: tuple[float, ...] = ()
    inbound: npt.NDArray[np.float64] | None = None

    @property
    def num_flights(self) -> int:
        return len(self.prompt)

    @property
    def num_inbound(self) -> int:
        return 0 if self.inbound is None else len(self.inbound)


NO_REMOTE = Remote()


@dataclass(slots=True)
class BackendState:
    """One backend: its URL, its spec, what is in flight there, its health."""

    index: int
    spec: InstanceSpec
    url: str
    served_model: str   # the model name requests to it carry
    flights: dict[int, Flight] = field(default_factory=dict)
    inbound: dict[int, Inbound] = field(default_factory=dict)  # decode backends only
    healthy: bool = True
    failures: int = 0
    next_probe_s: float = 0.0
    scraped: dict[str, float] = field(default_factory=dict)
    scraped_at_s: float | None = None
    prefix_queries: float | None = None   # its scraped vllm:prefix_cache_queries_total
    # its scraped vllm:cache_config_info line, what it says, and where that differs from
    # the profile (olproute.server.engine_config)
    engine_line: str | None = None
    engine: EngineConfig | None = None
    engine_mismatches: tuple[str, ...] = ()
    batches_seen: int = 0
    num_handoffs: int = 0           # streamed decodes started here after a remote prefill
    handoff_seconds: float = 0.0    # their handoffs (prefill end -> first token), summed
    # bumped on every change of what the views read; the views are cached per version
    version: int = 0
    cache: dict[str, tuple[int, object]] = field(default_factory=dict)
    # its mixed requests' dispatches, token events and ends, for calibration from its
    # streams (olproute.estimate.streamcal); disaggregated requests are not recorded
    recorder: StreamRecorder = field(default_factory=StreamRecorder)
    # the other router replicas' requests here (none without shared state)
    remote: Remote = NO_REMOTE
    # its engine's names of the prompt blocks of its flights: key -> (request id, block
    # position) of each flight holding it (filled only where the engine's KV events are
    # read: prefill progress, engine_stored)
    block_owners: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


class Tracker:
    """Router-side state of every backend. Not thread-safe: use from the event loop."""

    def __init__(self, specs: Sequence[InstanceSpec], urls: Sequence[str],
                 base_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 served_models: Sequence[str | None] | None = None) -> None:
        """``served_models``: per backend, the model name it answers to (None, or none
        given: its profile's model name)."""
        if len(specs) != len(urls):
            raise ValueError("one URL per instance")
        names = list(served_models) if served_models is not None else [None] * len(specs)
        if len(names) != len(specs):
            raise ValueError("one served model name (or None) per instance")
        self.backends = [BackendState(i, s, u.rstrip("/"), m or s.model)
                         for i, (s, u, m) in enumerate(zip(specs, urls, names, strict=True))]
        self._base_backoff = base_backoff_s
        self._max_backoff = max_backoff_s
        # fresher engine state in the snapshots (server.prefill_from_kv_events and
        # server.running_from_scrape)
        self.prefill_from_events = False
        self.running_from_scrape = False
        # the last loads and snapshots of all backends, by (time, every backend's version):
        # the decisions within one tick of the loop's clock share them
        self._views: dict[str, tuple[tuple[float, ...], tuple[Any, ...]]] = {}

    # -- traffic -------------------------------------------------------------------------
    def dispatched(self, g: int, request: Request, now_s: float, streamed: bool = True,
                   cached_tokens: int = 0) -> None:
        """``cached_tokens``: its prompt tokens the router expects cached there."""
        b = self.backends[g]
        b.flights[request.request_id] = Flight(request, now_s, streamed=streamed,
                                               computed_tokens=cached_tokens)
        b.version += 1
        b.recorder.dispatched(request.request_id, request.prompt_tokens, streamed)
        keys = self._engine_keys(g, request)
        for pos, key in enumerate(keys):
            b.block_owners.setdefault(key, []).append((request.request_id, pos))

    def _engine_keys(self, g: int, request: Request) -> list[int]:
        """The request's prompt blocks as backend g's engine names them (none unless its
        KV events are read for prefill progress)."""
        own = request.engine_block_hashes
        if not self.prefill_from_events or own is None or own[g] is None:
            return []
        keys: list[int] = own[g].tolist()  # type: ignore[union-attr]
        return keys

    def engine_stored(self, g: int, keys: Sequence[int]) -> None:
        """Backend g's engine stored blocks with these keys (its KV events): the flights
        whose prompt holds them and that streamed nothing yet are in prefill, that far
        (the earliest dispatched of those sharing a block: the engine schedules in
        order)."""
        b = self.backends[g]
        if not b.block_owners:
            return
        size = b.spec.block_size
        for key in keys:
            for rid, pos in b.block_owners.get(key, ()):
                f = b.flights.get(rid)
                if f is None or f.tokens > 0 or f.prefilled_tokens >= (pos + 1) * size:
                    continue
                f.prefilled_tokens = min((pos + 1) * size, f.request.prompt_tokens)
                b.version += 1
                break

    def token(self, g: int, request_id: int, now_s: float, count: int = 1) -> None:
        """``count`` new answer tokens arrived; the first one of an inbound request starts
        its decode."""
        b = self.backends[g]
        f = b.flights.get(request_id)
        if f is None:
            if request_id not in b.inbound:
                return
            f = self._start_decode(b, request_id, now_s)
        elif f.origin is None:
            b.recorder.token(request_id, count)
        if f.first_token_s is None:
            f.first_token_s = now_s
        f.tokens += count
        b.version += 1

    def finished(self, g: int, request_id: int) -> Flight | None:
        b = self.backends[g]
        b.version += 1
        f = b.flights.pop(request_id, None)
        if f is not None and f.origin is None:
            b.recorder.ended(request_id)
        if f is not None and b.block_owners:
            for key in self._engine_keys(g, f.request):
                owners = b.block_owners.get(key)
                if owners is not None:
                    owners[:] = [o for o in owners if o[0] != request_id]
                    if not owners:
                        del b.block_owners[key]
        return f

    # -- disaggregated pools ---------------------------------------------------------------
    def dispatched_pair(self, p: int, d: int, request: Request, now_s: float) -> None:
        """A disaggregated dispatch: the prefill on ``p`` (waiting until its answer, its
        one discarded token) and the request inbound on ``d``."""
        rid = request.request_id
        bp, bd = self.backends[p], self.backends[d]
        bp.flights[rid] = Flight(prefill_view(request), now_s)
        bd.inbound[rid] = Inbound(*decode_view(request), now_s)
        bp.version += 1
        bd.version += 1

    def prefilled(self, p: int, d: int, request_id: int, now_s: float) -> Flight | None:
        """The prefill on ``p`` answered at ``now_s`` (not the request's first token: its
        token is discarded): its flight ends and the handoff to ``d`` begins."""
        bp = self.backends[p]
        f = bp.flights.pop(request_id, None)
        bp.version += 1
        inbound = self.backends[d].inbound.get(request_id)
        if inbound is not None:
            inbound.prefill_end_s = now_s
        return f

    def decode_sent(self, d: int, request_id: int, now_s: float, streamed: bool) -> None:
        """The decode request went to ``d``. A streamed decode starts at its first token;
        a non-streamed one starts now (its tokens are only known when it ends)."""
        b = self.backends[d]
        inbound = b.inbound.get(request_id)
        if inbound is None:
            return
        inbound.streamed = streamed
        if not streamed:
            self._start_decode(b, request_id, now_s)

    def _start_decode(self, b: BackendState, request_id: int, now_s: float) -> Flight:
        inbound = b.inbound.pop(request_id)
        req = inbound.request
        f = Flight(req, now_s, streamed=inbound.streamed,
                   computed_tokens=inbound.computed_tokens, origin=inbound)
        b.flights[request_id] = f
        if inbound.prefill_end_s is not None and inbound.streamed:
            b.num_handoffs += 1
            b.handoff_seconds += now_s - inbound.prefill_end_s
        b.version += 1
        return f

    def released_pair(self, p: int, d: int, request_id: int) -> tuple[
            Flight | None, Flight | None, Handoff | None]:
        """End a disaggregated request wherever it is (prefill, inbound or decode):
        (its prefill flight if still open, its decode flight if the decode started, its
        phases)."""
        bp, bd = self.backends[p], self.backends[d]
        prefill = bp.flights.pop(request_id, None)
        inbound = bd.inbound.pop(request_id, None)
        decode = bd.flights.pop(request_id, None)
        bp.version += 1
        bd.version += 1
        origin = inbound if decode is None else decode.origin
        handoff = None if origin is None else Handoff(
            origin.dispatch_s, origin.prefill_end_s,
            decode.dispatch_s if decode is not None and origin.streamed else None)
        return prefill, decode, handoff

    def inbound_rows(self) -> tuple[npt.NDArray[np.float64] | None, ...]:
        """Per backend, the (prompt, predicted decode, dispatch time) rows of the requests
        bound for it as their decode backend whose decode has not started there (in
        prefill, in transfer, or queued there before a streamed decode's first token), in
        dispatch order; None when none (``RoutingContext.inbound``, as the simulator
        gives it)."""
        out: list[npt.NDArray[np.float64] | None] = []
        for b in self.backends:
            rows = b.remote.inbound
            if b.inbound:
                mine = np.array(_inbound_rows(b), dtype=np.float64)
                rows = mine if rows is None else by_dispatch(np.concatenate([mine, rows]))
            out.append(rows)
        return tuple(out)

    # -- other router replicas -------------------------------------------------------------
    def ledger(self, g: int) -> tuple[list[tuple[int, int, int, int, bool, float]],
                                      list[tuple[int, int, float]]]:
        """This replica's own requests on backend ``g``, for the others: (prompt,
        predicted output on its model, tokens, computed prompt tokens, running, dispatch
        time) per flight, (prompt, predicted decode, dispatch time) per inbound request."""
        b = self.backends[g]
        model = b.spec.model
        flights = [(f.request.prompt_tokens, f.request.predicted_decode_tokens_for(model),
                    f.tokens, f.computed_tokens, f.running, f.dispatch_s)
                   for f in b.flights.values()]
        return flights, _inbound_rows(b)

    def set_remote(self, g: int, remote: Remote) -> None:
        """The other replicas' requests on backend ``g`` now (``NO_REMOTE``: none)."""
        b = self.backends[g]
        if remote is NO_REMOTE and b.remote is NO_REMOTE:
            return
        b.remote = remote
        b.version += 1

    def set_spec(self, g: int, spec: InstanceSpec) -> None:
        """Backend g is modelled as ``spec`` from now on (what its engine says it is)."""
        b = self.backends[g]
        b.spec = spec
        b.version += 1

    def set_scraped(self, g: int, gauges: dict[str, float], now_s: float) -> None:
        b = self.backends[g]
        b.scraped = gauges
        b.scraped_at_s = now_s
        b.version += 1

    def prefix_queries_scraped(self, g: int, total: float) -> bool:
        """Backend g's prefix-cache query counter was scraped at ``total``: True when it
        went down since the last scrape (the backend restarted: its cache is empty)."""
        b = self.backends[g]
        restarted = b.prefix_queries is not None and total < b.prefix_queries
        b.prefix_queries = total
        return restarted

    # -- health ----------------------------------------------------------------------------
    def healthy(self) -> list[bool]:
        return [b.healthy for b in self.backends]

    def mark_failure(self, g: int, now_s: float) -> None:
        b = self.backends[g]
        b.failures += 1
        b.healthy = False
        # its prefix cache is forgotten with it: the next scrape starts a new count, so a
        # restart seen here is not taken for a second one at the next scrape
        b.prefix_queries = None
        backoff = min(self._base_backoff * 2 ** (b.failures - 1), self._max_backoff)
        b.next_probe_s = now_s + backoff

    def mark_success(self, g: int) -> None:
        """A health probe passed: the backend takes traffic again. Its failure streak
        stays until a request of its own is answered (``mark_answered``), so a backend
        whose ``/health`` answers but whose requests fail (hang, stall) is tried again
        after ever longer backoffs instead of every probe period."""
        self.backends[g].healthy = True

    def mark_answered(self, g: int) -> None:
        """A request got its answer's first byte from the backend: its streak is over."""
        self.backends[g].failures = 0

    def due_for_probe(self, now_s: float) -> list[int]:
        """Backends to probe now: healthy ones every round, unhealthy ones after backoff."""
        return [b.index for b in self.backends if b.healthy or now_s >= b.next_probe_s]

    # -- views -----------------------------------------------------------------------------
    def _counts(self, b: BackendState) -> tuple[int, int]:
        """(running, KV blocks used), cached per version."""
        hit = b.cache.get("counts")
        if hit is not None and hit[0] == b.version:
            return hit[1]  # type: ignore[return-value]
        counts = (sum(1 for f in b.flights.values() if f.running) + sum(b.remote.running),
                  self._blocks_used(b))
        b.cache["counts"] = (b.version, counts)
        return counts

    def loads(self, now_s: float) -> tuple[InstanceLoad, ...]:
        key = self._views_key(now_s)
        hit = self._views.get("loads")
        if hit is not None and hit[0] == key:
            return hit[1]
        loads = tuple(self._load(b, now_s) for b in self.backends)
        self._views["loads"] = (key, loads)
        return loads

    def _views_key(self, now_s: float) -> tuple[float, ...]:
        """What the loads and snapshots of all backends depend on: the time and each
        backend's version (every change of its state bumps it)."""
        return (now_s, *[b.version for b in self.backends])

    def _load(self, b: BackendState, now_s: float) -> InstanceLoad:
        """The backend's load now, cached per version and time (the server's clock
        moves in whole milliseconds: requests decided within one share it)."""
        hit = b.cache.get("load")
        if hit is not None and hit[0] == b.version:
            load = hit[1]
            assert isinstance(load, InstanceLoad)
            if load.age_s == (0.0 if b.scraped_at_s is None else now_s - b.scraped_at_s):
                return load
        running, used = self._counts(b)
        entered, held = self._entered(b, used)
        running += entered
        used = min(used + held, b.spec.num_kv_blocks)
        load = InstanceLoad(
            index=b.index, name=b.spec.name, num_running=running,
            num_waiting=len(b.flights) + b.remote.num_flights - running,
            num_outstanding=(len(b.flights) + len(b.inbound) + b.remote.num_flights
                             + b.remote.num_inbound),
            num_kv_blocks_used=used, num_kv_blocks=b.spec.num_kv_blocks,
            max_num_seqs=b.spec.max_num_seqs,
            age_s=0.0 if b.scraped_at_s is None else now_s - b.scraped_at_s)
        b.cache["load"] = (b.version, load)
        return load

    def _entered(self, b: BackendState, used: int) -> tuple[int, int]:
        """(how many, KV blocks held) of the requests without a token the backend's
        scheduler has taken in (``olproute.routing.tracked.admitted``), cached per
        version."""
        hit = b.cache.get("entered")
        if hit is not None and hit[0] == b.version:
            return hit[1]  # type: ignore[return-value]
        r = b.remote
        rows = sorted([(f.dispatch_s, f.request.prompt_tokens,
                        max(f.computed_tokens, f.prefilled_tokens), f.running)
                       for f in b.flights.values()]
                      + [(r.dispatch_s[i], r.prompt[i], r.computed[i], r.running[i])
                         for i in range(r.num_flights)])
        taken, held = admitted([x[1] for x in rows], [x[2] for x in rows],
                               [x[3] for x in rows], b.spec, used)
        b.cache["entered"] = (b.version, (len(taken), held))
        return len(taken), held

    def _blocks_used(self, b: BackendState) -> int:
        fs, r = b.flights.values(), b.remote
        tracked = tracked_blocks([f.request.prompt_tokens for f in fs] + list(r.prompt),
                                 [f.tokens for f in fs] + list(r.tokens),
                                 [f.running for f in fs] + list(r.running),
                                 b.spec.block_size)
        perc = b.scraped.get("vllm:kv_cache_usage_perc")
        scraped = int(perc * b.spec.num_kv_blocks) if perc is not None else 0
        return min(max(tracked, scraped), b.spec.num_kv_blocks)

    def snapshot(self, g: int, now_s: float) -> EngineSnapshot:
        """The backend as a snapshot taken now (rebuilt only when its state changed)."""
        b = self.backends[g]
        hit = b.cache.get("snapshot")
        if hit is not None and hit[0] == b.version:
            snap = hit[1]
            assert isinstance(snap, EngineSnapshot)
            if snap.time_s == now_s:
                return snap
            # the constructor, not dataclasses.replace (a third of the cost, 8 per decision)
            snap = EngineSnapshot(now_s, snap.table, snap.num_running, snap.num_free_blocks,
                                  snap.inflight, now_s, snap.request_ids)
        else:
            snap = self._build_snapshot(b, now_s)
        # cached at its time: requests decided within one millisecond share it
        b.cache["snapshot"] = (b.version, snap)
        return snap

    def _build_snapshot(self, b: BackendState, now_s: float) -> EngineSnapshot:
        model = b.spec.model   # each request's predicted output on this backend's model
        r = b.remote
        # (dispatch time, id, prompt, tokens, predicted, computed, running); the other
        # replicas' requests get ids below 0 (they are no request of this replica's)
        # (dispatch time, id, prompt, tokens, predicted, computed, running, in prefill);
        # the other replicas' requests get ids below 0 (they are no request of this
        # replica's)
        rows = [(f.dispatch_s, f.request.request_id, f.request.prompt_tokens, f.tokens,
                 f.request.predicted_decode_tokens_for(model),
                 max(f.computed_tokens, f.prefilled_tokens), f.running,
                 f.streamed and f.tokens == 0 and f.prefilled_tokens > 0)
                for f in b.flights.values()]
        rows.extend((r.dispatch_s[i], -1 - i, r.prompt[i], r.tokens[i], r.decode[i],
                     r.computed[i], r.running[i], False) for i in range(r.num_flights))
        rows.sort(key=lambda row: row[0])
        if self.running_from_scrape:
            rows = self._scraped_running(b, rows)
        return tracked_snapshot(
            now_s, b.spec, [x[1] for x in rows], [x[2] for x in rows],
            [x[3] for x in rows], [x[4] for x in rows], [x[5] for x in rows],
            [x[6] for x in rows], self._counts(b)[1], [x[7] for x in rows])

    @staticmethod
    def _scraped_running(b: BackendState, rows: list[Any]) -> list[Any]:
        """Rows (dispatch order) with as many running as the engine said at its last
        scrape: the earliest dispatched before it that are not, taken in prefill."""
        said = b.scraped.get("vllm:num_requests_running")
        if said is None or b.scraped_at_s is None:
            return rows
        missing = int(said) - sum(1 for x in rows if x[6])
        out = []
        for x in rows:
            if missing > 0 and not x[6] and x[0] <= b.scraped_at_s:
                x = (*x[:6], True, True)
                missing -= 1
            out.append(x)
        return out

    def snapshots(self, now_s: float) -> tuple[EngineSnapshot, ...]:
        key = self._views_key(now_s)
        hit = self._views.get("snapshots")
        if hit is not None and hit[0] == key:
            return hit[1]
        snaps = tuple(self.snapshot(g, now_s) for g in range(len(self.backends)))
        self._views["snapshots"] = (key, snaps)
        return snaps


def by_dispatch(rows: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Inbound rows (prompt, predicted decode, dispatch time) in dispatch order."""
    return rows[np.argsort(rows[:, 2], kind="stable")]


def _inbound_rows(b: BackendState) -> list[tuple[int, int, float]]:
    """(prompt, predicted decode on the backend's model, dispatch time) of this replica's
    requests bound for backend ``b`` whose decode has not started."""
    model = b.spec.model
    return [(i.request.prompt_tokens, i.request.predicted_decode_tokens_for(model),
             i.dispatch_s) for i in b.inbound.values()]
