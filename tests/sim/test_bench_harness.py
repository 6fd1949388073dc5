"""The bench harness (bench/common.py), through a bench run as its own process (tests do
not import bench/): the results file's blocks, and ``--digest``: one sha256 per simulator
run, the same on a rerun, refused with worker processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.support.bench_run import run_bench


def test_results_file_and_digest(tmp_path: Path) -> None:
    out, digest, png = tmp_path / "olp.json", tmp_path / "olp.digest", tmp_path / "olp.png"
    args = ("--quick", "--json", str(out), "--png", str(png), "--digest", str(digest))
    run_bench("olp_table", *args)
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python ") and "--digest" in doc["command"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", doc["commit"])
    assert doc["seeds"] == [10]
    assert {"cores", "cpu_model", "load_avg", "python"} <= set(doc["machine"])
    assert doc["wall_s"] >= 0 and doc["started"]
    assert [c["label"] for c in doc["results"]["cases"]] == ["stable", "overloaded"]
    first = json.loads(digest.read_text())
    # every policy's run at each rate (the calibration's profiling runs are runs too)
    assert len(first) >= 8 and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in first)
    run_bench("olp_table", *args)
    assert json.loads(digest.read_text()) == first


def test_digest_with_worker_processes_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_bench("olp_table", "--quick", "--workers", "2", "--digest",
                     str(tmp_path / "d.json"), check=False)
    assert proc.returncode == 2 and "--digest" in proc.stderr
    assert not (tmp_path / "d.json").exists()
