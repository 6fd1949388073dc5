"""Operator plots: prices recorded after every tick of a simulation (without changing the
run), prices polled from a live server, heatmaps, bottlenecks, and ``olproute plots``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.calibration import InstanceCalibration
from olproute.cli import main
from olproute.operator_plots import (
    PriceTrace,
    bottleneck_plot,
    price_heatmap,
    record_prices,
)
from olproute.sim.scenario import CalibrationSource, build_requests, simulate
from tests.conftest import CONV_TRACE, PROFILES, make_config

CAL = InstanceCalibration(beta=(3e-3, 1e-6, 1e-8, 1e-10), prefill_tokens_per_s=50_000,
                          tpot_s=0.004, mean_batch_seqs=8, service_rate_per_s=20)
SECTIONS: dict[str, Any] = {
    "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                   "max_num_seqs": 8, "kv_capacity_tokens": 30_000}],
    "workload": {"kind": "trace", "path": str(CONV_TRACE), "rate_per_s": 30.0,
                 "duration_s": 15},
    "router": {"policy": "bid_price", "horizon_slots": 200},
    "prices": {"window": 200, "minibatch": 64},
}


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5_000, path


def test_recorded_prices_follow_the_run_without_changing_it(tmp_path: Path) -> None:
    loaded = make_config(**SECTIONS)
    cal = CalibrationSource(loaded, known=[CAL, CAL])
    reqs = build_requests(loaded)
    res, trace = record_prices(loaded, "bid_price", reqs, cal)
    plain = simulate(loaded, "bid_price", reqs, calibration=cal)
    np.testing.assert_array_equal(res.first_token_s, plain.first_token_s)
    np.testing.assert_array_equal(res.instance, plain.instance)

    t, g, h, r = trace.prices.shape
    assert (g, h, r) == (2, 200, 2) and t == len(trace.time_s) > 10
    assert trace.names == ("q-0", "q-1") and trace.slot_s == pytest.approx(0.05)
    assert np.all(np.diff(trace.time_s) > 0)
    assert np.all(trace.prices >= 0) and trace.prices.max() > 0, "an overload must price"
    which = trace.bottlenecks()
    assert which.shape == (t, g) and set(np.unique(which)) <= {-1, 0, 1}
    assert (which >= 0).any()

    price_heatmap(trace, tmp_path / "prices.png", title="test")
    bottleneck_plot(trace, tmp_path / "bottleneck.png")
    _png(tmp_path / "prices.png")
    _png(tmp_path / "bottleneck.png")


def test_a_policy_without_prices_is_refused() -> None:
    loaded = make_config(**SECTIONS)
    with pytest.raises(ValueError, match="no shadow prices"):
        record_prices(loaded, "round_robin")


def _doc(batch: list[list[float]], kv: list[list[float]]) -> dict[str, Any]:
    return {"policy": "bid_price", "slot_s": 0.05, "horizon_slots": len(batch[0]),
            "instances": [{"name": f"i{g}", "batch": b, "kv": k, "bottleneck": "x"}
                          for g, (b, k) in enumerate(zip(batch, kv, strict=True))]}


def test_trace_from_polls_of_a_live_server(tmp_path: Path) -> None:
    polls = [(0.0, _doc([[0, 0], [1, 1]], [[0, 0], [0, 3]])),
             (1.0, _doc([[2, 0], [0, 0]], [[0, 1], [0, 0]]))]
    trace = PriceTrace.from_polls(polls)
    assert trace.names == ("i0", "i1") and trace.prices.shape == (2, 2, 2, 2)
    assert trace.totals()[0].tolist() == [[0, 0], [2, 3]]
    # i0 free at first, then batch-bound; i1 KV-bound, then free
    assert trace.bottlenecks().tolist() == [[-1, 1], [0, -1]]
    price_heatmap(trace, tmp_path / "live.png")
    _png(tmp_path / "live.png")
    with pytest.raises(ValueError, match="no prices"):
        PriceTrace.from_polls([(0.0, {"policy": "round_robin", "instances": []})])


def test_plots_command_writes_the_three_figures(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"profiles": str(PROFILES), **SECTIONS,
                                   "workload": {**SECTIONS["workload"], "duration_s": 8}}))
    out = tmp_path / "plots"
    assert main(["plots", "--config", str(cfg), "--policies", "round_robin,bid_price",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "bid_price" in printed
    for name in ("prices.png", "bottleneck.png", "cdf.png"):
        _png(out / name)


def test_prices_switched_off_are_refused_before_the_run() -> None:
    loaded = make_config(**{**SECTIONS, "prices": {"enabled": False}})
    with pytest.raises(ValueError, match=r"prices\.enabled is false"):
        record_prices(loaded, "bid_price")
