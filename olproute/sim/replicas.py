"""Several router replicas in front of one simulated cluster (docs/design.md, "Many
routers" in section 4; docs/guides/replicas.md).

Each replica is its own policy object; the requests are split among them round robin in
arrival order (``replica_of``). What a replica's policy sees is built the way the server
builds it from its tracker's ledger (``olproute.routing.tracked``): per engine, the requests in
flight there (prompt, predicted output, tokens streamed so far, dispatch order), the ones
streaming running and the others waiting with nothing computed, no batch in flight. Which
requests it sees depends on the sync (``Sync``):

* its own dispatches, always, fresh: it proxies their streams;
* another replica's, as that replica last published its ledger, ``staleness_s`` ago: a
  dispatch becomes visible ``staleness_s`` after it was made, a finished request
  disappears ``staleness_s`` after it finished, and the tokens are those streamed by then.
  With 0 every replica sees every dispatch at once, which is the one router's view;
* with no sync (``staleness_s`` None), never.

The same goes for the requests on their way to a decode instance (``RoutingContext.inbound``)
and for the loads (``InstanceLoad``: running, waiting, outstanding, KV blocks, as
``olproute.server.tracker`` counts them).

Prices, with a sync: every replica's price books share their demand (the samples built at
its ticks and its arrival times), which reaches the others ``staleness_s`` later; replica
0 leads: it alone learns, and its books' states reach the others (followers, which learn
nothing) ``staleness_s`` after each of its ticks. Without a sync (or with
``Sync.prices`` False) each replica learns its own prices from its own share of the
requests. A policy without price books
(``Policy.price_books``) shares nothing. All replicas' clocks are the simulation's, so
nothing is shifted.

What a replica is told (another's demand, the leader's prices) is delivered lazily: before
its next decision or tick, everything due by then, in the order it was sent.

How the stale part is kept: each engine publishes its state (``SimEngine.snapshot``)
whenever it starts a batch or falls idle; its requests' tokens only change when a batch
ends, which is such a moment. A replica at time t sees another's requests on engine g as
the latest publication at or before t - s holds them, plus those admitted after it and by
t - s (no token yet).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from olproute.policies.base import Policy
from olproute.routing.tracked import router_view
from olproute.sim.engine import SimEngine
from olproute.types import (
    SNAP_OUTPUT,
    Demand,
    EngineSnapshot,
    InstanceLoad,
    InstanceSpec,
    PriceState,
    Request,
    RoutingContext,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
_NO_INFLIGHT = np.zeros((0, 2), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Sync:
    """How router replicas share what they know: another replica's ledger, demand and
    the leader's prices reach a replica ``staleness_s`` seconds late; None: no sync, each
    replica sees its own ledger and learns its own prices. ``prices`` False: the ledgers
    are shared but every replica learns its own prices (what the price sync adds)."""

    staleness_s: float | None
    prices: bool = True

    def __post_init__(self) -> None:
        if self.staleness_s is not None and not self.staleness_s >= 0:
            raise ValueError(f"staleness must be >= 0 seconds, got {self.staleness_s}")

    @property
    def label(self) -> str:
        if self.staleness_s is None:
            return "no sync"
        return f"{self.staleness_s * 1e3:g} ms" + ("" if self.prices else ", prices own")


def replica_of(request_id: int, num_replicas: int) -> int:
    """The replica a request goes to: round robin in arrival order (request ids are
    arrival positions in the simulator)."""
    return request_id % num_replicas


class Replicas:
    """The views and the sync of ``len(policies)`` replicas over ``engines`` for one run.

    The run feeds it what happens (``publish``, ``dispatched``, ``finished`` as it feeds a
    ``SnapshotFeed``; ``bound`` and ``arrived`` for the requests on their way to a decode
    instance) and asks it for replica k's context (``context``) and to run replica k's
    tick (``tick``)."""

    def __init__(self, engines: Sequence[SimEngine], policies: Sequence[Policy], sync: Sync,
                 disaggregated: bool) -> None:
        self.engines = list(engines)
        self.specs = tuple(e.spec for e in engines)
        self.policies = list(policies)
        self.num_replicas = len(policies)
        self.staleness_s = sync.staleness_s
        self.disaggregated = disaggregated
        self.needs_snapshots = self.policies[0].needs_snapshots
        stale = self.staleness_s is not None and self.staleness_s > 0
        self._stale = stale
        # per engine: request_id -> when it entered the engine's ledger (its dispatch; on
        # a decode instance, its KV's arrival): the ledgers' order. Kept after a finish,
        # since others see the request until s later.
        self._entered: list[dict[int, float]] = [{} for _ in engines]
        # per engine, with s > 0: its publications, and its admissions since the oldest
        # kept one as (time, request_id, prompt, predicted, computed)
        self._published: list[deque[EngineSnapshot]] = [deque() for _ in engines]
        self._admitted: list[deque[tuple[float, int, int, int, int]]] = [
            deque() for _ in engines]
        # per engine: the stale rows last built, with their key (the publication they
        # start from, the admissions since it by then)
        self._stale_at: list[tuple[tuple[EngineSnapshot | None, int], EngineSnapshot] | None] = [
            None for _ in engines]
        # per engine: a count of its changes (admissions, finishes, batches), and per
        # replica the view last built of it with what it was built from, rebuilt only when
        # either changed (decisions and retries far outnumber an engine's changes)
        self._version = [0] * len(engines)
        self._views: list[list[tuple[object, EngineSnapshot, int] | None]] = [
            [None] * len(policies) for _ in engines]
        # per instance: request_id -> [dispatch time, prompt, predicted, KV arrival (inf
        # until then)] of requests bound for it as their decode instance, in dispatch
        # order; an arrived one is kept while others may still see it on its way
        self._inbound: list[dict[int, list[float]]] = [{} for _ in engines]
        self._prices = _PriceSync(self.policies, sync)

    # -- what happens (the run's bookkeeping) ----------------------------------------------
    def publish(self, g: int, now_s: float) -> None:
        """Engine g started a batch or fell idle: its state is published."""
        self._version[g] += 1
        if self._stale:
            self._published[g].append(self.engines[g].snapshot(now_s))

    def dispatched(self, g: int, now_s: float, request_id: int, prompt: int,
                   predicted: int, computed: int = 0) -> None:
        """A request entered engine g (``computed``: prompt tokens whose KV arrived)."""
        self._version[g] += 1
        self._entered[g][request_id] = now_s
        if self._stale:
            self._admitted[g].append((now_s, request_id, prompt, predicted, computed))

    def finished(self, g: int, request_id: int) -> None:
        """A request left engine g: the engine's state says so from now on."""
        self._version[g] += 1

    def bound(self, d: int, now_s: float, request_id: int, prompt: int,
              predicted: int) -> None:
        """A request dispatched with decode instance d; its KV is on its way."""
        self._inbound[d][request_id] = [now_s, float(prompt), float(predicted), np.inf]

    def arrived(self, d: int, now_s: float, request_id: int) -> None:
        """The request's KV reached decode instance d (which admits it)."""
        self._inbound[d][request_id][3] = now_s

    # -- what replica k sees -----------------------------------------------------------------
    def context(self, now_s: float, request: Request, k: int) -> RoutingContext:
        """Replica k's context for ``request`` now (what is due to it delivered first)."""
        self._prices.deliver(now_s, k)
        views = [self._view(g, now_s, k) for g in range(len(self.engines))]
        snaps = tuple(v[0] for v in views)
        inbound = self._inbound_rows(now_s, k)
        loads = tuple(self._load(g, snap, running, rows) for g, ((snap, running), rows)
                      in enumerate(zip(views, inbound, strict=True)))
        return RoutingContext(
            request=request, now_s=now_s, specs=self.specs, instances=loads,
            snapshots=snaps if self.needs_snapshots else None, pending=None,
            inbound=inbound if self.disaggregated else None)

    def tick(self, now_s: float, k: int) -> None:
        """Replica k's tick on its view, what is due to it delivered first; then its
        demand, and the leader's prices, sent to the others."""
        self._prices.deliver(now_s, k)
        self.policies[k].tick(now_s, self.snapshots(now_s, k))
        self._prices.ticked(now_s, k)

    def snapshots(self, now_s: float, k: int) -> tuple[EngineSnapshot, ...]:
        """Per engine, what replica k's ledger and the others' published ones hold."""
        return tuple(self._view(g, now_s, k)[0] for g in range(len(self.engines)))

    def _view(self, g: int, now_s: float, k: int) -> tuple[EngineSnapshot, int]:
        """Replica k's snapshot of engine g (``router_view`` of the requests it sees),
        and how many of those have streamed a token; the last one built, moved to now,
        while neither the engine nor the others' rows as of now - s changed."""
        stale = self._stale_rows(g, now_s) if self._stale else None
        key = (self._version[g], stale)
        cached = self._views[g][k]
        if cached is not None and cached[0] == key:
            view, running = cached[1], cached[2]
            if view.time_s != now_s:
                view = replace(view, time_s=now_s, inflight_start_s=now_s)
            return view, running
        fresh = self.engines[g].snapshot(now_s)
        n = self.num_replicas
        if n == 1 or self.staleness_s == 0:  # every dispatch seen at once
            seen = fresh
        else:
            own = (fresh.request_ids % n) == k
            ids, table = fresh.request_ids[own], fresh.table[own]
            if stale is not None:
                others = (stale.request_ids % n) != k
                ids = np.concatenate([ids, stale.request_ids[others]])
                table = np.concatenate([table, stale.table[others]])
            seen = _rows_only(now_s, table, ids)
        running = int(np.count_nonzero(seen.table[:, SNAP_OUTPUT] > 0))
        view = router_view(seen, self._entered[g], self.specs[g])
        self._views[g][k] = (key, view, running)
        return view, running

    def _stale_rows(self, g: int, now_s: float) -> EngineSnapshot:
        """Engine g's requests and their tokens as of now - s: the latest publication at
        or before then, and the requests admitted after it (no token yet, as admitted).
        The same for every replica, and the same object while those do not change."""
        assert self.staleness_s is not None
        horizon = now_s - self.staleness_s
        pubs, adm = self._published[g], self._admitted[g]
        # simulated time only moves forward: older publications are never needed again,
        # nor admissions before the one kept (it holds them, or they finished before it)
        while len(pubs) > 1 and pubs[1].time_s <= horizon:
            pubs.popleft()
        base = pubs[0] if pubs and pubs[0].time_s <= horizon else None
        since = -np.inf if base is None else base.time_s
        while adm and adm[0][0] < since:
            adm.popleft()
        num_admitted = next((i for i, a in enumerate(adm) if a[0] > horizon), len(adm))
        key = (base, num_admitted)   # the publication itself: compared by identity
        cached = self._stale_at[g]
        if cached is not None and cached[0] == key:
            return cached[1]
        known = set() if base is None else set(base.request_ids.tolist())
        late = [a for i, a in enumerate(adm) if i < num_admitted and a[1] not in known]
        ids = [a[1] for a in late]
        rows = np.array([(p, 0, o, c, 0) for _, _, p, o, c in late],
                        dtype=np.int64).reshape(len(late), 5)
        if base is not None:
            ids = [*base.request_ids.tolist(), *ids]
            rows = np.concatenate([base.table, rows])
        snap = _rows_only(horizon, rows, np.array(ids, dtype=np.int64))
        self._stale_at[g] = (key, snap)
        return snap

    def _inbound_rows(self, now_s: float, k: int) -> tuple[FloatArray | None, ...]:
        """Per instance, the (prompt, predicted decode, dispatch time) rows, in dispatch
        order, of the requests on their way to it that replica k sees: its own until
        their KV arrives, another's from s after its dispatch until s after its arrival
        (with a sync)."""
        lag = self.staleness_s or 0.0
        out: list[FloatArray | None] = []
        for rows in self._inbound:
            seen, gone = [], []
            for rid, (t, p, o, arrived) in rows.items():
                if arrived <= now_s - lag:
                    gone.append(rid)  # nobody sees it on its way any more
                    continue
                h = self._as_of(rid, k, now_s)
                if h is not None and t <= h < arrived:
                    seen.append((p, o, t))
            for rid in gone:
                del rows[rid]
            out.append(np.array(seen, dtype=np.float64) if seen else None)
        return tuple(out)

    def _as_of(self, request_id: int, k: int, now_s: float) -> float | None:
        """The time as of which replica k knows of a request: now for its own (and for
        every one with no staleness), s ago for another's, never (None) without a sync."""
        if self.num_replicas == 1 or replica_of(request_id, self.num_replicas) == k:
            return now_s
        return None if self.staleness_s is None else now_s - self.staleness_s

    def _load(self, g: int, snap: EngineSnapshot, running: int,
              inbound: FloatArray | None) -> InstanceLoad:
        """The load of engine g as its view holds it, counted as the server's tracker
        counts its flights: ``running`` those with a token (all of them, not only the
        first ``max_num_seqs``) and those the engine took in without one yet,
        outstanding the flights and the requests on their way."""
        spec: InstanceSpec = self.specs[g]
        resident = snap.num_resident
        running += snap.num_running - min(running, spec.max_num_seqs)
        return InstanceLoad(
            index=g, name=spec.name, num_running=running, num_waiting=resident - running,
            num_outstanding=resident + (0 if inbound is None else len(inbound)),
            num_kv_blocks_used=spec.num_kv_blocks - snap.num_free_blocks,
            num_kv_blocks=spec.num_kv_blocks, max_num_seqs=spec.max_num_seqs)


def _rows_only(time_s: float, table: IntArray, ids: IntArray) -> EngineSnapshot:
    """A snapshot holding only the rows a router can know of (``router_view`` reads the
    rows, their ids and the time, nothing else)."""
    return EngineSnapshot(time_s=time_s, table=table, num_running=0, num_free_blocks=0,
                          inflight=_NO_INFLIGHT, inflight_start_s=time_s, request_ids=ids)


Message = tuple[float, tuple[Demand | None, ...] | None, tuple[PriceState, ...] | None]


class _PriceSync:
    """Demand and prices between replicas' price books (module docstring): each
    replica's inbox of (delivery time, demand per book or None, leader's states or None)
    in the order sent."""

    def __init__(self, policies: Sequence[Policy], sync: Sync) -> None:
        self.books = [p.price_books() for p in policies]
        self.delay_s = sync.staleness_s
        self.on = (self.delay_s is not None and sync.prices and len(policies) > 1
                   and bool(self.books[0]))
        self.inbox: list[deque[Message]] = [deque() for _ in policies]
        if self.on:
            for k, books in enumerate(self.books):
                for b in books:
                    b.share_demand(True)
                    b.leading = k == 0

    def ticked(self, now_s: float, k: int) -> None:
        """Replica k ticked: its demand since its last tick to every other replica, and
        when it leads, its books' states too."""
        if not self.on:
            return
        assert self.delay_s is not None
        demand = tuple(b.drain_demand() for b in self.books[k])
        states = tuple(b.state() for b in self.books[k]) if k == 0 else None
        if all(d is None for d in demand) and states is None:
            return
        for j, inbox in enumerate(self.inbox):
            if j != k:
                inbox.append((now_s + self.delay_s, demand, states))

    def deliver(self, now_s: float, k: int) -> None:
        """Everything sent to replica k that has reached it by now, in order."""
        inbox = self.inbox[k]
        while inbox and inbox[0][0] <= now_s:
            _, demand, states = inbox.popleft()
            for book, d in zip(self.books[k], demand or (), strict=False):
                if d is not None:
                    book.add_demand(d, 0.0)
            for book, st in zip(self.books[k], states or (), strict=False):
                book.adopt(st, 0.0)
