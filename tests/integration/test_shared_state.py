"""Router replicas sharing state on a real Redis (``olproute.server.shared``): two routers
on loopback in front of the same fake backends, requests alternated between them. Each
sees the other's requests within two syncs; the leader alone learns prices, the other
adopts them; a leader that dies is replaced; Redis killed and restarted under load costs
no request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from olproute.cli.main import main
from olproute.config.loader import load_config
from olproute.server.shared import SharedState
from olproute.server.shared_auth import open_sealed
from olproute.server.shared_parse import BookShape, parse_prices
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.conftest import HANG_S
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config, open_stream, read_lines, request
from tests.support.processes import RedisServer, free_port, redis_or_fail

SYNC_MS, LEASE_MS = 50.0, 500.0
SECRET = b"the replicas' test secret, 32 b."   # what every test replica signs with


def state_of(tmp_path: Path, url: str, **extra: Any) -> dict[str, Any]:
    """A test replica's ``state`` section on ``url``, with the fleet's secret in a file
    (``state.secret_file``)."""
    path = tmp_path / "state.secret"
    path.write_bytes(SECRET + b"\n")
    return {"url": url, "sync_ms": SYNC_MS, "lease_ms": LEASE_MS, "timeout_ms": 200.0,
            "secret_file": str(path), **extra}


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free port (``bench.common.RedisServer``); a test fails,
    rather than skips, where it is not installed: ./scripts/test installs it."""
    with redis_or_fail(limit_s=HANG_S) as server:
        yield server


class Pair:
    """Two replicas A and B (``olproute serve --state``) in front of A's fake backends."""

    def __init__(self, tmp_path: Path, url: str, **extra: Any) -> None:
        loaded = load_config(_config(tmp_path, state=state_of(tmp_path, url), **extra))
        cal = CalibrationSource(loaded, known=[CAL] * 3)
        self.url = url
        self.a = Stack(loaded, num_fakes=3, calibration=cal)
        try:
            self.b = Stack(loaded, num_fakes=0, calibration=cal, backend_urls=self.a.fake_urls)
        except BaseException:
            self.a.close()
            raise

    def shared(self, s: Stack) -> SharedState:
        st = s.app[STATE].shared
        assert st is not None
        return st

    def roles(self) -> tuple[Stack, Stack]:
        """(leader, follower), once one of the two leads and the other does not."""
        assert wait_until(lambda: self.shared(self.a).status.leader
                          != self.shared(self.b).status.leader)
        return ((self.a, self.b) if self.shared(self.a).status.leader
                else (self.b, self.a))

    def close(self) -> None:
        try:
            self.b.close()
        finally:
            self.a.close()


@pytest.fixture
def pair(tmp_path: Path, redis_server: RedisServer) -> Iterator[Pair]:
    p = Pair(tmp_path, redis_server.url)
    try:
        yield p
    finally:
        p.close()


def _health(s: Stack) -> dict[str, Any]:
    status, _, body = request(s.url, "GET", "/healthz")
    assert status == 200
    doc: dict[str, Any] = json.loads(body)
    return doc


def _others(s: Stack) -> int:
    """Requests of the other replica that ``/instances`` counts in flight."""
    _, _, body = request(s.url, "GET", "/instances")
    return sum(i["in_flight_other_replicas"] for i in json.loads(body)["instances"])


def test_each_replica_sees_the_others_requests_within_two_syncs(pair: Pair) -> None:
    for f in pair.a.fakes:      # every stream stops after one token until released
        f.hold = pair.a.call(lambda: __import__("asyncio").Event())
        f.hold_after = 1
    body = {"prompt": "hello there", "max_tokens": 8, "stream": True}
    streams = []
    for i in range(6):          # alternated: 3 on A, 3 on B
        s = pair.a if i % 2 == 0 else pair.b
        conn, resp = open_stream(s.url, "/v1/completions", body)
        assert resp.status == 200
        read_lines(resp, limit=1)   # the first token: dispatched and streaming
        streams.append((conn, resp))
    syncs = {s: pair.shared(s).status.syncs for s in (pair.a, pair.b)}
    for s in (pair.a, pair.b):
        assert wait_until(lambda s=s: _others(s) == 3)
        # within two sync periods: at most two syncs after the last dispatch
        assert pair.shared(s).status.syncs - syncs[s] <= 2 + 1   # +1: one in progress
        loads = pair.a.call(lambda s=s: s.app[STATE].tracker.loads(s.app[STATE].now()))
        assert sum(x.num_outstanding for x in loads) == 6
        assert _health(s)["state"]["status"] == "shared"
        assert _health(s)["state"]["replicas"] == 2
    for f in pair.a.fakes:
        assert f.hold is not None
        pair.a.release(f.hold)
    for conn, resp in streams:
        lines = read_lines(resp)
        assert lines[-1] == b"data: [DONE]"
        conn.close()
    for s in (pair.a, pair.b):  # ended: gone from both views
        assert wait_until(lambda s=s: _others(s) == 0)
    assert sum(f.requests for f in pair.a.fakes) == 6


def test_one_leader_learns_the_prices_and_the_other_adopts_them(pair: Pair) -> None:
    leader, follower = pair.roles()
    body = {"prompt": "some words " * 30, "max_tokens": 16}
    for i in range(20):
        s = pair.a if i % 2 == 0 else pair.b
        assert request(s.url, "POST", "/v1/completions", body)[0] == 200

    def updates(s: Stack) -> int:
        return int(json.loads(request(s.url, "GET", "/prices")[2])["updates"])

    assert wait_until(lambda: updates(leader) > 3)
    assert wait_until(lambda: updates(follower) >= 3)
    books = {s: s.call(lambda s=s: s.app[STATE].router.policy.price_books())
             for s in (leader, follower)}
    assert all(b.leading for b in books[leader])
    assert not any(b.leading for b in books[follower])
    # the follower's window holds the leader's samples too: every one of the 20 requests
    assert wait_until(lambda: all(b.num_samples == 20 for s in (leader, follower)
                                  for b in books[s]))
    # the follower prices with what the leader published last
    client = redis.Redis.from_url(pair.url)

    def adopted() -> bool:
        doc = client.hgetall("olproute:prices")
        shapes = [BookShape.of(b) for b in books[follower]]
        body = open_sealed(doc[b"blob"], b"prices:" + doc[b"updates"], SECRET).body
        states, why = parse_prices(body, shapes,
                                   pair.shared(follower).bounds(time.time()), 0.0)
        assert states is not None, why
        return all(b.num_updates == int(doc[b"updates"]) and np.array_equal(b.p, s.p)
                   for b, s in zip(books[follower], states, strict=True))

    try:
        assert wait_until(adopted)
    finally:
        client.close()
    # the live certificate runs on the leader only
    assert leader.app[STATE].shared is not None and leader.app[STATE].shared.leading
    assert not follower.app[STATE].certifying()


def test_a_dead_leader_is_replaced_within_two_lease_periods(pair: Pair) -> None:
    assert wait_until(lambda: pair.shared(pair.a).status.leader
                      or pair.shared(pair.b).status.leader)
    leader, follower = ((pair.a, pair.b) if pair.shared(pair.a).status.leader
                        else (pair.b, pair.a))
    dead = pair.shared(leader)
    # dies without giving up its lease: its syncs stop, its key stays until it lapses
    dead.status.leader = False
    leader.stop_router()
    survivor = pair.shared(follower)
    before = survivor.status.syncs
    assert wait_until(lambda: survivor.status.leader)
    # two lease periods of syncs, and one in progress
    assert survivor.status.syncs - before <= 2 * LEASE_MS / SYNC_MS + 1
    assert _health(follower)["state"]["leader"] is True
    assert all(b.leading for b in follower.call(
        lambda: follower.app[STATE].router.policy.price_books()))
    # the survivor serves on (the backends are A's: they outlive A's router)
    reply = request(follower.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert reply[0] == 200


def test_redis_killed_and_restarted_under_load_costs_no_request(
        pair: Pair, redis_server: RedisServer) -> None:
    body = {"prompt": "hello there", "max_tokens": 4}
    results: list[int] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            s = pair.a if i % 2 == 0 else pair.b
            results.append(request(s.url, "POST", "/v1/completions", body)[0])
            i += 1

    clients = [threading.Thread(target=load) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        assert wait_until(lambda: len(results) >= 20)
        redis_server.kill()
        for s in (pair.a, pair.b):
            assert wait_until(lambda s=s: _health(s)["state"]["status"] == "local")
        n = len(results)
        assert wait_until(lambda: len(results) >= n + 20)   # served while alone
        for s in (pair.a, pair.b):
            assert _health(s)["state"]["replicas"] == 1
            assert pair.shared(s).leading   # each learns its own prices
        redis_server.start()
        for s in (pair.a, pair.b):
            assert wait_until(lambda s=s: _health(s)["state"]["status"] == "shared"
                              and _health(s)["state"]["replicas"] == 2)
        assert wait_until(lambda: pair.shared(pair.a).status.leader
                          != pair.shared(pair.b).status.leader)
        n = len(results)
        assert wait_until(lambda: len(results) >= n + 10)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=60)
    assert results and set(results) == {200}
    # nothing lost or duplicated: each answered request reached one backend once
    assert sum(f.requests for f in pair.a.fakes) == len(results)


def test_a_bad_state_url_or_lease_stops_serve_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    assert main(["serve", "--config", str(config), "--state", "http://127.0.0.1:6379"]) == 2
    err = capsys.readouterr().err
    assert "router.yaml: --state: must be redis://HOST:PORT/DB" in err
    short = _config(tmp_path, state={"url": "redis://127.0.0.1:1/0", "sync_ms": 100,
                                     "lease_ms": 150})
    assert main(["serve", "--config", str(short)]) == 2
    err = capsys.readouterr().err
    assert "router.yaml: state" in err and "at least twice sync_ms" in err


def test_a_replica_starts_and_serves_alone_when_redis_is_down(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"    # nothing listens there
    loaded = load_config(_config(tmp_path, state=state_of(tmp_path, url)))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        state = _health(s)["state"]
        assert state["status"] == "local" and state["error"]
        assert "6379" not in state["url"] and state["replicas"] == 1
        assert request(s.url, "POST", "/v1/completions", {"prompt": "hi"})[0] == 200
        _, _, metrics = request(s.url, "GET", "/metrics")
        assert b"olproute_shared_state_up 0.0" in metrics
    finally:
        s.close()
