"""Only replicas write (``olproute.server.shared_auth``), on a real Redis: what is not
sealed with the fleet's secret (forged, unsigned, of another wire format) or was sealed
before what a replica last accepted from its writer (replayed) is dropped, counted in
``olproute_shared_state_rejected_total`` and said once per writer and reason, while the
replica serves every request and goes on syncing; replicas of other secrets do not share;
a replica without a secret refuses to start; Redis AUTH passes through from the URL or
the environment, TLS with the URL's certificate options."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import redis

from olproute.cli.main import _with_state, main
from olproute.config.loader import load_config
from olproute.server.shared import encode_prices
from olproute.server.shared_auth import SECRET_ENV, seal
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.conftest import HANG_S
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config
from tests.integration.test_shared_poison import (
    NS,
    Replica,
    _prices_of,
    sealed,
    serve,
)
from tests.integration.test_shared_poison import follower as follower  # fixture
from tests.integration.test_shared_poison import replica as replica  # fixture
from tests.integration.test_shared_state import (
    SECRET,
    Pair,
    _health,
    _others,
    state_of,
)
from tests.integration.test_shared_state import pair as pair  # fixture
from tests.integration.test_shared_state import redis_server as redis_server  # fixture
from tests.support.processes import RedisServer, free_port, redis_or_fail

OTHER_SECRET = b"a secret of another fleet, 32 b."


def _ledger_doc(r: Replica, writer: str) -> bytes:
    """A ledger that fits: one waiting request on each backend."""
    now = time.time()
    return orjson.dumps({"r": writer, "t": now, "b": {
        name: {"f": [[100, 10, 0, 0, False, now]], "i": []} for name in r.names()}})


def _put_ledger(r: Replica, writer: str, raw: bytes) -> None:
    r.client.set(f"{NS}:ledger:{writer}", raw)
    r.client.zadd(f"{NS}:replicas", {writer: time.time() + 3600})


def _warnings(caplog: pytest.LogCaptureFixture, *words: str) -> int:
    return sum(all(w in rec.getMessage() for w in words) for rec in caplog.records
               if rec.levelno == logging.WARNING)


@pytest.mark.parametrize(("secret", "raw", "reason"), [
    (OTHER_SECRET, None, "forged"),
    (None, None, "unsigned"),
    (SECRET, b"", "version"),   # the body alone: an older olproute's plain JSON
])
def test_a_ledger_not_sealed_with_the_secret_never_counts(
        replica: Replica, caplog: pytest.LogCaptureFixture, secret: bytes | None,
        raw: bytes | None, reason: str) -> None:
    caplog.set_level(logging.WARNING, "olproute.server.shared")
    doc = _ledger_doc(replica, "mallory")
    _put_ledger(replica, "mallory", doc if raw == b"" else sealed(b"ledger", "mallory", doc,
                                                                   secret))
    assert wait_until(lambda: replica.rejected("ledger", reason) >= 5)   # at every sync
    assert _others(replica.stack) == 0
    assert replica.serve() == [200] * 6
    assert replica.synced()
    assert _health(replica.stack)["state"]["rejected"][f"ledger:{reason}"] >= 5
    assert _warnings(caplog, "from mallory", f"({reason}") == 1   # said once


def test_an_older_ledger_put_back_is_replayed_and_stops_counting(replica: Replica) -> None:
    doc = _ledger_doc(replica, "other")
    first, later = time.time_ns(), time.time_ns() + 1000
    _put_ledger(replica, "other", seal(SECRET, b"ledger", "other", later, doc))
    assert wait_until(lambda: _others(replica.stack) == 3)   # accepted: it counts
    _put_ledger(replica, "other", seal(SECRET, b"ledger", "other", first, doc))
    assert wait_until(lambda: replica.rejected("ledger", "replayed") >= 1)
    assert wait_until(lambda: _others(replica.stack) == 0)
    assert replica.serve() == [200] * 6
    assert replica.synced()


def test_a_demand_entry_not_sealed_with_the_secret_adds_nothing(replica: Replica) -> None:
    assert replica.synced(2)   # its first sync read the stream's end
    for secret in (OTHER_SECRET, None):
        replica.client.xadd(f"{NS}:demand", {
            "r": "mallory", "d": sealed(b"demand", "mallory", b"whatever", secret)})
    assert wait_until(lambda: replica.rejected("demand", "forged") >= 1
                      and replica.rejected("demand", "unsigned") >= 1)
    assert replica.serve() == [200] * 6
    assert replica.synced()


def test_a_demand_entry_added_again_is_replayed_and_adds_nothing(pair: Pair) -> None:
    assert all(wait_until(lambda s=s: pair.shared(s).status.syncs >= 2)
               for s in (pair.a, pair.b))
    assert serve(pair.a, 6) == [200] * 6
    books = pair.b.call(lambda: pair.b.app[STATE].router.policy.price_books())
    assert wait_until(lambda: all(b.num_samples == 6 for b in books))
    client = redis.Redis.from_url(pair.url)
    try:
        a_name = pair.shared(pair.a).status.replica.encode()
        entries = client.xrange(f"{NS}:demand")
        fields = [f for _, f in entries if f[b"r"] == a_name][-1]
        client.xadd(f"{NS}:demand", fields)   # A's entry, whole, once more
    finally:
        client.close()
    assert wait_until(lambda: pair.shared(pair.b).status.rejected.get(
        ("demand", "replayed"), 0) >= 1)
    syncs = pair.shared(pair.b).status.syncs
    assert wait_until(lambda: pair.shared(pair.b).status.syncs >= syncs + 3)
    assert all(b.num_samples == 6 for b in books)   # nothing added twice
    assert serve(pair.b, 4) == [200] * 4


def test_prices_sealed_with_another_secret_are_not_adopted(follower: Replica) -> None:
    high = follower.shared.bounds(time.time()).price / 2   # fits: adopted if it opened
    states = [follower.stack.call(b.state) for b in follower.books()]
    body = encode_prices([replace(s, p=s.p * 0 + high, iterate=s.iterate * 0 + high,
                                  origin_s=None) for s in states], follower.offset_s())
    follower.client.hset(f"{NS}:prices", mapping={
        "leader": "thief", "updates": 1,
        "blob": sealed(b"prices:1", "thief", body, OTHER_SECRET)})
    assert wait_until(lambda: follower.rejected("prices", "forged") >= 1)
    assert _prices_of(follower) < high
    assert wait_until(lambda: follower.shared.leading)   # no leader's prices: its own
    assert follower.serve() == [200] * 6
    assert follower.synced()


def test_a_forged_lease_holder_is_followed_by_nobody(follower: Replica) -> None:
    follower.client.set(f"{NS}:leader", sealed(b"lease", "thief", b"", OTHER_SECRET),
                        px=3_600_000)
    follower.publish_prices("thief", 1, lambda p: p * 0 + 1.0)   # sealed with the secret
    assert wait_until(lambda: follower.rejected("lease", "forged") >= 1)
    assert wait_until(lambda: follower.shared.leading)
    assert _prices_of(follower) != 1.0
    assert follower.serve() == [200] * 6


def test_replayed_prices_are_not_adopted(pair: Pair) -> None:
    leader, follower = pair.roles()
    client = redis.Redis.from_url(pair.url)
    try:
        assert serve(leader, 10) == [200] * 10
        assert wait_until(lambda: int(client.hget(f"{NS}:prices", "updates") or 0) >= 2)
        old = client.hgetall(f"{NS}:prices")
        books = follower.call(lambda: follower.app[STATE].router.policy.price_books())
        assert wait_until(lambda: books[0].num_updates > int(old[b"updates"]))

        def replayed() -> bool:   # put back until read (the leader overwrites it)
            client.hset(f"{NS}:prices", mapping=old)
            return pair.shared(follower).status.rejected.get(("prices", "replayed"), 0) >= 1

        assert wait_until(replayed, step=0.01)
        assert books[0].num_updates > int(old[b"updates"])   # never went back
    finally:
        client.close()
    assert serve(follower, 4) == [200] * 4


def _stack(tmp_path: Path, url: str, secret: bytes | None, name: str,
           backend_urls: list[str] | None = None) -> Stack:
    """A replica on ``url`` signing with ``secret`` (None: ``state.insecure``)."""
    folder = tmp_path / name
    folder.mkdir()
    state = state_of(folder, url)
    if secret is None:
        state.pop("secret_file")
        state["insecure"] = True
    else:
        (folder / "state.secret").write_bytes(secret)
    loaded = load_config(_config(folder, state=state))
    return Stack(loaded, num_fakes=0 if backend_urls else 3,
                 calibration=CalibrationSource(loaded, known=[CAL] * 3),
                 backend_urls=backend_urls)


@pytest.mark.parametrize(("secret_b", "a_sees", "b_sees"), [
    (OTHER_SECRET, "forged", "forged"),
    (None, "unsigned", "signed"),     # one replica started with --state-insecure
])
def test_replicas_of_other_secrets_do_not_share(
        tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
        secret_b: bytes | None, a_sees: str, b_sees: str) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    a = _stack(tmp_path, redis_server.url, SECRET, "a")
    try:
        b = _stack(tmp_path, redis_server.url, secret_b, "b", backend_urls=a.fake_urls)
        try:
            for s, reason in ((a, a_sees), (b, b_sees)):
                shared = s.app[STATE].shared
                assert wait_until(lambda sh=shared, r=reason: sh.status.rejected.get(
                    ("ledger", r), 0) >= 3)
                assert wait_until(lambda s=s: _health(s)["state"]["status"] == "shared")
                assert _health(s)["state"]["replicas"] == 1
            # neither follows the other: each learns its own prices
            assert wait_until(lambda: a.app[STATE].shared.leading
                              and b.app[STATE].shared.leading)
            assert serve(a, 4) + serve(b, 4) == [200] * 8
        finally:
            b.close()
    finally:
        a.close()


def test_a_secret_from_the_environment_shares_with_the_same_from_a_file(
        tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _stack(tmp_path, redis_server.url, SECRET, "a")
    try:
        folder = tmp_path / "b"
        folder.mkdir()
        state = state_of(folder, redis_server.url)
        state.pop("secret_file")
        monkeypatch.setenv(SECRET_ENV, SECRET.decode())
        loaded = load_config(_config(folder, state=state))
        b = Stack(loaded, num_fakes=0, calibration=CalibrationSource(loaded, known=[CAL] * 3),
                  backend_urls=a.fake_urls)
        try:
            for s in (a, b):
                assert wait_until(lambda s=s: _health(s)["state"]["replicas"] == 2)
                assert _health(s)["state"]["rejected"] == {}
        finally:
            b.close()
    finally:
        a.close()


def test_state_insecure_lets_a_replica_start_without_a_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    loaded = load_config(_config(tmp_path))
    insecure = _with_state(loaded, "redis://127.0.0.1:1/0", None, True)
    assert insecure.config.state.insecure and insecure.config.state.url is not None
    secret = tmp_path / "state.secret"
    secret.write_bytes(SECRET)
    signed = _with_state(loaded, "rediss://127.0.0.1:1/0", str(secret), False)
    assert signed.config.state.secret_file == str(secret.resolve())


def test_a_replica_without_a_secret_refuses_to_start_naming_the_options(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = _config(tmp_path)
    assert main(["serve", "--config", str(config), "--state", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "router.yaml: state: redis:// without a state secret" in err
    for option in ("--state-secret-file PATH", SECRET_ENV, "--state-insecure"):
        assert option in err
    missing = tmp_path / "nowhere.secret"
    assert main(["serve", "--config", str(config), "--state", "redis://127.0.0.1:1/0",
                 "--state-secret-file", str(missing)]) == 2
    assert f"router.yaml: state.secret_file: {missing}" in capsys.readouterr().err


@pytest.fixture
def redis_auth() -> Iterator[RedisServer]:
    """A redis-server that requires AUTH."""
    with redis_or_fail(limit_s=HANG_S, password="pw-of-the-test") as server:
        yield server


def test_redis_auth_passes_through_from_the_url_or_the_environment(
        tmp_path: Path, redis_auth: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with_password = redis_auth.url.replace("redis://", "redis://:pw-of-the-test@")
    a = _stack(tmp_path, with_password, SECRET, "a")
    try:
        assert wait_until(lambda: _health(a)["state"]["status"] == "shared")
        assert "pw-of-the-test" not in _health(a)["state"]["url"]
        monkeypatch.setenv("OLPROUTE_STATE_REDIS_PASSWORD", "pw-of-the-test")
        b = _stack(tmp_path, redis_auth.url, SECRET, "b", backend_urls=a.fake_urls)
        monkeypatch.delenv("OLPROUTE_STATE_REDIS_PASSWORD")
        try:
            for s in (a, b):
                assert wait_until(lambda s=s: _health(s)["state"]["replicas"] == 2)
            c = _stack(tmp_path, redis_auth.url, SECRET, "c", backend_urls=a.fake_urls)
            try:   # no password: Redis refuses it, it serves alone
                assert wait_until(lambda: "auth" in str(
                    _health(c)["state"]["error"]).lower())
                assert _health(c)["state"]["status"] == "local"
                assert serve(c, 2) == [200] * 2
            finally:
                c.close()
        finally:
            b.close()
    finally:
        a.close()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, made by ``openssl``."""
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True, timeout=HANG_S)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"openssl could not make a test certificate: {exc}")
    return cert, key


def test_replicas_share_over_tls_with_the_urls_certificate_options(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    try:
        server = RedisServer(limit_s=HANG_S, args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file",
            str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        a = _stack(tmp_path, url, SECRET, "a")
        try:
            b = _stack(tmp_path, url, SECRET, "b", backend_urls=a.fake_urls)
            try:
                for s in (a, b):
                    assert wait_until(lambda s=s: _health(s)["state"]["replicas"] == 2)
                # without the CA the server's certificate does not verify: alone
                c = _stack(tmp_path, f"rediss://127.0.0.1:{tls_port}/0", SECRET, "c",
                           backend_urls=a.fake_urls)
                try:   # (a loaded machine may time the first handshakes out)
                    assert wait_until(lambda: "certificate" in str(
                        _health(c)["state"]["error"]).lower())
                    assert _health(c)["state"]["status"] == "local"
                finally:
                    c.close()
            finally:
                b.close()
        finally:
            a.close()
    finally:
        server.close()
