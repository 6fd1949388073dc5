"""Process helpers shared by the tests and the benches: a free TCP port, waiting for an
``olproute serve`` to answer ``/healthz``, stopping a server, and a throwaway Redis.
Nothing here imports olproute or bench, so a bench and a test can both use it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a server this bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, server: subprocess.Popen[Any], log: Path,
                 limit_s: float = 180.0, poll_s: float = 0.5) -> None:
    """Wait for ``olproute serve`` at ``url`` to answer ``/healthz``; SystemExit with the
    end of its ``log`` if it exits first, or after ``limit_s``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if server.poll() is not None:
            err = log.read_text(errors="replace")[-4000:]
            raise SystemExit(f"olproute serve exited with {server.returncode}:\n{err}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise SystemExit(f"olproute serve did not answer /healthz within {limit_s:g} s")


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM a server this bench started, SIGKILL it if it is still there after
    ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RedisServer:
    """Debian's ``redis-server`` on 127.0.0.1:``port`` (a free one), nothing written to
    disk, for a bench or a test that starts it; ``start`` returns once it answers PING
    (RuntimeError if it exits first or after ``limit_s``). ``kill`` (SIGKILL) and
    ``start`` again on the same port: a restarted Redis has lost every key. With
    ``password`` it requires AUTH (``requirepass``; ``url`` leaves it out); ``args``: more
    of redis-server's options.
    RuntimeError at once when ``redis-server`` is not installed."""

    def __init__(self, limit_s: float = 60.0, password: str | None = None,
                 args: tuple[str, ...] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian's redis-server; "
                               "./scripts/test installs it)")
        self.exe = exe
        self.limit_s = limit_s
        self.password = password
        self.args = args
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="olproute-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "no",
             *(["--requirepass", self.password] if self.password else []), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        end = time.monotonic() + self.limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(auth + b"PING\r\n")
                    reply = b""
                    while reply.count(b"\r\n") < (2 if auth else 1):
                        chunk = s.recv(64)
                        if not chunk:
                            break
                        reply += chunk
                    if reply.endswith(b"+PONG\r\n"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=self.limit_s)
            self.proc = None

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


@contextmanager
def redis_or_fail(**kwargs: Any) -> Iterator[RedisServer]:
    """A ``RedisServer(**kwargs)`` for a test's fixture, always closed; the test fails,
    rather than skips, where ``redis-server`` is missing (./scripts/test installs it)."""
    import pytest

    try:
        server = RedisServer(**kwargs)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.close()
