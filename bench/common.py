"""The bench harness: what every bench shares.

* which seeds are reported and which are for tuning (REPORT_SEEDS, TUNING_SEEDS), and how
  a figure over seeds is summarised (``spread``, ``fmt_spread``, ``seed_figure``);
* the common flags (``add_harness_args``: ``--json PATH`` and, for simulator benches,
  ``--digest PATH``; ``add_executor_args``: ``--executor``/``--ray-address``;
  ``add_quick_arg``: ``--quick``; ``parse_seeds``: ``--seeds S,S,..``; each bench keeps
  its own defaults for them);
* the results file (``begin`` at the start of a bench's ``main``, ``write_results`` at
  its end): a JSON document ``{"command", "commit", "seeds", "machine", "started",
  "wall_s", "results"}`` where ``results`` holds the bench's figures under its own keys.

Every constant a table's policies run with (a weight profile, a step size, a baseline's
weight) is chosen on TUNING_SEEDS; tables report REPORT_SEEDS, which no choice was ever
made on. Seeds 0 and 1 are where every constant chosen before this split was chosen, so
they belong to tuning.

``bench/`` is a package: a bench runs as ``python bench/x.py`` (its first lines put the
checkout on ``sys.path``) and imports ``from bench.common import ...``.

``--digest PATH`` wraps ``olproute.sim.cluster.Cluster.run`` in this process: every
run's per-request arrays are hashed (sha256 over ``DIGEST_FIELDS``, each present one's
name then its bytes) in run order, and the list is written to PATH after every run. A
run in a worker process (``--workers`` > 1, ``--executor ray``) is not seen, so
``begin`` makes that combination a usage error. Two checkouts whose digests match ran
the same simulations, request for request.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tests.support.processes import (  # noqa: F401  (re-exported for the benches)
    RedisServer,
    free_port,
    stop_process,
    wait_healthy,
)

if TYPE_CHECKING:
    from olproute.operator.executors import Executor

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DIGEST_FIELDS: tuple[str, ...] = (
    "instance", "dispatch_s", "first_token_s", "finish_s", "num_preemptions",
    "decode_tokens", "decode_instance", "prefill_end_s", "kv_arrival_s", "shed",
    "cached_prompt_tokens")

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



# --- the results file -------------------------------------------------------------------

_RUN: dict[str, Any] = {}


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds 10,11,12`` (an argparse ``type``): the seeds, blanks skipped."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_quick_arg(ap: argparse.ArgumentParser, what: str) -> None:
    """``--quick``: the bench's smoke run, ``what`` saying what it runs."""
    ap.add_argument("--quick", action="store_true", help=what)


def add_harness_args(ap: argparse.ArgumentParser, *, json_flag: bool = True,
                     digest: bool = False) -> None:
    """The harness's flags: ``--json PATH`` (the results file) unless the bench has its
    own, and ``--digest PATH`` for a bench that runs the simulator."""
    if json_flag:
        ap.add_argument("--json", metavar="PATH",
                        help="write the results file (command, commit, seeds, machine, "
                             "figures) as JSON")
    if digest:
        ap.add_argument("--digest", metavar="PATH",
                        help="hash every simulator run's per-request arrays, in run order, "
                             "into a JSON list at PATH (in-process runs only)")


def git_commit(repo: Path = REPO) -> str | None:
    """``git rev-parse HEAD`` of ``repo``, ``+dirty`` when a tracked file differs from it
    (untracked files, like a results file just written, do not count); None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                 "--untracked-files=no"], check=True, capture_output=True,
                                text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if status else "")


def machine() -> dict[str, Any]:
    """Cores, CPU model, load average now (1, 5, 15 min) and the Python version."""
    model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cores": os.cpu_count(), "cpu_model": model, "load_avg": load,
            "python": platform.python_version(), "platform": platform.platform()}


def begin(args: argparse.Namespace | None = None, ap: argparse.ArgumentParser | None = None,
          argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Start a bench's run: note the command, commit, machine and start time for
    ``write_results``, and install ``--digest`` when it is given (a usage error with
    ``--workers`` > 1 or ``--executor ray``, whose runs happen in other processes)."""
    _RUN.clear()
    _RUN.update({
        "command": ["python", *(sys.argv if argv is None else argv)],
        "commit": git_commit(),
        "machine": machine(),
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "_t0": time.perf_counter(),
    })
    digest = getattr(args, "digest", None) if args is not None else None
    if digest:
        workers = getattr(args, "workers", 1) or 1
        ray = getattr(args, "executor", None) == "ray" or getattr(args, "ray_address", None)
        if workers > 1 or ray:
            msg = ("--digest sees only the runs in this process: run with --workers 1 "
                   "and without --executor ray")
            if ap is not None:
                ap.error(msg)
            raise SystemExit(msg)
        install_digest(digest)
    return _RUN


def results_document(figures: Any, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """The results file's document: this run's command, commit, seeds, machine, start and
    wall time, and the bench's ``figures`` under ``results``."""
    if not _RUN:
        begin()
    return {"command": " ".join(_RUN["command"]), "commit": _RUN["commit"],
            "seeds": [int(s) for s in seeds] if seeds is not None else [],
            "machine": _RUN["machine"], "started": _RUN["started"],
            "wall_s": round(time.perf_counter() - _RUN["_t0"], 1),
            "results": figures}


def write_results(path: str | Path | None, figures: Any,
                  seeds: Sequence[int] | None = None) -> None:
    """Write the results file at ``path`` (nothing when it is None): ``results_document``
    of ``figures``, through ``write_json``."""
    if path is None:
        return
    write_json(path, results_document(figures, seeds))


def install_digest(path: str | Path) -> list[str]:
    """Wrap ``Cluster.run`` in this process so that each run's per-request arrays are
    hashed, in run order, into a JSON list at ``path`` (rewritten after every run)."""
    from olproute.sim import cluster

    out: list[str] = []
    orig = cluster.Cluster.run
    if getattr(orig, "_digest_wrapped", False):
        orig = orig.__wrapped__  # type: ignore[attr-defined]

    def run(self: Any, *a: Any, **kw: Any) -> Any:
        res = orig(self, *a, **kw)
        out.append(digest_of(res))
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(out, indent=0) + "\n")
        return res

    run._digest_wrapped = True  # type: ignore[attr-defined]
    run.__wrapped__ = orig  # type: ignore[attr-defined]
    cluster.Cluster.run = run  # type: ignore[method-assign]
    return out


def digest_of(result: Any) -> str:
    """sha256 over a SimResult's per-request arrays: for each of ``DIGEST_FIELDS`` that is
    not None, its name's bytes then ``np.ascontiguousarray(a).tobytes()``."""
    h = hashlib.sha256()
    for name in DIGEST_FIELDS:
        a = getattr(result, name, None)
        if a is not None:
            h.update(name.encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
