"""Re-solved duals as prices (solvers.resolve): the LP of the recent window moved to now,
its duals taken by the book, and a solve that fails or is slow leaving the prices be."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import solvers.resolve as resolve_mod
from olproute.estimate.calibration import InstanceCalibration
from olproute.pricing.book import PriceBook
from olproute.sim.scenario import CalibrationSource
from solvers.lp import solve
from solvers.record import Recording, build_window, record_bid_price
from solvers.resolve import (
    EMPTY,
    FAILED,
    OK,
    SLOW,
    Resolving,
    forward_problem,
    max_delay_slots,
    record_resolving,
    resolve_log,
)
from tests.conftest import CONV_TRACE, REPO, make_config

CAL = InstanceCalibration(beta=(0.008, 6e-5, 1e-7, 1e-10), prefill_tokens_per_s=15_000,
                          tpot_s=0.02, mean_batch_seqs=8)
PERIOD_S, WINDOW_S = 4.0, 2.0


def sections(**prices: object) -> dict[str, object]:
    return {
        "instances": [{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 2, "max_num_seqs": 6}],
        "workload": {"kind": "poisson", "rate_per_s": 8.0, "num_requests": 100,
                     "lengths_path": str(CONV_TRACE)},
        "router": {"policy": "bid_price", "policy_params": {"bid_price": {"backend": "numpy"}}},
        "prices": prices,
        "sim": {"seed": 3},
    }


def _plain() -> Recording:
    """The run without re-solves (the same requests and calibration)."""
    loaded, source = loaded_with()
    return record_bid_price(loaded, calibration=source)


def loaded_with(**prices: object):  # type: ignore[no-untyped-def]
    loaded = make_config(**sections(**prices))
    return loaded, CalibrationSource(loaded, known=[CAL, CAL])


@pytest.fixture(scope="module")
def resolved():  # type: ignore[no-untyped-def]
    loaded, source = loaded_with(resolve_period_s=PERIOD_S, resolve_window_s=WINDOW_S)
    return loaded, record_resolving(loaded, calibration=source)


def test_forward_problem_moves_the_window_to_the_tick(resolved) -> None:  # type: ignore[no-untyped-def]
    loaded, (rec, _) = resolved
    log = rec.log
    t_tick, free = log.free[len(log.free) // 2]
    t0, t1 = t_tick - WINDOW_S, t_tick
    delay = max_delay_slots(loaded.config.prices)
    here, ids = build_window(log, t0, t1, max_delay=delay, tail_slots=delay)
    moved = forward_problem(log, t0, t1, t_tick, free, delay)
    assert moved.t0_s == t_tick
    assert moved.num_requests == here.num_requests == len(ids)
    # the same requests, at the same offsets from the window's start
    np.testing.assert_allclose(moved.arrival_s - moved.t0_s, here.arrival_s - here.t0_s)
    np.testing.assert_array_equal(moved.utility, here.utility)
    assert moved.max_delay == delay
    # on the tick's free capacity (1 past its horizon), not the window start's
    m = min(free.shape[1], moved.num_slots)
    np.testing.assert_array_equal(moved.free[:, :m], free[:, :m])
    assert np.all(moved.free[:, m:] == 1.0)


def test_resolves_start_after_one_window_and_follow_the_period(resolved) -> None:  # type: ignore[no-untyped-def]
    _, (rec, resolutions) = resolved
    first = float(np.nanmin(rec.log.first_seen_s))
    times = [t for t, _ in resolutions]
    assert len(times) >= 2
    tick_s = rec.log.free[1][0] - rec.log.free[0][0]
    # the first at the first tick once a window has passed since the first decision
    assert first + WINDOW_S <= times[0] < first + WINDOW_S + tick_s + 1e-9
    gaps = np.diff(times)
    assert np.all(gaps >= PERIOD_S - 1e-9) and np.all(gaps < PERIOD_S + tick_s + 1e-9)
    assert all(r.outcome in (OK, EMPTY) for _, r in resolutions)
    assert any(r.outcome == OK for _, r in resolutions)


def test_a_resolve_hands_the_lp_duals_to_the_book(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[tuple[float, np.ndarray, np.ndarray, float]] = []
    original = PriceBook.warm_start

    def spy(book: PriceBook, t0_s: float, p_abs: np.ndarray,
            now_s: float | None = None) -> None:
        original(book, t0_s, p_abs, now_s)
        taken.append((t0_s, p_abs, book.p.copy(), book.origin_s or 0.0))

    monkeypatch.setattr(PriceBook, "warm_start", spy)
    loaded, source = loaded_with(resolve_period_s=PERIOD_S, resolve_window_s=WINDOW_S)
    rec, resolutions = record_resolving(loaded, calibration=source)
    ok = [(t, r) for t, r in resolutions if r.outcome == OK]
    assert len(taken) == len(ok) >= 1
    slot = loaded.config.router.slot_ms / 1e3
    for (t, res), (t0, p_abs, book_p, origin) in zip(ok, taken, strict=True):
        assert res.p is not None and t0 == res.t0_s == t and res.requests > 0
        assert p_abs is res.p
        # the book's prices are the duals from its slot 0 (at the tick) on
        first = round((origin - t0) / slot)
        assert first >= 0
        m = min(book_p.shape[1], res.p.shape[1] - first)
        np.testing.assert_array_equal(book_p[:, :m], res.p[:, first:first + m])
        assert np.all(book_p[:, m:] == 0.0)
    # the same LP solved again has the value the re-solve reported
    t, res = ok[0]
    free = dict(rec.log.free)[t]
    prob = forward_problem(rec.log, t - WINDOW_S, t, t, free,
                           max_delay_slots(loaded.config.prices))
    assert solve(prob, threads=1).objective == pytest.approx(res.lp_value, rel=1e-6)


def test_resolving_changes_the_run_only_through_the_prices() -> None:
    loaded, source = loaded_with(resolve_period_s=PERIOD_S, resolve_window_s=WINDOW_S)
    plain = _plain()
    again, resolutions = record_resolving(loaded, calibration=source)
    assert any(r.outcome == OK for _, r in resolutions)
    # same requests and first decisions up to the first re-solve
    first = resolutions[0][0]
    before = plain.log.first_seen_s < first
    np.testing.assert_array_equal(plain.log.first_seen_s[before], again.log.first_seen_s[before])
    np.testing.assert_array_equal(plain.log.utility[before], again.log.utility[before])
    # and the prices differ from the first re-solve that handed some over
    t_ok = next(t for t, r in resolutions if r.outcome == OK)
    after = [(a, b) for a, b in zip(plain.log.updates, again.log.updates, strict=False)
             if a.time_s > t_ok]
    assert after and any(not np.array_equal(a.p, b.p) for a, b in after)


@pytest.mark.parametrize("how", ["raises", "slow"])
def test_a_failed_or_slow_solve_keeps_the_last_prices(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded, source = loaded_with(resolve_period_s=PERIOD_S, resolve_window_s=WINDOW_S)
    plain = _plain()

    class Slow:
        status, objective = "Time limit reached", math.nan
        p = np.zeros(0)

    def broken(*args: object, **kwargs: object) -> object:
        if how == "raises":
            raise RuntimeError("the solver fell over")
        return Slow()

    monkeypatch.setattr(resolve_mod, "solve", broken)
    rec, resolutions = record_resolving(loaded, calibration=source)
    outcomes = {r.outcome for _, r in resolutions} - {EMPTY}
    assert outcomes == ({FAILED} if how == "raises" else {SLOW})
    assert all(r.p is None and r.error for _, r in resolutions)
    # no prices handed over: the run is the run without re-solves
    np.testing.assert_array_equal(plain.log.first_seen_s, rec.log.first_seen_s)
    np.testing.assert_array_equal(plain.result.instance, rec.result.instance)
    for a, b in zip(plain.log.updates, rec.log.updates, strict=True):
        np.testing.assert_array_equal(a.p, b.p)


def test_nothing_to_resolve_without_a_period() -> None:
    loaded, source = loaded_with()
    with pytest.raises(ValueError, match="resolve_period_s"):
        record_resolving(loaded, calibration=source)


def test_an_empty_window_is_empty() -> None:
    loaded, source = loaded_with()
    log = record_bid_price(loaded, calibration=source).log
    t_end = float(np.nanmax(log.arrival_s)) + 100.0
    res = resolve_log(log, t_end, t_end + 1.0, t_end, log.free[-1][1], 2, 5.0)
    assert res.outcome == EMPTY and res.p is None and res.requests == 0


def _config_file(tmp_path: Path, **prices: object) -> Path:
    import yaml

    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump({"calibration": {"llama-0": CAL.as_dict(),
                                                   "llama-1": CAL.as_dict()}}))
    data = sections(**prices)
    data["workload"] = {**data["workload"], "num_requests": 60}  # type: ignore[dict-item]
    data["profiles"] = str(REPO / "configs" / "profiles.yaml")
    data["calibration"] = str(cal)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_olproute_simulate_runs_a_configs_resolves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from olproute.cli.main import main

    made: list[Resolving] = []
    original = Resolving.__post_init__

    def seen(self: Resolving) -> None:
        original(self)
        made.append(self)

    monkeypatch.setattr(Resolving, "__post_init__", seen)
    cfg = _config_file(tmp_path, resolve_period_s=PERIOD_S, resolve_window_s=WINDOW_S)
    assert main(["simulate", "--config", str(cfg), "--no-progress"]) == 0
    assert "bid_price" in capsys.readouterr().out
    assert len(made) == 1 and any(r.outcome == OK for _, r in made[0].resolutions)


def test_resolves_are_never_dropped_silently(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from olproute.cli.main import main
    from olproute.config.loader import ConfigError
    from olproute.sim.scenario import simulate

    loaded, source = loaded_with(resolve_period_s=PERIOD_S)
    with pytest.raises(ConfigError, match=r"prices\.resolve_period_s: re-solves need"):
        simulate(loaded, calibration=source)
    with pytest.raises(ValueError, match=r"record with solvers\.resolve\.record_resolving"):
        record_bid_price(loaded, calibration=source)
    # another policy has no prices to re-solve: it runs as it is
    assert (simulate(loaded, "round_robin", calibration=source).instance >= 0).all()
    cfg = _config_file(tmp_path, resolve_period_s=PERIOD_S)
    assert main(["lp-check", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "prices.resolve_period_s: lp-check records bid_price without re-solves" in err
