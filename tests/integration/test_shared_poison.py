"""Router replicas on a real Redis whose keys hold what no replica of this config wrote
(``olproute.server.shared_parse``): one test per kind. The writer here holds the fleet's
secret (a replica with a bug, or of another config), so its messages pass their
envelopes (``olproute.server.shared_auth``) and reach the parsers. The replica keeps
serving (every request answered, none refused for it), drops what does not fit and
counts it in ``olproute_shared_state_rejected_total``, keeps syncing (what it reads
never makes a sync fail), and undoes prices it adopted once their publisher's keys are
gone."""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from olproute.config.loader import load_config
from olproute.pricing.book import PriceBook
from olproute.server.shared import SharedState, encode_prices
from olproute.server.shared_auth import seal
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config, request
from tests.integration.test_shared_state import (
    SECRET,
    SYNC_MS,
    Pair,
    _health,
    _others,
    state_of,
)
from tests.integration.test_shared_state import pair as pair  # fixture
from tests.integration.test_shared_state import redis_server as redis_server  # fixture
from tests.support.processes import RedisServer

NS = "olproute"
FOREVER_S = 3600.0   # a poisoner's replica entry that never ages out of the set


def sealed(context: bytes, writer: str, body: bytes, secret: bytes | None = SECRET) -> bytes:
    """``body`` sealed as ``writer``'s with the fleet's secret (a sequence newer than
    any before: the wall clock in nanoseconds, as a replica's)."""
    return seal(secret, context, writer, time.time_ns(), body)


class Replica:
    """One router replica on Redis in front of three fake backends, a Redis client to
    write the keys with, and what the replica says of them."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        loaded = load_config(_config(tmp_path, state=state_of(tmp_path, url)))
        self.stack = Stack(loaded, num_fakes=3,
                           calibration=CalibrationSource(loaded, known=[CAL] * 3))
        self.client = redis.Redis.from_url(url)

    @property
    def shared(self) -> SharedState:
        st = self.stack.app[STATE].shared
        assert st is not None
        return st

    def names(self) -> list[str]:
        return [b.spec.name for b in self.stack.app[STATE].tracker.backends]

    def books(self) -> tuple[PriceBook, ...]:
        books = self.stack.call(lambda: self.stack.app[STATE].router.policy.price_books())
        assert all(isinstance(b, PriceBook) for b in books)
        return tuple(books)

    def offset_s(self) -> float:
        """Wall-clock time minus the replica's clock."""
        return time.time() - self.stack.call(self.stack.app[STATE].now)

    def rejected(self, kind: str, reason: str) -> float:
        _, _, body = request(self.stack.url, "GET", "/metrics")
        m = re.search(rf'olproute_shared_state_rejected_total{{kind="{kind}",'
                      rf'reason="{reason}"}} ([0-9.e+]+)', body.decode())
        return float(m.group(1)) if m else 0.0

    def synced(self, n: int = 5) -> bool:
        """The replica goes on syncing with Redis: ``n`` more syncs, still shared."""
        before = self.shared.status.syncs
        return wait_until(lambda: self.shared.status.syncs >= before + n) and \
            _health(self.stack)["state"]["status"] == "shared"

    def serve(self, n: int = 6) -> list[int]:
        """``n`` requests at once: their statuses."""
        return serve(self.stack, n)

    def ledger(self, replica: str, rows: Callable[[float], list[list[Any]]],
               raw: bytes | None = None) -> None:
        """A ledger under ``replica``'s key, listed among the live replicas for good."""
        now = time.time()
        doc = raw or orjson.dumps({"r": replica, "t": now, "b": {
            name: {"f": rows(now), "i": []} for name in self.names()}})
        self.client.set(f"{NS}:ledger:{replica}", sealed(b"ledger", replica, doc))
        self.client.zadd(f"{NS}:replicas", {replica: now + FOREVER_S})

    def publish_prices(self, leader: str, updates: int,
                       prices: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]],
                       blob: bytes | None = None) -> None:
        """Price states under ``leader``'s name: this replica's own, ``prices`` applied to
        their handed-out and steps' prices."""
        if blob is None:
            states = [self.stack.call(b.state) for b in self.books()]
            states = [replace(s, p=prices(s.p), iterate=prices(s.iterate), origin_s=None)
                      for s in states]
            blob = encode_prices(states, self.offset_s())
        blob = sealed(b"prices:%d" % updates, leader, blob)
        self.client.hset(f"{NS}:prices", mapping={"leader": leader, "updates": updates,
                                                  "blob": blob})

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.stack.close()


def serve(stack: Stack, n: int) -> list[int]:
    body = {"prompt": "hello there", "max_tokens": 4}
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(
        request(stack.url, "POST", "/v1/completions", body)[0])) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.fixture
def replica(tmp_path: Path, redis_server: RedisServer) -> Iterator[Replica]:
    r = Replica(tmp_path, redis_server.url)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def follower(tmp_path: Path, redis_server: RedisServer) -> Iterator[Replica]:
    """A replica that never takes the lease: another name holds it until it is deleted."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(f"{NS}:leader", sealed(b"lease", "thief", b""), px=int(FOREVER_S * 1e3))
    finally:
        client.close()
    r = Replica(tmp_path, redis_server.url)
    try:
        yield r
    finally:
        r.close()


def _waiting(now: float) -> list[list[Any]]:
    return [[100, 10, 0, 0, False, now]]


# -- ledgers -----------------------------------------------------------------------------------
def test_an_ordinary_looking_ledger_per_backend_is_served_through_and_goes_stale(
        replica: Replica) -> None:
    stop = threading.Event()

    def republish() -> None:   # as a live replica would, every sync
        while not stop.is_set():
            replica.ledger("evil", _waiting)
            stop.wait(SYNC_MS / 1e3)

    writer = threading.Thread(target=republish)
    writer.start()
    try:
        assert wait_until(lambda: _others(replica.stack) == 3)
        assert replica.serve(8) == [200] * 8   # every engine is idle: each is served
    finally:
        stop.set()
        writer.join(timeout=60)
    # nobody republishes it: dropped within its time to live, and counted
    assert wait_until(lambda: _others(replica.stack) == 0)
    assert wait_until(lambda: replica.rejected("ledger", "stale") >= 1)
    assert replica.synced()


@pytest.mark.parametrize(("rows", "reason"), [
    # more running than the backend has batch slots (the test's profile: 256), and a
    # queue of more requests than a replica can send there
    (lambda now: [[100, 10, 1, 0, True, now]] * 257, "running"),
    (lambda now: [[100, 10, 0, 0, False, now]] * 1025, "entries"),
    (lambda now: [[100, -10, 0, 0, False, now]], "count"),
    (lambda now: [[2 ** 64 - 1, 10, 0, 0, False, now]], "count"),     # past int64
    (lambda now: [[10 ** 12, 10, 0, 0, False, now]], "count"),        # past the KV
    (lambda now: [[100, 10, 0, 0, False, 1e300]], "time"),
    (lambda now: [[100, 10, 0, 0, False, now + 3600]], "time"),
])
def test_a_ledger_with_impossible_counts_or_times_is_dropped(
        replica: Replica, rows: Callable[[float], list[list[Any]]], reason: str) -> None:
    assert {b.spec.max_num_seqs for b in replica.stack.app[STATE].tracker.backends} == {256}
    replica.ledger("evil", rows)
    assert wait_until(lambda: replica.rejected("ledger", reason) >= 1)
    assert _others(replica.stack) == 0
    assert replica.serve() == [200] * 6
    assert replica.synced()


def test_an_infinite_time_or_a_ledger_of_another_type_is_dropped(replica: Replica) -> None:
    replica.ledger("inf", _waiting, raw=b'{"r": "inf", "t": 1e400, "b": {}}')
    replica.client.hset(f"{NS}:ledger:hash", "x", "y")
    replica.client.zadd(f"{NS}:replicas", {"hash": time.time() + FOREVER_S})
    assert wait_until(lambda: replica.rejected("ledger", "format") >= 1
                      and replica.rejected("ledger", "type") >= 1)
    assert replica.serve() == [200] * 6
    assert replica.synced()


def test_fifty_thousand_ledger_entries_are_dropped_unread(replica: Replica) -> None:
    replica.ledger("evil", lambda now: [[100, 10, 0, 0, False, now]] * 50_000)
    assert wait_until(lambda: replica.rejected("ledger", "too_large") >= 5)
    assert _others(replica.stack) == 0
    assert replica.serve() == [200] * 6
    assert replica.synced(10)
    lag = replica.stack.app[STATE].lag.summary(0.0)
    assert lag.samples > 0   # the loop went on sampling its lag throughout


# -- prices ------------------------------------------------------------------------------------
def _prices_of(r: Replica) -> float:
    return max(float(np.max(b.p)) for b in r.books())


def test_published_prices_that_are_huge_are_not_adopted(follower: Replica) -> None:
    follower.publish_prices("thief", 1, lambda p: p * 0 + 1e30)
    assert wait_until(lambda: follower.rejected("prices", "bound") >= 1)
    assert _prices_of(follower) < follower.shared.bounds(time.time()).price
    # no leader's prices for a lease: it learns its own
    assert wait_until(lambda: follower.shared.leading)
    assert follower.serve() == [200] * 6
    assert follower.synced()


def test_nan_prices_never_enter_the_book(follower: Replica) -> None:
    follower.publish_prices("thief", 1, lambda p: p * np.nan)
    assert wait_until(lambda: follower.rejected("prices", "nonfinite") >= 1)
    assert all(np.all(np.isfinite(b.p)) for b in follower.books())
    doc = orjson.loads(request(follower.stack.url, "GET", "/prices")[2])
    assert doc["updates"] >= 0
    assert follower.serve() == [200] * 6
    assert follower.synced()


def test_prices_adopted_under_a_stolen_lease_are_undone_when_its_keys_go(
        follower: Replica) -> None:
    follower.publish_prices("thief", 1, lambda p: p * 0 + 1e300)
    assert wait_until(lambda: follower.rejected("prices", "bound") >= 1)
    high = follower.shared.bounds(time.time()).price / 2   # fits: adopted
    follower.publish_prices("thief", 2, lambda p: p * 0 + high)
    assert wait_until(lambda: _prices_of(follower) == high)
    assert not follower.shared.leading
    follower.client.delete(f"{NS}:leader", f"{NS}:prices")
    # its publisher gone: the replica leads, from the prices it had before adopting
    assert wait_until(lambda: follower.shared.status.leader)
    assert wait_until(lambda: _prices_of(follower) < high)
    assert all(b.leading for b in follower.books())
    assert follower.serve() == [200] * 6


def test_a_price_state_of_another_shape_stops_no_learning(pair: Pair) -> None:
    leader, follower = pair.roles()
    client = redis.Redis.from_url(pair.url)
    try:
        state = leader.call(lambda: leader.app[STATE].router.policy.price_books()[0].state())
        wrong = encode_prices([replace(state, p=state.p[:, :-1])], 0.0)
        name = pair.shared(leader).status.replica
        client.hset(f"{NS}:prices", mapping={
            "leader": name, "updates": 10 ** 6,
            "blob": sealed(b"prices:%d" % 10 ** 6, name, wrong)})
        assert wait_until(lambda: pair.shared(follower).status.rejected.get(
            ("prices", "shape"), 0) >= 1)
    finally:
        client.close()
    assert serve(pair.a, 5) + serve(pair.b, 5) == [200] * 10
    books = follower.call(lambda: follower.app[STATE].router.policy.price_books())
    # the leader learns on and publishes; the follower adopts its next state
    assert wait_until(lambda: books[0].num_updates >= 3 and not books[0].leading)


# -- demand ------------------------------------------------------------------------------------
def test_a_demand_message_claiming_a_huge_number_of_books_is_dropped(
        replica: Replica) -> None:
    assert replica.synced(2)   # its first sync read the stream's end
    buf = io.BytesIO()
    np.savez(buf, num_books=np.array([10 ** 15]))
    replica.client.xadd(f"{NS}:demand", {"r": "evil",
                                         "d": sealed(b"demand", "evil", buf.getvalue())})
    assert wait_until(lambda: replica.rejected("demand", "books") >= 1)
    assert replica.serve() == [200] * 6
    assert replica.synced()


def test_a_malformed_demand_entry_stops_no_sharing(pair: Pair) -> None:
    assert all(wait_until(lambda s=s: pair.shared(s).status.syncs >= 2)
               for s in (pair.a, pair.b))
    client = redis.Redis.from_url(pair.url)
    try:
        client.xadd(f"{NS}:demand", {"r": "evil",
                                     "d": sealed(b"demand", "evil", b"not an archive")})
        client.xadd(f"{NS}:demand", {"who": "nobody"})   # no fields of ours
    finally:
        client.close()
    for s in (pair.a, pair.b):
        assert wait_until(lambda s=s: pair.shared(s).status.rejected.get(
            ("demand", "format"), 0) >= 2)
    assert serve(pair.a, 10) + serve(pair.b, 10) == [200] * 20
    # each replica's books hold the other's demand: sharing went on
    for s in (pair.a, pair.b):
        books = s.call(lambda s=s: s.app[STATE].router.policy.price_books())
        assert wait_until(lambda b=books: all(x.num_samples == 20 for x in b))
        assert _health(s)["state"]["status"] == "shared"


def test_keys_of_another_type_stop_no_sync(replica: Replica) -> None:
    replica.client.set(f"{NS}:demand", b"a string")
    replica.client.set(f"{NS}:prices", b"a string")
    assert replica.serve(10) == [200] * 10   # the leader learns and would publish
    assert wait_until(lambda: replica.rejected("demand", "type") >= 1
                      and replica.rejected("prices", "type") >= 1)
    assert replica.synced()
    assert replica.shared.status.leader
