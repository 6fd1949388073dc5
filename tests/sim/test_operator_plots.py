"""Operator plots: prices recorded after every tick of a simulation (without changing the
run), prices polled from a live server, heatmaps, bottlenecks, and ``olproute plots``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.cli.main import main
from olproute.estimate.calibration import InstanceCalibration
from olproute.operator.plots import (
    COLOURS,
    PriceTrace,
    bottleneck_plot,
    price_heatmap,
    record_prices,
)
from olproute.pricing.reward import COMPUTE, RESOURCES
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
    assert (g, h, r) == (2, 200, len(RESOURCES)) and t == len(trace.time_s) > 10
    assert trace.names == ("q-0", "q-1") and trace.slot_s == pytest.approx(0.05)
    assert np.all(np.diff(trace.time_s) > 0)
    assert np.all(trace.prices >= 0) and trace.prices.max() > 0, "an overload must price"
    which = trace.bottlenecks()
    assert which.shape == (t, g) and set(np.unique(which)) <= {-1, *range(len(RESOURCES))}
    assert (which >= 0).any()

    price_heatmap(trace, tmp_path / "prices.png", title="test")
    bottleneck_plot(trace, tmp_path / "bottleneck.png")
    _png(tmp_path / "prices.png")
    _png(tmp_path / "bottleneck.png")


def test_a_policy_without_prices_is_refused() -> None:
    loaded = make_config(**SECTIONS)
    with pytest.raises(ValueError, match="no shadow prices"):
        record_prices(loaded, "round_robin")


def test_a_small_prefill_budget_makes_compute_the_bottleneck(tmp_path: Path) -> None:
    """Long prompts at a high rate on a 256-token step budget (batch slots and KV to
    spare): the compute row prices and is some instance's bottleneck."""
    inst = {**SECTIONS["instances"][0], "max_num_seqs": 64, "kv_capacity_tokens": 400_000,
            "max_num_batched_tokens": 256}
    loaded = make_config(**{**SECTIONS, "instances": [inst],
                            "workload": {"kind": "poisson", "rate_per_s": 40.0,
                                         "prompt_tokens": 3000, "decode_tokens": 4,
                                         "duration_s": 6}})
    _, trace = record_prices(loaded, "bid_price",
                             calibration=CalibrationSource(loaded, known=[CAL, CAL]))
    assert trace.totals()[..., COMPUTE].max() > 0
    assert (trace.bottlenecks() == COMPUTE).any()
    bottleneck_plot(trace, tmp_path / "bottleneck.png")
    _png(tmp_path / "bottleneck.png")


def test_every_resource_has_a_colour() -> None:
    assert set(COLOURS) == set(RESOURCES)


def _doc(*rows: list[list[float]]) -> dict[str, Any]:
    """A GET /prices document: one (G, H) list per resource, in the order of RESOURCES
    (fewer rows: an older router's document, without the last resources)."""
    return {"policy": "bid_price", "slot_s": 0.05, "horizon_slots": len(rows[0][0]),
            "instances": [{"name": f"i{g}", "bottleneck": "x",
                           **{r: row[g] for r, row in zip(RESOURCES, rows, strict=False)}}
                          for g in range(len(rows[0]))]}


def test_trace_from_polls_of_a_live_server(tmp_path: Path) -> None:
    polls = [(0.0, _doc([[0, 0], [1, 1]], [[0, 0], [0, 3]], [[0, 0], [0, 4]])),
             (1.0, _doc([[2, 0], [0, 0]], [[0, 1], [0, 0]], [[0, 0], [0, 0]]))]
    trace = PriceTrace.from_polls(polls)
    assert trace.names == ("i0", "i1") and trace.prices.shape == (2, 2, 2, len(RESOURCES))
    assert trace.totals()[0].tolist() == [[0, 0, 0], [2, 3, 4]]
    # i0 free at first, then batch-bound; i1 compute-bound, then free
    assert trace.bottlenecks().tolist() == [[-1, COMPUTE], [0, -1]]
    price_heatmap(trace, tmp_path / "live.png")
    _png(tmp_path / "live.png")
    # a router from before compute: its prices read as batch and KV, compute 0
    old = PriceTrace.from_polls([(0.0, _doc([[0, 0], [1, 1]], [[0, 0], [0, 3]]))])
    assert old.totals()[0].tolist() == [[0, 0, 0], [2, 3, 0]]
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
