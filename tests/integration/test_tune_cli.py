"""``olproute tune`` end to end: a tiny sweep in worker processes writes its CSV, PNG and
YAML; the YAML is a weight profile that ``load_config`` merges, that a router serves
with, and that ``POST /admin/reload`` accepts."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from olproute.cli.main import main
from olproute.config.loader import load_config
from olproute.config.profiles import read_profile
from olproute.estimate.calibration import InstanceCalibration
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.conftest import PROFILES
from tests.integration.server_harness import Stack
from tests.integration.test_server import request

TOKEN = "s3cret"
CAL = InstanceCalibration(beta=(3e-3, 1e-6, 1e-8, 1e-10), prefill_tokens_per_s=50_000,
                          tpot_s=0.004, mean_batch_seqs=8, service_rate_per_s=20)


def _files(tmp_path: Path) -> tuple[Path, Path]:
    config: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                       "max_num_seqs": 16}],
        "workload": {"kind": "poisson", "rate_per_s": 40, "num_requests": 120,
                     "prompt_tokens": 400, "decode_tokens": 60},
        "router": {"policy": "bid_price", "slot_ms": 20},
        "prices": {"window": 200, "minibatch": 32},
        "server": {"health_period_s": 0.1, "admin_token": TOKEN},
    }
    grid = {"reward": {"zeta2": [0.0, 10.0], "ttft_threshold_s": 0.2},
            "admission": {"mode": ["defer", "shed"]},
            "select": {"metric": "slo_attainment", "constraints": ["num_shed <= 1000"]}}
    cfg, grd = tmp_path / "router.yaml", tmp_path / "grid.yaml"
    cfg.write_text(yaml.safe_dump(config))
    grd.write_text(yaml.safe_dump(grid))
    return cfg, grd


def test_tiny_sweep_writes_csv_png_yaml_that_serve_and_reload_accept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg, grid = _files(tmp_path)
    out = tmp_path / "tune"
    assert main(["tune", "--config", str(cfg), "--grid", str(grid), "--jobs", "2",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "selected" in printed and f"{out}/selected.yaml" in printed

    with (out / "tune.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["point"] for r in rows] == ["0", "1", "2", "3"]
    assert {(r["reward.zeta2"], r["admission.mode"]) for r in rows} == {
        ("0.0", "defer"), ("0.0", "shed"), ("10.0", "defer"), ("10.0", "shed")}
    for r in rows:
        assert r["num_requests"] == "120" and 0.0 <= float(r["slo_attainment"]) <= 1.0
        assert r["reward.ttft_threshold_s"] == "0.2"
    assert sum(int(r["selected"]) for r in rows) == 1
    assert any(int(r["pareto_throughput"]) for r in rows)
    chosen = next(r for r in rows if r["selected"] == "1")
    assert float(chosen["slo_attainment"]) == max(float(r["slo_attainment"]) for r in rows)

    png = (out / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    selected = out / "selected.yaml"
    profile = read_profile(selected)
    assert profile["reward"]["zeta2"] == float(chosen["reward.zeta2"])
    assert profile["admission"]["mode"] == chosen["admission.mode"]
    assert "prices" not in profile  # the grid did not touch it
    loaded = load_config(cfg, [selected])
    assert loaded.config.reward.ttft_threshold_s == 0.2
    assert loaded.config.admission.mode == chosen["admission.mode"]

    # a router serves with it, and reload accepts it (re-read, then given in the body)
    stack = Stack(loaded, num_fakes=2, calibration=CalibrationSource(loaded, known=[CAL] * 2))
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, _, raw = request(stack.url, "POST", "/admin/reload", headers=auth)
        assert status == 200, raw
        assert json.loads(raw)["weights"] == [str(selected.resolve())]
        status, _, raw = request(stack.url, "POST", "/admin/reload", headers=auth,
                                 body={"weights": []})
        assert status == 200 and json.loads(raw)["weights"] == []
        assert stack.call(lambda: stack.app[STATE].loaded.config.reward.zeta2) \
            == 0.0
        status, _, raw = request(stack.url, "POST", "/admin/reload", headers=auth,
                                 body={"weights": str(selected)})
        assert status == 200, raw
        reward = stack.call(lambda: stack.app[STATE].loaded.config.reward)
        assert reward.zeta2 == profile["reward"]["zeta2"]
        bad = tmp_path / "bad.yaml"
        bad.write_text("reward: {zeta2: -3}\n")
        status, _, raw = request(stack.url, "POST", "/admin/reload", headers=auth,
                                 body={"weights": str(bad)})
        assert status == 400
        assert f"{bad}: reward.zeta2: must be >= 0" in json.loads(raw)["error"]["message"]
    finally:
        stack.close()


def test_tune_errors_name_the_grid_file(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg, grid = _files(tmp_path)
    grid.write_text("reward: {zeta2: [1, -2]}\n")
    assert main(["tune", "--config", str(cfg), "--grid", str(grid),
                 "--out", str(tmp_path / "o")]) == 2
    assert f"{grid}: reward.zeta2[1]: must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--config", str(cfg), "--grid", str(grid), "--out", "o",
              "--constraint", "p99 <= 1"])
