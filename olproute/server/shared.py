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

Only replicas write: every message a replica writes for the others (its ledger, a demand
entry, a price state, its lease value) is sealed with the fleet's secret, its name and a
sequence (``olproute.server.shared_auth``), and a message that is forged, unsigned, of
another wire format or replayed is dropped before it is parsed, counted like a message
that does not fit.

Nothing read from Redis is trusted: every ledger, demand entry and price state is parsed
into a bounded shape (``olproute.server.shared_parse``: sizes, counts within the
backend's capacity, times within a window of now, prices finite and within a bound from
the reward scale, arrays of the books' shapes); what does not fit is dropped, counted
(``SharedStatus.rejected``, ``olproute_shared_state_rejected_total``) and said once per
replica and reason, never raised. A ledger is read at most one byte past its cap, a
price state only when its length fits; reads larger than ``OFF_LOOP_BYTES`` are parsed
in a worker thread. A key of another type fails its command alone.

A follower adopts only the lease holder's published prices, and saves its books' own
states when it first adopts. When no lease holder's prices were confirmed for a lease
(none published, the publisher lost the lease, or what it published was dropped) the
follower gives its books back those own states and learns its own prices until a leader
publishes again; a replica that takes the lease does so at once, and learns on from its
own prices rather than from what it adopted.

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
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson
from redis.exceptions import ResponseError

from olproute.config.schema import RewardConfig, StateConfig
from olproute.policies.base import SharedPriceBook
from olproute.pricing.book import PriceBook
from olproute.server.shared_auth import ENVELOPE_BYTES, Opener, Sealer
from olproute.server.shared_parse import (
    MAX_NAME_CHARS,
    MAX_REPLICAS,
    NPZ_BASE_BYTES,
    OFF_LOOP_BYTES,
    PRICE_HEADROOM,
    BackendLimits,
    BookShape,
    Bounds,
    Drops,
    FloatArray,
    Ledger,
    Rejected,
    ledger_cap,
    merged_rows,
    parse_demand,
    parse_ledger,
    parse_prices,
    price_bound,
    prices_cap,
    reward_bound,
)
from olproute.server.tracker import NO_REMOTE, Remote, Tracker
from olproute.types import Demand, PriceState

LOG = logging.getLogger("olproute.server.shared")

DEMAND_STREAM_MAXLEN = 10_000   # entries kept on the demand stream (approximately)
DEMAND_READ_COUNT = 1_000       # entries read per sync at most
MAX_SAID = 1_000                # (replica, kind, reason) said in the log, at most
SYNC_TIMEOUTS = 10              # a whole sync's bound, in state.timeout_ms
T = TypeVar("T")
AUTH_HINTS = {   # what a dropped envelope says of its writer (olproute.server.shared_auth)
    "version": ": another olproute's wire format; are all replicas the same version?",
    "forged": ": its MAC does not check: not written with this fleet's state secret",
    "unsigned": ": unsigned (--state-insecure) while this replica has a state secret",
    "signed": ": signed with a state secret while this replica has none",
    "replayed": ": its sequence is not newer than the last accepted from that replica",
}
CLOSE_S = 1.0                   # each step of closing, at most
# a renewal (and a release) that only succeeds for the replica holding the lease
RENEW = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"""
RELEASE = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1]) else return 0 end"""


REDIS_USERNAME_ENV = "OLPROUTE_STATE_REDIS_USERNAME"
REDIS_PASSWORD_ENV = "OLPROUTE_STATE_REDIS_PASSWORD"


def redis_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """Redis AUTH from the environment (``OLPROUTE_STATE_REDIS_USERNAME``, ``_PASSWORD``),
    for ``from_url``, whose URL's own user and password take precedence."""
    out = {}
    if environ.get(REDIS_USERNAME_ENV):
        out["username"] = environ[REDIS_USERNAME_ENV]
    if environ.get(REDIS_PASSWORD_ENV):
        out["password"] = environ[REDIS_PASSWORD_ENV]
    return out


def replica_name(cfg: StateConfig) -> str:
    """This replica's name: the configured one, or host:pid and a random suffix."""
    return cfg.replica or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# -- what crosses Redis (read back by olproute.server.shared_parse) ---------------------------
def encode_ledger(tracker: Tracker, replica: str, offset_s: float, wall_s: float) -> bytes:
    """This replica's ledger, published at wall-clock ``wall_s``: per backend name, its
    flights and inbound requests with their dispatch times in wall-clock seconds (local
    time + ``offset_s``)."""
    backends: dict[str, Any] = {}
    for g, b in enumerate(tracker.backends):
        flights, inbound = tracker.ledger(g)
        if flights or inbound:
            backends[b.spec.name] = {
                "f": [[p, d, t, c, r, s + offset_s] for p, d, t, c, r, s in flights],
                "i": [[p, d, s + offset_s] for p, d, s in inbound]}
    return orjson.dumps({"r": replica, "t": wall_s, "b": backends})


def merged_remotes(ledgers: Sequence[Ledger], backends: Sequence[BackendLimits],
                   offset_s: float) -> tuple[list[Remote], Drops]:
    """Per backend, the other replicas' parsed ledgers as one ``Remote`` (their wall
    times back into local time, ``- offset_s``; ``NO_REMOTE`` where none names it),
    held to what the backend can hold (``shared_parse.merged_rows``)."""
    drops: Drops = {}
    out = []
    for limits in backends:
        rows = merged_rows(ledgers, limits, drops)
        out.append(NO_REMOTE if rows is None else _remote(*rows, offset_s))
    return out, drops


def merge_ledgers(tracker: Tracker, ledgers: Sequence[Ledger], offset_s: float) -> Drops:
    """The other replicas' parsed ledgers into the tracker's view of each backend; what
    the backends cannot hold is dropped and returned, by reason."""
    remotes, drops = merged_remotes(ledgers, limits_of(tracker), offset_s)
    for g, remote in enumerate(remotes):
        tracker.set_remote(g, remote)
    return drops


def limits_of(tracker: Tracker) -> tuple[BackendLimits, ...]:
    return tuple(BackendLimits.of(b.spec) for b in tracker.backends)


def _remote(flights: FloatArray, inbound: FloatArray, offset_s: float) -> Remote:
    """Parsed rows (dispatch order, ``shared_parse.merged_rows``) as a ``Remote``."""
    counts = flights[:, :4].astype(np.int64)
    arr = None
    if len(inbound):
        arr = inbound.copy()
        arr[:, 2] -= offset_s
    return Remote(prompt=tuple(counts[:, 0].tolist()), decode=tuple(counts[:, 1].tolist()),
                  tokens=tuple(counts[:, 2].tolist()), computed=tuple(counts[:, 3].tolist()),
                  running=tuple((flights[:, 4] == 1).tolist()),
                  dispatch_s=tuple((flights[:, 5] - offset_s).tolist()), inbound=arr)


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


def encode_prices(states: Sequence[PriceState], offset_s: float) -> bytes:
    """The leader's books' states as one .npz, slot 0's time in wall-clock seconds."""
    arrays: dict[str, np.ndarray[Any, Any]] = {"num_books": np.array([len(states)])}
    for i, s in enumerate(states):
        arrays[f"b{i}_p"], arrays[f"b{i}_it"], arrays[f"b{i}_acc"] = s.p, s.iterate, s.acc
        arrays[f"b{i}_meta"] = np.array([
            np.nan if s.origin_s is None else s.origin_s + offset_s, s.arrivals_in_horizon,
            s.num_updates, s.num_steps, s.price_scale], dtype=np.float64)
    return _npz(arrays)


def _npz(arrays: dict[str, np.ndarray[Any, Any]]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


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
    # what was read from Redis and dropped (olproute.server.shared_parse), by (kind,
    # reason); kind: ledger, demand, prices or lease
    rejected: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    """Exchanges with the price books that wait for the tick's lock."""

    demand: list[tuple[list[Demand | None], str]] = field(default_factory=list)
    prices: tuple[list[PriceState], str] | None = None
    undo: bool = False   # give the books back the states they had before adopting


class SharedState:
    """One replica's link to the others through Redis (module docstring)."""

    def __init__(self, cfg: StateConfig, url: str, tracker: Tracker,
                 books: Callable[[], tuple[SharedPriceBook, ...]], now: Callable[[], float],
                 book_lock: threading.Lock, on_leader: Callable[[bool], None] | None = None,
                 reward: RewardConfig | None = None, secret: bytes | None = None) -> None:
        """``reward``: the reward weights the bounds on prices and sample rewards are
        derived from (``shared_parse.reward_bound``; None: the defaults, raised by the
        largest reward of this replica's own samples). ``secret``: the fleet's
        (``shared_auth.state_secret``), what this replica writes is signed with and what
        it reads checked against; None: unsigned (``state.insecure``)."""
        import redis.asyncio as aioredis

        self.cfg = cfg
        self.tracker = tracker
        self.status = SharedStatus(url=_redacted(url), replica=replica_name(cfg))
        self._books = books
        self._now = now
        self._lock = book_lock
        self._on_leader = on_leader
        self._reward = reward or RewardConfig()
        timeout = cfg.timeout_ms / 1e3
        # the URL's user, password and rediss:// (TLS, with its ssl_* query options) are
        # redis-py's own; a user and password from the environment where it has none
        self._redis = aioredis.from_url(url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout,
                                        health_check_interval=0, retry_on_timeout=False,
                                        **redis_credentials(os.environ))
        self._sealer = Sealer(secret, self.status.replica)
        self._opener = Opener(secret)
        # this replica's lease value, sealed once: the renewal compares it whole
        self._lease = self._sealer.seal(b"lease", b"")
        ns = cfg.namespace
        self._k_replicas, self._k_leader = f"{ns}:replicas", f"{ns}:leader"
        self._k_demand, self._k_prices = f"{ns}:demand", f"{ns}:prices"
        self._stream_id: str | None = None   # the demand stream's last entry read
        self._pending = _Pending()
        self._sharing: set[int] = set()  # ids of the books sharing their demand
        self._adopted: tuple[str, int] | None = None   # (leader, its updates) adopted
        self._refused: tuple[str, int] | None = None   # (leader, its updates) dropped
        self._own: list[PriceState] | None = None      # the books' before adopting
        self._source_s = time.time()     # wall time a leader's prices were last confirmed
        self._orphaned = False           # none for a lease: this replica learns its own
        self._published = -1             # the leader's updates last published
        self._reward_seen = 0.0          # the largest reward of this replica's samples
        self._said: set[tuple[str, str, str]] = set()   # (replica, kind, reason) logged

    @property
    def leading(self) -> bool:
        """Does this replica learn the prices: it holds the lease, Redis is gone, or no
        leader's prices were confirmed for a lease (each replica then learns its own)?"""
        return self.status.leader or self.status.status != "shared" or self._orphaned

    def ttl_ms(self) -> int:
        """How long a replica's ledger outlives its last publish: a replica that stops is
        forgotten after this."""
        return int(max(20 * self.cfg.sync_ms, self.cfg.lease_ms))

    def key(self, replica: str) -> str:
        return f"{self.cfg.namespace}:ledger:{replica}"

    def reward_scale(self) -> float:
        """The largest reward a request can earn: the reward weights' bound, or the
        largest this replica's own samples carried if more."""
        horizon = max((s.prices[1] for s in self._shapes() or ()), default=0)
        return max(reward_bound(self._reward, horizon, limits_of(self.tracker)),
                   self._reward_seen)

    def bounds(self, wall_s: float) -> Bounds:
        """What the books' messages read now are held to (``shared_parse``)."""
        scale = self.reward_scale()
        specs = [b.spec for b in self.tracker.backends]
        return Bounds(PRICE_HEADROOM * scale, price_bound(scale, specs), wall_s)

    async def close(self) -> None:
        """Give up the lease (another replica takes over at its next sync) and close,
        each step bounded by ``timeout_ms`` and at most ``CLOSE_S``, whatever Redis does
        (gone, paused, slow): a stopping server waits at most twice that here."""
        timeout = min(self.cfg.timeout_ms / 1e3, CLOSE_S)
        try:
            if self.status.leader:
                async with asyncio.timeout(timeout):
                    await self._redis.eval(RELEASE, 1, self._k_leader, self._lease)
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

        Each round trip is bounded by twice ``timeout_ms`` (``_io``); the whole exchange,
        parsing what it read included, by ``SYNC_TIMEOUTS`` times ``timeout_ms``, so that
        parsing a large read (capped, off the loop) does not count as Redis failing.
        Bounded with ``asyncio.timeout``, not ``asyncio.wait_for``: Python 3.11's
        ``wait_for`` returns the result of an exchange that finished in the same loop
        iteration as the task was cancelled, and so swallows the cancellation (the sync
        task then ran on for ever and the server's shutdown waited on it)."""
        try:
            async with asyncio.timeout(SYNC_TIMEOUTS * self.cfg.timeout_ms / 1e3):
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
        wall = time.time()
        offset = wall - self._now()
        me = self.status.replica
        ttl = self.ttl_ms()
        demand = self._drain(offset)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.key(me), self._sealer.seal(
            b"ledger", encode_ledger(self.tracker, me, offset, wall)), px=ttl)
        pipe.zadd(self._k_replicas, {me: wall})
        pipe.zremrangebyscore(self._k_replicas, "-inf", wall - ttl / 1e3)
        pipe.zrevrange(self._k_replicas, 0, MAX_REPLICAS)   # the latest seen
        if demand is not None:
            pipe.xadd(self._k_demand, {"r": me, "d": self._sealer.seal(b"demand", demand)},
                      maxlen=DEMAND_STREAM_MAXLEN, approximate=True)
        if self._stream_id is None:   # the first sync: read on from the stream's end
            pipe.xrevrange(self._k_demand, "+", "-", count=1)
        else:
            pipe.xread({self._k_demand: self._stream_id}, count=DEMAND_READ_COUNT)
        pipe.eval(RENEW, 1, self._k_leader, self._lease, int(self.cfg.lease_ms))
        pipe.set(self._k_leader, self._lease, nx=True, px=int(self.cfg.lease_ms))
        pipe.hmget(self._k_prices, ["leader", "updates"])
        pipe.hstrlen(self._k_prices, "blob")
        pipe.get(self._k_leader)
        # a key of another type than ours (written by something else) fails its command
        # alone: that read is dropped, the sync goes on
        out = await self._io(pipe.execute(raise_on_error=False))
        if isinstance(out[0], Exception):
            raise out[0]   # this replica's own ledger was not written
        kinds = ["ledger"] * 4 + ["demand"] * (2 if demand is not None else 1) + \
            ["prices"] * 5
        out = [self._typed(kind, x) for kind, x in zip(kinds, out, strict=True)]
        members, read = out[3] or [], out[5 if demand is not None else 4]
        renewed, taken, head, blob_len, holder = out[-5:]
        await self._merge(members, wall, offset)
        await self._read_demand(read or [], wall, offset)
        leader = bool(renewed) or bool(taken)
        if leader != self.status.leader:
            LOG.warning("shared state: replica %s %s the leader lease", self.status.replica,
                        "took" if leader else "lost")
        self.status.leader = leader
        await self._follow(head or [None, None], blob_len, holder, wall, offset)
        self._apply()
        if self.status.leader:
            await self._publish_prices(offset)

    async def _io(self, call: Awaitable[T]) -> T:
        """One round trip to Redis, bounded by twice ``timeout_ms``."""
        async with asyncio.timeout(2 * self.cfg.timeout_ms / 1e3):
            return await call

    def _typed(self, kind: str, result: Any) -> Any:
        """A pipeline's result, or None for a command that failed on a key's type (a
        key of ``kind`` that something other than a replica wrote)."""
        if isinstance(result, Exception):
            self._rejected(kind, "(a key of another type)", {"type": 1})
            return None
        return result

    async def _merge(self, members: Sequence[Any], wall: float, offset: float) -> None:
        """The other replicas' ledgers, each read at most one byte past the cap (a
        longer one is dropped unread), parsed and merged into the tracker."""
        me = self.status.replica
        others = [r for r in map(_name, members) if r is not None and r != me]
        limits = limits_of(self.tracker)
        cap = ledger_cap(limits) + ENVELOPE_BYTES
        raws: list[Any] = []
        if others:
            pipe = self._redis.pipeline(transaction=False)
            for r in others:
                pipe.getrange(self.key(r), 0, cap)
            raws = await self._io(pipe.execute(raise_on_error=False))
        found = [(r, x) for r, x in zip(others, raws, strict=True) if x != b""]
        size = sum(len(x) for _, x in found if isinstance(x, bytes))
        ledgers, drops, remotes, merged = await _off_loop(
            size, _parse_ledgers, found, limits, wall, self.ttl_ms() / 1e3, offset,
            self._opener)
        for who, dropped in drops:
            self._rejected("ledger", who, dropped)
        self._rejected("ledger", "(merged)", merged)
        for g, remote in enumerate(remotes):
            self.tracker.set_remote(g, remote)
        self.status.replicas = 1 + ledgers

    def _drain(self, offset: float) -> bytes | None:
        """This replica's books' new demand, if the tick's lock is free (else it waits in
        the books for the next sync)."""
        with self.try_books() as free:
            if not free:
                return None
            books = self._books()
            if {id(b) for b in books} != self._sharing:   # a new router (a reload)
                self._adopted = self._own = None
            for b in books:
                if id(b) not in self._sharing:   # a new router (a reload) has new books
                    b.share_demand()
            self._sharing = {id(b) for b in books}
            demands = [b.drain_demand() for b in books]
        for d in demands:
            if d is not None and d.num_samples:
                r = d.rows[0]
                finite = r[np.isfinite(r)]
                if finite.size:
                    self._reward_seen = max(self._reward_seen, float(finite.max()))
        return encode_demand(demands, offset)

    def _shapes(self) -> list[BookShape] | None:
        """The books' shapes the messages must fit (None: a book that is no
        ``PriceBook``, whose shape is unknown)."""
        books = self._books()
        if not all(isinstance(b, PriceBook) for b in books):
            return None
        return [BookShape.of(b) for b in books if isinstance(b, PriceBook)]

    async def _read_demand(self, read: Any, wall: float, offset: float) -> None:
        """The other replicas' demand entries since the last read, pending until the
        books are free; at the first sync only the stream's end (``XREVRANGE``)."""
        if self._stream_id is None:
            self._stream_id = _entry_id(read[0][0]) if read else "0-0"
            return
        me = self.status.replica.encode()
        msgs: list[tuple[str, Any]] = []
        for _stream, entries in read:
            for entry_id, fields in entries:
                self._stream_id = _entry_id(entry_id)
                who = fields.get(b"r")
                if who != me:
                    msgs.append((_name(who) or "?", fields.get(b"d")))
        if not msgs:
            return
        shapes = self._shapes()
        if shapes is None:
            return
        size = sum(len(raw) for _, raw in msgs if isinstance(raw, bytes))
        parsed = await _off_loop(size, _parse_demands, msgs, shapes, self.bounds(wall),
                                 offset, self._opener)
        for (who, _), (demands, drops) in zip(msgs, parsed, strict=True):
            self._rejected("demand", who, drops)
            if demands is not None:
                self._pending.demand.append((demands, who))
        del self._pending.demand[:-DEMAND_READ_COUNT]   # bounded while the books are busy

    async def _follow(self, head: Sequence[Any], blob_len: Any, holder: Any, wall: float,
                      offset: float) -> None:
        """A follower's prices: the lease holder's latest published states, adopted when
        they fit (``_read_prices``). A leader's prices not confirmed for a lease (none
        published, not the lease holder's, or dropped), or this replica leading: what was
        adopted is undone and this replica learns its own."""
        if self.status.leader:
            self._source_s, self._orphaned = wall, False
            if self._adopted is not None:   # a leader learns on from its own prices
                self._undo()
            return
        published, updates, holder = _name(head[0]), _int(head[1]), self._holder(holder)
        if published is not None and published == holder and updates is not None:
            source = (published, updates)
            if source == self._adopted or (source != self._refused and await
                                           self._read_prices(source, blob_len, wall, offset)):
                self._source_s = wall
        self._orphaned = wall - self._source_s >= self.cfg.lease_ms / 1e3
        if self._orphaned and self._adopted is not None:
            self._undo()

    def _holder(self, raw: Any) -> str | None:
        """The lease holder's name, from its sealed lease value (None: no holder, or a
        value no replica of this fleet wrote: dropped, counted)."""
        if not isinstance(raw, bytes):
            return None
        try:
            return self._opener.open(raw, "lease", b"lease", again=True).replica
        except Rejected as exc:
            self._rejected("lease", "(the lease)", {exc.reason: 1})
            return None

    async def _read_prices(self, source: tuple[str, int], blob_len: Any, wall: float,
                           offset: float) -> bool:
        """The leader's published books' states (a third round trip: the states are the
        larger part), pending until the books are free when they fit; False when they do
        not (dropped, counted, not read again). The head is read again with the states:
        a leader that published meanwhile names its new updates (which the states' MAC
        covers); another publisher meanwhile is read at the next sync."""
        shapes = self._shapes()
        if shapes is None:
            return False
        states: list[PriceState] | None = None
        why: str | None = "format" if not isinstance(blob_len, int) or blob_len <= 0 \
            else "too_large"
        if isinstance(blob_len, int) and 0 < blob_len <= prices_cap(shapes) + ENVELOPE_BYTES:
            try:
                head = await self._io(self._redis.hmget(self._k_prices,
                                                        ["leader", "updates", "blob"]))
            except ResponseError:   # replaced by a key of another type meanwhile
                head = [None, None, None]
            if _name(head[0]) != source[0]:
                return False
            updates, blob, why = _int(head[1]), head[2], "format"
            if isinstance(blob, bytes) and updates is not None:
                source = (source[0], updates)
                states, why = await _off_loop(len(blob), _parse_price_blob, blob, source,
                                              self._opener, shapes, self.bounds(wall),
                                              offset)
        if states is None:
            self._refused = source
            self._rejected("prices", source[0], {why or "format": 1})
            return False
        self._pending.prices = (states, source[0])
        self._adopted = source
        return True

    def _undo(self) -> None:
        """Give the books back what they had before adopting (at the next free lock)."""
        LOG.warning("shared state: replica %s drops the prices it adopted from %s and "
                    "learns its own", self.status.replica,
                    self._adopted[0] if self._adopted else "?")
        self._pending.undo, self._pending.prices, self._adopted = True, None, None

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
            if self._pending.undo:
                if self._own is not None and len(self._own) == len(books):
                    for book, s in zip(books, self._own, strict=True):
                        self._guarded("(own)", book.adopt, s)
                self._own, self._pending.undo = None, False
            if self._pending.prices is not None and not self.status.leader:
                self._adopt(books, *self._pending.prices)
            self._pending.prices = None

    def _adopt(self, books: Sequence[SharedPriceBook], states: list[PriceState],
               who: str) -> None:
        if len(states) != len(books):
            self._mismatch(who, f"{len(states)} price books for this replica's "
                                f"{len(books)}")
            return
        if self._own is None:   # what the books go back to when the leader goes
            self._own = [b.state() for b in books]
        for book, s in zip(books, states, strict=True):
            self._guarded(who, book.adopt, s)

    async def _publish_prices(self, offset: float) -> None:
        """The leader's books' states, when it learned since it last published them."""
        with self.try_books() as free:
            books = self._books()
            if not free or not books or books[0].num_updates == self._published:
                return
            updates = books[0].num_updates
            body = encode_prices([b.state() for b in books], offset)
        blob = self._sealer.seal(b"prices:%d" % updates, body)
        try:
            await self._io(self._redis.hset(self._k_prices, mapping={
                "leader": self.status.replica, "updates": updates, "blob": blob}))
        except ResponseError:   # a key of another type holds the name: nobody adopts
            self._typed("prices", ResponseError())
            return
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
        if self._say(who, "books", "mismatch"):
            LOG.warning("shared state: replica %s's price books do not fit this replica's "
                        "(%s): are both on the same config?", who, why)

    def _rejected(self, kind: str, who: str, drops: Drops) -> None:
        """What was read from ``who`` and dropped, counted by (kind, reason) and said
        once per replica and reason."""
        for reason, n in drops.items():
            key = (kind, reason)
            self.status.rejected[key] = self.status.rejected.get(key, 0) + n
            if self._say(who, kind, reason):
                LOG.warning("shared state: replica %s dropped %d %s read from %s (%s%s)",
                            self.status.replica, n, kind, who, reason,
                            AUTH_HINTS.get(reason, ""))

    def _say(self, who: str, kind: str, reason: str) -> bool:
        """Whether to log this (replica, kind, reason): once each, and at most
        ``MAX_SAID`` in all (names come from what is read)."""
        key = (who, kind, reason)
        if key in self._said or len(self._said) >= MAX_SAID:
            return False
        self._said.add(key)
        return True

    def as_dict(self) -> dict[str, Any]:
        s = self.status
        return {"mode": "redis", "url": s.url, "replica": s.replica, "status": s.status,
                "leader": s.leader, "replicas": s.replicas, "syncs": s.syncs,
                "failures": s.failures, "error": s.error,
                "rejected": {f"{k}:{r}": n for (k, r), n in sorted(s.rejected.items())},
                "sync_ms": self.cfg.sync_ms, "lease_ms": self.cfg.lease_ms}


async def _off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when it parses more than ``OFF_LOOP_BYTES``
    (a large message must not stall the loop)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _parse_ledgers(found: Sequence[tuple[str, Any]], limits: Sequence[BackendLimits],
                   wall: float, ttl_s: float, offset: float, opener: Opener
                   ) -> tuple[int, list[tuple[str, Drops]], list[Remote], Drops]:
    """The ledgers read, their envelopes checked (``opener``) before their bodies are
    parsed: how many were taken, what was dropped per replica, the merged view of each
    backend and what the merge dropped (runs in a worker thread when large)."""
    ledgers, drops = [], []
    for who, raw in found:
        if not isinstance(raw, bytes):   # a key of another type
            drops.append((who, {"type": 1}))
            continue
        body = _opened(raw, who, ledger_cap(limits) + ENVELOPE_BYTES, opener, "ledger",
                       b"ledger")
        if isinstance(body, str):
            drops.append((who, {body: 1}))
            continue
        led, dropped = parse_ledger(body, who, limits, wall, ttl_s)
        drops.append((who, dropped))
        if led is not None:
            ledgers.append(led)
    remotes, merged = merged_remotes(ledgers, limits, offset)
    return len(ledgers), drops, remotes, merged


def _opened(raw: bytes, who: str, cap: int, opener: Opener, kind: str, context: bytes,
            again: bool = True) -> bytes | str:
    """The body of the message ``raw`` read as ``who``'s, or why it is dropped: longer
    than ``cap`` (unchecked), its envelope (``shared_auth``), or another writer's."""
    if len(raw) > cap:
        return "too_large"
    try:
        return opener.open(raw, kind, context, again, writer=who).body
    except Rejected as exc:
        return exc.reason


def _parse_demands(msgs: Sequence[tuple[str, Any]], shapes: Sequence[BookShape],
                   bounds: Bounds, offset: float, opener: Opener
                   ) -> list[tuple[list[Demand | None] | None, Drops]]:
    """Each demand entry read, its envelope checked (a demand entry is added, never
    replaced: only a newer sequence passes) and parsed (in a worker thread when
    large)."""
    cap = NPZ_BASE_BYTES + sum(s.demand_bytes() for s in shapes) + ENVELOPE_BYTES
    out: list[tuple[list[Demand | None] | None, Drops]] = []
    for who, raw in msgs:
        body = _opened(raw, who, cap, opener, "demand", b"demand", again=False) \
            if isinstance(raw, bytes) else "format"
        out.append((None, {body: 1}) if isinstance(body, str)
                   else parse_demand(body, shapes, bounds, offset))
    return out


def _parse_price_blob(blob: bytes, source: tuple[str, int], opener: Opener,
                      shapes: Sequence[BookShape], bounds: Bounds, offset: float
                      ) -> tuple[list[PriceState] | None, str | None]:
    """The price states of ``source`` (its head: the leader's name and updates, which
    the MAC covers too), their envelope checked first (in a worker thread when
    large)."""
    body = _opened(blob, source[0], prices_cap(shapes) + ENVELOPE_BYTES, opener, "prices",
                   b"prices:%d" % source[1])
    if isinstance(body, str):
        return None, body
    return parse_prices(body, shapes, bounds, offset)


def _name(raw: Any) -> str | None:
    """A replica's name read from Redis, or None when it is none (not text, too long)."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str) or not raw or len(raw) > MAX_NAME_CHARS:
        return None
    return raw


def _int(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def _entry_id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _redacted(url: str) -> str:
    """The URL without a password."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
