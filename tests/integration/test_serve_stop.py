"""Stopping ``olproute serve`` (its own process, emulated engines, bid_price with the live
certificate's worker process): SIGKILLed, it leaves no process behind (the worker dies
with it, ``olproute.server.certify.die_with_parent``); SIGTERMed while its Redis is
paused (SIGSTOP, or busy in ``DEBUG SLEEP``), it exits cleanly, its worker with it
(every Redis call is bounded, and so is stopping the background tasks). The waits here
only catch hangs: the code's bound is 5 s, the test allows far more."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import HANG_S, serve_config_data
from tests.integration.server_harness import wait_until
from tests.integration.test_shared_state import SECRET
from tests.support.processes import (
    RedisServer,
    free_port,
    redis_or_fail,
    stop_process,
    wait_healthy,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_HANG_S = 20.0   # a SIGTERMed serve still running after this hangs


def _config(tmp_path: Path, state: dict[str, Any] | None = None) -> Path:
    data = serve_config_data()
    if state is not None:
        data["state"] = state
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Serve:
    """``olproute serve`` on a free port, its log in ``tmp_path``."""

    def __init__(self, tmp_path: Path, config: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp_path / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "olproute.cli", "serve", "--config", str(config),
                 "--port", self.url.rsplit(":", 1)[1]], cwd=REPO_ROOT,
                stdout=out, stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if k != "OLPROUTE_STATE_SECRET"})
        wait_healthy(self.url, self.proc, self.log, limit_s=180.0, poll_s=0.1)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/healthz", timeout=HANG_S) as r:
            doc: dict[str, Any] = json.load(r)
        return doc


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux's /proc children lists)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            out.extend(int(k) for k in kids)
            todo.extend(int(k) for k in kids)
    return out


def _alive(pid: int) -> bool:
    """Is ``pid`` a process that runs (a zombie, dead and not yet reaped, is not)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _worker(pid: int) -> list[int]:
    """The live certificate's worker processes below ``pid``."""
    out = []
    for p in _descendants(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(p)
    return out


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server that takes ``DEBUG SLEEP`` from loopback."""
    with redis_or_fail(limit_s=HANG_S, args=("--enable-debug-command", "local")) as server:
        yield server


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    s = Serve(tmp_path, _config(tmp_path))
    try:
        yield s
    finally:
        stop_process(s.proc, grace_s=HANG_S)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_serve_killed_with_sigkill_leaves_no_worker_behind(serve: Serve) -> None:
    assert wait_until(lambda: len(_worker(serve.proc.pid)) == 1)
    below = _descendants(serve.proc.pid)
    assert all(_alive(p) for p in below)
    serve.proc.send_signal(signal.SIGKILL)
    serve.proc.wait(timeout=HANG_S)
    assert wait_until(lambda: not any(_alive(p) for p in below)), \
        [Path(f"/proc/{p}/cmdline").read_bytes() for p in below if _alive(p)]


def _pause(redis: RedisServer, how: str) -> threading.Thread | None:
    """Redis stops answering: SIGSTOPped, or busy in ``DEBUG SLEEP`` (its thread)."""
    assert redis.proc is not None
    if how == "sigstop":
        redis.proc.send_signal(signal.SIGSTOP)
        return None

    def sleep() -> None:
        with socket.create_connection(("127.0.0.1", redis.port), timeout=HANG_S) as s:
            s.sendall(b"DEBUG SLEEP 60\r\n")
            with contextlib.suppress(OSError):   # killed with the test's Redis
                s.recv(16)

    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
@pytest.mark.parametrize("how", ["sigstop", "debug_sleep"])
def test_a_serve_whose_redis_is_paused_stops_on_sigterm(
        tmp_path: Path, redis_server: RedisServer, how: str) -> None:
    secret = tmp_path / "state.secret"
    secret.write_bytes(SECRET)
    config = _config(tmp_path, {"url": redis_server.url, "secret_file": str(secret)})
    s = Serve(tmp_path, config)
    try:
        assert wait_until(lambda: s.health()["state"]["leader"] is True)
        assert wait_until(lambda: len(_worker(s.proc.pid)) == 1)
        below = _descendants(s.proc.pid)
        _pause(redis_server, how)
        # the replica saw it: its syncs time out (one is in flight at any time)
        assert wait_until(lambda: s.health()["state"]["status"] == "local")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=STOP_HANG_S) == 0
        assert wait_until(lambda: not any(_alive(p) for p in below))
        assert "did not stop when cancelled" not in s.log.read_text(errors="replace")
    finally:
        if redis_server.proc is not None and how == "sigstop":
            redis_server.proc.send_signal(signal.SIGCONT)
        stop_process(s.proc, grace_s=HANG_S)
