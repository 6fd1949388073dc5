"""Router replicas that share one view on Redis (``olproute serve --state redis://...``).

Every ``state.sync_ms`` each replica, in two round trips:

- publishes its **ledger**, per backend the requests it dispatched there and that have
  not ended (prompt, predicted output, tokens so far, dispatch time: what its tracker
  holds), and merges the other replicas' into its tracker (``Tracker.set_remote``), so
  that its policy's loads, snapshots (BEA's replay) and start-and-fit check count every
  replica's requests, each as old as its replica's last publish;
- publishes the **demand** its price books gathered (new samples and arrival times) on a
  stream and adds every other replica's to its books, so that each book's window and
  arrival rate are the whole fleet's;
- renews or tries to take the **leader lease** (``SET NX PX``); the leader learns the
  prices (and runs the LP certificate) and publishes its books' states; the others
  (``PriceBook.leading`` False) adopt the latest. A dead leader's lease lapses after
  ``lease_ms``, and another replica takes it at its next sync.

Times cross replicas as wall-clock seconds: each replica's clock is its event loop's,
and ``time.time() - now`` converts.

Redis failing (refused, timed out, any error) never fails a request: nothing here is on
the request path. The replica says so once in its log, drops the others' ledgers, learns
its own prices, shows ``local`` in ``/healthz``, and rejoins at the first sync that
succeeds. Exchanges with the price books happen under the tick's lock, taken without
waiting (``try_books``): while a tick runs, they wait for the next sync.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from olproute.config.schema import StateConfig
from olproute.policies.base import SharedPriceBook
from olproute.server.tracker import NO_REMOTE, Remote, Tracker, by_dispatch
from olproute.types import Demand, PriceState

LOG = logging.getLogger("olproute.server.shared")

DEMAND_STREAM_MAXLEN = 10_000   # entries kept on the demand stream (approximately)
DEMAND_READ_COUNT = 1_000       # entries read per sync at most
# a renewal that only succeeds for the replica holding the lease
RENEW = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"""


def replica_name(cfg: StateConfig) -> str:
    """This replica's name: the configured one, or host:pid and a random suffix."""
    return cfg.replica or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# -- what crosses Redis ------------------------------------------------------------------------
def encode_ledger(tracker: Tracker, replica: str, offset_s: float) -> bytes:
    """This replica's ledger: per backend name, its flights and inbound requests with
    their dispatch times in wall-clock seconds (local time + ``offset_s``)."""
    backends: dict[str, Any] = {}
    for g, b in enumerate(tracker.backends):
        flights, inbound = tracker.ledger(g)
        if flights or inbound:
            backends[b.spec.name] = {
                "f": [[p, d, t, c, r, s + offset_s] for p, d, t, c, r, s in flights],
                "i": [[p, d, s + offset_s] for p, d, s in inbound]}
    return orjson.dumps({"r": replica, "b": backends})


def merge_ledgers(tracker: Tracker, ledgers: Sequence[bytes], offset_s: float) -> None:
    """The other replicas' ledgers into the tracker's view of each backend (their wall
    times back into local time, ``- offset_s``); a backend none of them names has none."""
    rows: dict[str, tuple[list[list[Any]], list[list[Any]]]] = {}
    for raw in ledgers:
        doc = orjson.loads(raw)
        for name, entry in doc["b"].items():
            flights, inbound = rows.setdefault(name, ([], []))
            flights.extend(entry["f"])
            inbound.extend(entry["i"])
    for g, b in enumerate(tracker.backends):
        found = rows.get(b.spec.name)
        tracker.set_remote(g, NO_REMOTE if found is None else _remote(*found, offset_s))


def _remote(flights: list[list[Any]], inbound: list[list[Any]], offset_s: float) -> Remote:
    flights = sorted(flights, key=lambda f: f[5])
    arr = (np.array([[p, d, s - offset_s] for p, d, s in inbound], dtype=np.float64)
           if inbound else None)
    return Remote(prompt=tuple(int(f[0]) for f in flights),
                  decode=tuple(int(f[1]) for f in flights),
                  tokens=tuple(int(f[2]) for f in flights),
                  computed=tuple(int(f[3]) for f in flights),
                  running=tuple(bool(f[4]) for f in flights),
                  dispatch_s=tuple(float(f[5]) - offset_s for f in flights),
                  inbound=None if arr is None else by_dispatch(arr))


def encode_demand(demands: Sequence[Demand | None], offset_s: float) -> bytes | None:
    """Each book's demand (None: none) as one .npz, arrival times in wall-clock seconds;
    None when no book has any."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for i, d in enumerate(demands):
        if d is None:
            continue
        arrays[f"b{i}_a"] = d.arrivals_s + offset_s
        for k, a in enumerate(d.rows):
            arrays[f"b{i}_r{k}"] = a
    if not arrays:
        return None
    arrays["num_books"] = np.array([len(demands)])
    return _npz(arrays)


def decode_demand(raw: bytes, offset_s: float) -> list[Demand | None]:
    """``encode_demand``'s books, arrival times back into local time."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        out: list[Demand | None] = []
        for i in range(int(z["num_books"][0])):
            if f"b{i}_a" not in z:
                out.append(None)
                continue
            rows = tuple(z[f"b{i}_r{k}"] for k in range(_count(z.files, f"b{i}_r")))
            out.append(Demand(rows, z[f"b{i}_a"] - offset_s))
        return out


def encode_prices(states: Sequence[PriceState], offset_s: float) -> bytes:
    """The leader's books' states as one .npz, slot 0's time in wall-clock seconds."""
    arrays: dict[str, np.ndarray[Any, Any]] = {"num_books": np.array([len(states)])}
    for i, s in enumerate(states):
        arrays[f"b{i}_p"], arrays[f"b{i}_it"], arrays[f"b{i}_acc"] = s.p, s.iterate, s.acc
        arrays[f"b{i}_meta"] = np.array([
            np.nan if s.origin_s is None else s.origin_s + offset_s, s.arrivals_in_horizon,
            s.num_updates, s.num_steps, s.price_scale])
    return _npz(arrays)


def decode_prices(raw: bytes, offset_s: float) -> list[PriceState]:
    """``encode_prices``' states, slot 0's time back into local time."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        out = []
        for i in range(int(z["num_books"][0])):
            origin, n_h, updates, steps, scale = z[f"b{i}_meta"].tolist()
            out.append(PriceState(z[f"b{i}_p"], z[f"b{i}_it"], z[f"b{i}_acc"],
                                  None if np.isnan(origin) else origin - offset_s, n_h,
                                  int(updates), int(steps), scale))
        return out


def _npz(arrays: dict[str, np.ndarray[Any, Any]]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def _count(files: Sequence[str], prefix: str) -> int:
    return sum(1 for f in files if f.startswith(prefix))


# -- the replica's side ------------------------------------------------------------------------
@dataclass(slots=True)
class SharedStatus:
    """What ``/healthz`` says of the shared state (and ``/metrics``, its gauges)."""

    url: str
    replica: str
    status: str = "connecting"      # shared | local (Redis unreachable) | connecting
    leader: bool = False
    replicas: int = 1               # replicas seen at the last sync, this one included
    error: str | None = None
    syncs: int = 0
    failures: int = 0


@dataclass(slots=True)
class _Pending:
    """Exchanges with the price books that wait for the tick's lock."""

    demand: list[tuple[list[Demand | None], str]] = field(default_factory=list)
    prices: tuple[list[PriceState], str] | None = None


class SharedState:
    """One replica's link to the others through Redis (module docstring)."""

    def __init__(self, cfg: StateConfig, url: str, tracker: Tracker,
                 books: Callable[[], tuple[SharedPriceBook, ...]], now: Callable[[], float],
                 book_lock: threading.Lock, on_leader: Callable[[bool], None] | None = None
                 ) -> None:
        import redis.asyncio as aioredis

        self.cfg = cfg
        self.tracker = tracker
        self.status = SharedStatus(url=_redacted(url), replica=replica_name(cfg))
        self._books = books
        self._now = now
        self._lock = book_lock
        self._on_leader = on_leader
        timeout = cfg.timeout_ms / 1e3
        self._redis = aioredis.from_url(url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout,
                                        health_check_interval=0, retry_on_timeout=False)
        ns = cfg.namespace
        self._k_replicas, self._k_leader = f"{ns}:replicas", f"{ns}:leader"
        self._k_demand, self._k_prices = f"{ns}:demand", f"{ns}:prices"
        self._stream_id: str | None = None   # the demand stream's last entry read
        self._pending = _Pending()
        self._sharing: set[int] = set()  # ids of the books sharing their demand
        self._adopted: tuple[str, int] | None = None   # (leader, its updates) adopted
        self._published = -1             # the leader's updates last published
        self._said: set[str] = set()     # replicas whose books did not fit, said once

    @property
    def leading(self) -> bool:
        """Does this replica learn the prices: it holds the lease, or Redis is gone (each
        replica then learns its own)?"""
        return self.status.leader or self.status.status != "shared"

    def ttl_ms(self) -> int:
        """How long a replica's ledger outlives its last publish: a replica that stops is
        forgotten after this."""
        return int(max(20 * self.cfg.sync_ms, self.cfg.lease_ms))

    def key(self, replica: str) -> str:
        return f"{self.cfg.namespace}:ledger:{replica}"

    async def close(self) -> None:
        """Give up the lease (another replica takes over at its next sync) and close."""
        timeout = self.cfg.timeout_ms / 1e3
        try:
            if self.status.leader:
                async with asyncio.timeout(timeout):
                    await self._redis.delete(self._k_leader)
        except Exception:   # closing: Redis may be gone
            pass
        try:
            async with asyncio.timeout(timeout):
                await self._redis.aclose()
        except Exception:   # a connection that does not close in time is dropped
            pass

    # -- one sync ----------------------------------------------------------------------
    async def sync(self) -> None:
        """One exchange; Redis failing leaves this replica on its local state.

        Bounded with ``asyncio.timeout``, not ``asyncio.wait_for``: Python 3.11's
        ``wait_for`` returns the result of an exchange that finished in the same loop
        iteration as the task was cancelled, and so swallows the cancellation (the sync
        task then ran on for ever and the server's shutdown waited on it)."""
        try:
            async with asyncio.timeout(2 * self.cfg.timeout_ms / 1e3):
                await self._exchange()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of Redis: go on alone
            self._lost(exc)
            return
        self.status.syncs += 1
        if self.status.status != "shared":
            if self.status.status == "local":
                LOG.warning("shared state: Redis at %s is back: replica %s rejoined",
                            self.status.url, self.status.replica)
            self.status.status, self.status.error = "shared", None
        self._set_leading()

    async def _exchange(self) -> None:
        offset = time.time() - self._now()
        me = self.status.replica
        ttl = self.ttl_ms()
        demand = self._drain(offset)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.key(me), encode_ledger(self.tracker, me, offset), px=ttl)
        pipe.zadd(self._k_replicas, {me: time.time()})
        pipe.zremrangebyscore(self._k_replicas, "-inf", time.time() - ttl / 1e3)
        pipe.zrange(self._k_replicas, 0, -1)
        if demand is not None:
            pipe.xadd(self._k_demand, {"r": me, "d": demand},
                      maxlen=DEMAND_STREAM_MAXLEN, approximate=True)
        if self._stream_id is None:   # the first sync: read on from the stream's end
            pipe.xrevrange(self._k_demand, "+", "-", count=1)
        else:
            pipe.xread({self._k_demand: self._stream_id}, count=DEMAND_READ_COUNT)
        pipe.eval(RENEW, 1, self._k_leader, me, int(self.cfg.lease_ms))
        pipe.set(self._k_leader, me, nx=True, px=int(self.cfg.lease_ms))
        pipe.hmget(self._k_prices, ["leader", "updates"])
        out = await pipe.execute()
        members, read = out[3], out[5 if demand is not None else 4]
        renewed, taken, prices = out[-3], out[-2], out[-1]
        others = [r for r in map(_entry_id, members) if r != me]
        found: list[bytes] = [x for x in (await self._redis.mget(
            [self.key(r) for r in others]) if others else []) if isinstance(x, bytes)]
        merge_ledgers(self.tracker, found, offset)
        self.status.replicas = 1 + len(found)
        self._read_demand(read, offset)
        leader = bool(renewed) or bool(taken)
        if leader != self.status.leader:
            LOG.warning("shared state: replica %s %s the leader lease", self.status.replica,
                        "took" if leader else "lost")
        self.status.leader = leader
        if not self.status.leader and prices[0] is not None:
            await self._read_prices(prices, offset)
        self._apply()
        if self.status.leader:
            await self._publish_prices(offset)

    def _drain(self, offset: float) -> bytes | None:
        """This replica's books' new demand, if the tick's lock is free (else it waits in
        the books for the next sync)."""
        with self.try_books() as free:
            if not free:
                return None
            books = self._books()
            for b in books:
                if id(b) not in self._sharing:   # a new router (a reload) has new books
                    b.share_demand()
            self._sharing = {id(b) for b in books}
            return encode_demand([b.drain_demand() for b in books], offset)

    def _read_demand(self, read: Any, offset: float) -> None:
        """The other replicas' demand entries since the last read, pending until the
        books are free; at the first sync only the stream's end (``XREVRANGE``)."""
        if self._stream_id is None:
            self._stream_id = _entry_id(read[0][0]) if read else "0-0"
            return
        for _stream, entries in read or ():
            for entry_id, fields in entries:
                self._stream_id = _entry_id(entry_id)
                who = fields[b"r"].decode()
                if who != self.status.replica:
                    self._pending.demand.append((decode_demand(fields[b"d"], offset), who))
        del self._pending.demand[:-DEMAND_READ_COUNT]   # bounded while the books are busy

    async def _read_prices(self, head: list[bytes | None], offset: float) -> None:
        """The leader's latest books' states, fetched when it published since the last
        adopted (a third round trip: the states are the larger part), pending until the
        books are free."""
        leader, updates = _entry_id(head[0] or b""), int(head[1] or -1)
        if self._adopted == (leader, updates):
            return
        blob = await self._redis.hget(self._k_prices, "blob")
        if not isinstance(blob, bytes):
            return
        self._pending.prices = (decode_prices(blob, offset), leader)
        self._adopted = (leader, updates)

    def _apply(self) -> None:
        """The pending demand and prices into the books, if the tick's lock is free."""
        with self.try_books() as free:
            if not free:
                return
            books = self._books()
            for demands, who in self._pending.demand:
                if len(demands) != len(books):
                    self._mismatch(who, f"{len(demands)} price books for this "
                                        f"replica's {len(books)}")
                    continue
                for book, d in zip(books, demands, strict=True):
                    if d is not None:
                        self._guarded(who, book.add_demand, d)
            self._pending.demand.clear()
            if self._pending.prices is not None and not self.status.leader:
                states, who = self._pending.prices
                if len(states) == len(books):
                    for book, s in zip(books, states, strict=True):
                        self._guarded(who, book.adopt, s)
                else:
                    self._mismatch(who, f"{len(states)} price books for this replica's "
                                        f"{len(books)}")
            self._pending.prices = None

    async def _publish_prices(self, offset: float) -> None:
        """The leader's books' states, when it learned since it last published them."""
        with self.try_books() as free:
            books = self._books()
            if not free or not books or books[0].num_updates == self._published:
                return
            updates = books[0].num_updates
            blob = encode_prices([b.state() for b in books], offset)
        await self._redis.hset(self._k_prices, mapping={
            "leader": self.status.replica, "updates": updates, "blob": blob})
        self._published = updates

    def _set_leading(self) -> None:
        leading = self.leading
        with self.try_books() as free:
            if free:
                for b in self._books():
                    b.leading = leading
        if self._on_leader is not None:
            self._on_leader(leading)

    def _lost(self, exc: BaseException) -> None:
        """Redis failed: the others' ledgers go, this replica learns its own prices."""
        self.status.failures += 1
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.status.status != "local":
            LOG.warning("shared state: Redis at %s unreachable (%s): replica %s goes on "
                        "with its local state", self.status.url, why, self.status.replica)
        self.status.status, self.status.error, self.status.leader = "local", why, False
        self.status.replicas = 1
        for g in range(len(self.tracker.backends)):
            self.tracker.set_remote(g, NO_REMOTE)
        self._set_leading()

    @contextmanager
    def try_books(self) -> Iterator[bool]:
        """The tick's lock if free now (True), never waited for: the loop must not wait
        for a price update."""
        got = self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def _guarded(self, who: str, apply: Callable[[Any], None], arg: Any) -> None:
        try:
            apply(arg)
        except ValueError as exc:
            self._mismatch(who, str(exc))

    def _mismatch(self, who: str, why: str) -> None:
        """Another replica's demand or prices that do not fit (another config): said
        once per replica."""
        if who not in self._said:
            self._said.add(who)
            LOG.warning("shared state: replica %s's price books do not fit this replica's "
                        "(%s): are both on the same config?", who, why)

    def as_dict(self) -> dict[str, Any]:
        s = self.status
        return {"mode": "redis", "url": s.url, "replica": s.replica, "status": s.status,
                "leader": s.leader, "replicas": s.replicas, "syncs": s.syncs,
                "failures": s.failures, "error": s.error,
                "sync_ms": self.cfg.sync_ms, "lease_ms": self.cfg.lease_ms}


def _entry_id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _redacted(url: str) -> str:
    """The URL without a password."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
