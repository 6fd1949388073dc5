"""``olproute tune --executor ray`` and the executors under it (``olproute.operator.executors``):
the same CSV as the process pool on a tiny grid, results in call order, a failing
call named, and one-line errors for a Ray that cannot start.

One local Ray (2 CPUs) serves every Ray test of the module: starting one takes 4-7 s on
this machine and stopping it 1.5 s. The executors see it connected and use it as it is,
as they would a caller's."""

from __future__ import annotations

import csv
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from olproute.cli.main import main
from olproute.operator import executors
from olproute.operator.executors import CallFailed, Executor
from tests.conftest import PROFILES

# the one column that is not a result: the point's wall time, read from the clock of
# whichever worker ran it (tune.PointResult.wall_s)
WALL_CLOCK_COLUMNS = {"wall_s"}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with Executor("ray", jobs=2).session():
        yield


def _files(tmp_path: Path) -> tuple[Path, Path]:
    """A pool loaded enough (60 req/s on two engines of 8 slots, seed 0) that the four
    points differ in every latency figure, so that rows swapped between points would
    show."""
    config: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                       "max_num_seqs": 8}],
        "workload": {"kind": "poisson", "rate_per_s": 60, "num_requests": 120,
                     "prompt_tokens": 400, "decode_tokens": 60},
        "router": {"policy": "bid_price", "slot_ms": 20},
        "prices": {"window": 200, "minibatch": 32},
        "sim": {"seed": 0},
    }
    grid = {"reward": {"delta": [0.0, 20.0], "ttft_threshold_s": 0.05},
            "admission": {"max_waiting": [0, 8]},
            "select": {"metric": "slo_attainment"}}
    cfg, grd = tmp_path / "router.yaml", tmp_path / "grid.yaml"
    cfg.write_text(yaml.safe_dump(config))
    grd.write_text(yaml.safe_dump(grid))
    return cfg, grd


def _tune(cfg: Path, grid: Path, out: Path, *options: str) -> None:
    assert main(["tune", "--config", str(cfg), "--grid", str(grid), "--jobs", "2",
                 "--out", str(out), "--no-progress", *options]) == 0


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, rows


def test_tune_on_ray_writes_the_process_pools_csv(tmp_path: Path, local_ray: None) -> None:
    """The same points on the same seed give the same rows, byte for byte, but for the
    wall-time column; and the same selected profile."""
    cfg, grid = _files(tmp_path)
    _tune(cfg, grid, tmp_path / "process")
    _tune(cfg, grid, tmp_path / "ray", "--executor", "ray")

    header, by_pool = _rows(tmp_path / "process" / "tune.csv")
    header_ray, by_ray = _rows(tmp_path / "ray" / "tune.csv")
    assert header_ray == header and set(header) >= WALL_CLOCK_COLUMNS
    keep = [k for k, name in enumerate(header) if name not in WALL_CLOCK_COLUMNS]
    assert [[r[k] for k in keep] for r in by_ray] == [[r[k] for k in keep] for r in by_pool]
    assert [r[0] for r in by_ray] == ["0", "1", "2", "3"]
    mean_ttft = header.index("ttft_mean_s")
    assert len({r[mean_ttft] for r in by_pool}) == 4   # the points do differ
    assert ((tmp_path / "ray" / "selected.yaml").read_bytes()
            == (tmp_path / "process" / "selected.yaml").read_bytes())


def square_slowly(x: int, num_calls: int) -> int:
    """x squared, the first calls slowest (so that they tend to finish last); 3 fails."""
    time.sleep(0.05 * (num_calls - x))
    if x == 3:
        raise ValueError(f"no square for {x}")
    return x * x


@pytest.fixture(params=[("process", 1), ("process", 2), ("ray", 2)],
                ids=["in-process", "process-pool", "ray"])
def executor(request: pytest.FixtureRequest) -> Executor:
    kind, jobs = request.param
    if kind == "ray":
        request.getfixturevalue("local_ray")
    return Executor(kind, jobs)


def test_results_come_back_in_call_order(executor: Executor) -> None:
    calls = [(x, 6) for x in (0, 1, 2, 4, 5)]
    finished: list[int] = []
    results = executor.run(square_slowly, calls, on_done=lambda i, r: finished.append(i))
    assert results == [0, 1, 4, 16, 25]
    assert sorted(finished) == [0, 1, 2, 3, 4]   # each reported once, in any order


def test_a_failing_call_is_named_with_its_exception(executor: Executor) -> None:
    calls = [(x, 6) for x in range(6)]
    with pytest.raises(CallFailed) as info:
        executor.run(square_slowly, calls, describe=lambda i: f"point {i} {calls[i]}")
    assert info.value.index == 3
    assert str(info.value) == "point 3 (3, 6) failed: ValueError: no square for 3"
    assert isinstance(info.value.__cause__, ValueError)   # Ray's carries the worker's trace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_ray_address_is_a_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused at once, before the grid is read: ray.init itself would retry for
    minutes."""
    cfg, grid = _files(tmp_path)
    address = f"127.0.0.1:{_free_port()}"
    assert main(["tune", "--config", str(cfg), "--grid", str(grid), "--out",
                 str(tmp_path / "o"), "--executor", "ray", "--ray-address", address]) == 2
    err = capsys.readouterr().err
    assert err == (f"olproute: error: no Ray cluster at --ray-address {address}: cannot "
                   "connect (Connection refused)\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("options", "message"), [
    (["--ray-address", "127.0.0.1:6379"],
     "a Ray address is for the ray executor (--executor ray)"),
    (["--executor", "ray"], "--executor ray needs the package ray, which is not "
                            "installed: pip install 'olproute[ray]'"),
], ids=["address-without-ray", "ray-not-installed"])
def test_executor_options_that_cannot_run_are_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        options: list[str], message: str) -> None:
    monkeypatch.setattr(executors, "ray_installed", lambda: False)   # as without ray
    cfg, grid = _files(tmp_path)
    assert main(["tune", "--config", str(cfg), "--grid", str(grid), "--out",
                 str(tmp_path / "o"), *options]) == 2
    assert capsys.readouterr().err == f"olproute: error: {message}\n"
