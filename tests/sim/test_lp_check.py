"""lp-check end to end on a small congested run: the recorder leaves bid_price's run
unchanged, the LP bounds what the online prices certify, and the command prints and
draws what it promises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from olproute.cli.main import main
from olproute.estimate.calibration import InstanceCalibration
from olproute.sim.scenario import CalibrationSource, simulate
from solvers.certificate import dual_value
from solvers.check import check, format_check, plot_prices
from solvers.record import build_window, record_bid_price
from tests.conftest import CONV_TRACE, make_config

CAL = InstanceCalibration(beta=(0.008, 6e-5, 1e-7, 1e-10), prefill_tokens_per_s=15_000,
                          tpot_s=0.02, mean_batch_seqs=8)
SECTIONS = {
    "instances": [{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                   "replicas": 2, "max_num_seqs": 6}],
    "workload": {"kind": "poisson", "rate_per_s": 8.0, "num_requests": 120,
                 "lengths_path": str(CONV_TRACE)},
    "router": {"policy": "bid_price", "policy_params": {"bid_price": {"backend": "numpy"}}},
    "sim": {"seed": 3},
}


@pytest.fixture(scope="module")
def recorded():  # type: ignore[no-untyped-def]
    loaded = make_config(**SECTIONS)
    source = CalibrationSource(loaded, known=[CAL, CAL])
    return loaded, source, record_bid_price(loaded, calibration=source)


def test_recording_does_not_change_the_run(recorded) -> None:  # type: ignore[no-untyped-def]
    loaded, source, rec = recorded
    plain = simulate(loaded, "bid_price", calibration=source)
    np.testing.assert_array_equal(plain.instance, rec.result.instance)
    np.testing.assert_array_equal(plain.first_token_s, rec.result.first_token_s)
    log = rec.log
    assert log.updates and log.free
    for a in (log.tpot_s, log.ttft_hat_s, log.decode_tokens, log.utility, log.exec_ttft_s):
        assert np.isfinite(a).all()
    np.testing.assert_array_equal(log.instance, rec.result.instance)
    assert log.compute_cap.shape == (2,) and (log.compute_cap > 0).all()


def test_check_bounds_and_counts(recorded, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, rec = recorded
    prob, ids = build_window(rec.log, max_delay=20)
    assert prob.num_requests == len(rec.result.requests)
    res, sol, p_online = check(rec.log, ids, prob)
    assert res.lp_status == "Optimal"
    assert res.lp_binding > 0, "the run must congest the LP, or nothing is checked"
    assert res.rows == prob.num_instances * prob.num_slots * 3
    assert sum(res.binding_by_resource.values()) == res.lp_binding
    assert p_online.shape == sol.p.shape == prob.free.shape
    assert res.d_online >= res.lp_value * (1 - 1e-7)          # weak duality
    assert res.certificate >= -1e-7
    assert dual_value(prob, sol.p) == pytest.approx(res.lp_value, rel=1e-6)
    assert res.online_reward > 0 and res.online_served == int(np.sum(rec.result.instance >= 0))
    assert res.gap_d >= res.gap_lp - 1e-9                        # D(p_online) >= LP*
    assert "certificate D(p_online)/LP* - 1" in format_check(res)
    png = tmp_path / "p.png"
    plot_prices(prob, sol.p, p_online, png)
    assert png.stat().st_size > 0


def test_window_keeps_its_requests_and_initial_occupancy(recorded) -> None:  # type: ignore[no-untyped-def]
    _, _, rec = recorded
    mid_arrival = rec.result.requests[len(rec.result.requests) // 2].arrival_s
    t_mid = max(t for t, _ in rec.log.free if t <= mid_arrival)
    prob, ids = build_window(rec.log, t0_s=t_mid, t1_s=t_mid + 3.0, max_delay=10)
    arrival = np.array([rec.result.requests[i].arrival_s for i in ids])
    assert ((arrival >= t_mid) & (arrival < t_mid + 3.0)).all()
    assert prob.max_delay == 10 and prob.num_slots == 60 + 10
    # mid-run the instances hold residents: less than all of their capacity is free
    assert prob.free[:, 0].min() < 1.0


def test_lp_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump({"calibration": {"llama-0": CAL.as_dict(),
                                                   "llama-1": CAL.as_dict()}}))
    cfg = tmp_path / "run.yaml"
    data = {**SECTIONS, "profiles": str(Path(__file__).resolve().parents[2] / "configs"
                                        / "profiles.yaml"), "calibration": str(cal)}
    data["workload"] = {**SECTIONS["workload"], "num_requests": 60}  # type: ignore[dict-item]
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    code = main(["lp-check", "--config", str(cfg), "--out", str(out), "--no-progress",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    text = capsys.readouterr().out
    for label in ("LP*", "online reward", "D(p_online)", "online gap (LP* - online)/LP*",
                  "binding in the LP", "compute", "priced online"):
        assert label in text
    assert (out / "lp_check.png").stat().st_size > 0
    assert (tmp_path / "r.json").exists()


def test_check_without_price_updates(recorded) -> None:  # type: ignore[no-untyped-def]
    """Prices disabled (no tick ever learned): the online prices were 0, D(0) >= LP*."""
    import dataclasses

    _, _, rec = recorded
    bare = dataclasses.replace(rec.log, updates=())
    prob, ids = build_window(bare, max_delay=5)
    res, _, p_online = check(bare, ids, prob)
    assert not p_online.any()
    assert res.d_online >= res.lp_value * (1 - 1e-7)


def test_a_replayed_schedule_steers_the_run(recorded) -> None:  # type: ignore[no-untyped-def]
    """Oracle prices through ``record_bid_price(schedule=...)``: a prohibitive compute
    price on instance 0 keeps every request dispatched after the first price update off
    it (before it the book's prices are 0) unless it was held to the end of its patience
    with no room on instance 1 (then it goes where an engine has room: the prices never
    refuse what the engines can take), and the book's prices are the schedule's (nothing
    learned); zero prices route to both."""
    loaded, source, rec = recorded
    t0 = float(rec.log.updates[0].origin_s)
    k = 4000
    sched = np.zeros((2, k, 3))
    sched[0, :, 2] = 1e6
    steered = record_bid_price(loaded, calibration=source, schedule=(t0, sched))
    res = steered.result
    late = np.isfinite(res.finish_s) & (res.dispatch_s > steered.log.updates[0].time_s)
    assert late.sum() > 10
    on_0 = late & (res.instance == 0)
    assert (late & (res.instance == 1)).sum() > on_0.sum()
    waited = res.dispatch_s - np.array([r.arrival_s for r in res.requests])
    patience = np.array([min(r.ttft_target_s, loaded.config.admission.max_patience_s)
                         for r in res.requests])
    assert np.all(waited[on_0] >= patience[on_0] - 1e-9)   # only once out of patience
    assert all(float(u.p[0, :, 2].min()) == 1e6 for u in steered.log.updates[1:])
    free = record_bid_price(loaded, calibration=source, schedule=(t0, np.zeros((2, k, 3))))
    assert set(free.result.instance[np.isfinite(free.result.finish_s)].tolist()) == {0, 1}


def test_compare_reports_the_patience_matched_arm() -> None:
    """solvers.compare's rows carry the online run with the LP's maximum delay as
    patience, as shares of both LPs, beside the default run."""
    from solvers.compare import as_json, run, table

    rows = run(["batch"], [4], 80)
    doc = as_json(rows)["rows"][0]
    assert doc["matched_patience_s"] == doc["lp_max_delay_s"] > 0
    assert doc["online_matched"] > 0
    assert doc["online_matched_over_realised_lp"] == pytest.approx(
        doc["online_matched"] / doc["lp_realised"])
    assert doc["online_matched_over_lp"] == pytest.approx(
        doc["online_matched"] / doc["lp_value"])
    assert "match/real" in table(rows)
