"""What every paper-style bench shares: which seeds are reported and which are for
tuning, and how a figure over seeds is summarised.

Every constant a table's policies run with (a weight profile, a step size, a baseline's
weight) is chosen on TUNING_SEEDS; tables report REPORT_SEEDS, which no choice was ever
made on. Seeds 0 and 1 are where every constant chosen before this split was chosen, so
they belong to tuning.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from olproute.operator.executors import Executor

REPORT_SEEDS: tuple[int, ...] = (10, 11, 12)
TUNING_SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, min, max) of a figure over seeds; inf stays inf, NaN when all are NaN."""
    xs = [float(v) for v in values if not math.isnan(float(v))]
    if not xs:
        return math.nan, math.nan, math.nan
    mean = math.inf if any(math.isinf(x) for x in xs) else sum(xs) / len(xs)
    return mean, min(xs), max(xs)


def fmt_spread(values: Sequence[float], fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    """``mean [min-max]`` of a figure over seeds, each value times ``scale``; a single
    seed prints its value alone."""
    mean, lo, hi = spread(values)

    def one(x: float) -> str:
        return "inf" if math.isinf(x) else "-" if math.isnan(x) else fmt.format(x * scale)

    if len(values) == 1:
        return one(mean)
    return f"{one(mean)} [{one(lo)}-{one(hi)}]"


def finite_or_none(x: float) -> float | None:
    """JSON has no inf or NaN: None stands for them."""
    return x if math.isfinite(x) else None


def seed_figure(values: Sequence[float]) -> dict[str, Any]:
    """A figure over seeds for a JSON file: mean, min, max and the seeds' values, inf and
    NaN as None."""
    mean, lo, hi = spread(values)
    return {"mean": finite_or_none(mean), "min": finite_or_none(lo),
            "max": finite_or_none(hi), "per_seed": [finite_or_none(v) for v in values]}


def write_json(path: str | Path, data: Any) -> None:
    """A bench's figures as JSON at ``path`` (its folder made when missing): ``jsonable``
    of them, indented, one newline at the end."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")


def jsonable(x: Any) -> Any:
    """Nested figures for ``json.dumps``: numpy arrays and numbers as Python ones, tuples
    as lists, and non-finite floats as None (JSON has no inf or NaN)."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return finite_or_none(float(x))
    return x


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


def add_executor_args(ap: argparse.ArgumentParser, workers_option: str = "--workers") -> None:
    """``--executor {process,ray}`` and ``--ray-address ADDR``, as ``olproute tune`` has
    them: where a bench's independent points run."""
    from olproute.cli.args import add_executor_options

    add_executor_options(ap, workers_option)


def executor_from(ap: argparse.ArgumentParser, args: argparse.Namespace,
                  workers: int) -> Executor:
    """The executor of ``add_executor_args``' options with ``workers`` processes (or
    local Ray CPUs); options that cannot run (an address without ``--executor ray``, Ray
    missing, nothing at the address) are a usage error."""
    from olproute.cli.args import executor_of
    from olproute.operator.executors import ExecutorError

    try:
        return executor_of(args, max(1, workers))
    except ExecutorError as exc:
        ap.error(str(exc))


class RedisServer:
    """Debian's ``redis-server`` on 127.0.0.1:``port`` (a free one), nothing written to
    disk, for a bench or a test that starts it; ``start`` returns once it answers PING
    (RuntimeError if it exits first or after ``limit_s``). ``kill`` (SIGKILL) and
    ``start`` again on the same port: a restarted Redis has lost every key.
    RuntimeError at once when ``redis-server`` is not installed."""

    def __init__(self, limit_s: float = 60.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian's redis-server; "
                               "./scripts/test installs it)")
        self.exe = exe
        self.limit_s = limit_s
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="olproute-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + self.limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
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
