"""Tests for olproute.sim.workloads: arrival processes, trace readers and request targets."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.sim.workloads import (
    LOOSE,
    TIGHT,
    Mmpp2Arrivals,
    SloClass,
    Trace,
    WorkloadError,
    assign_slo_classes,
    bear_ttft_targets_s,
    build_requests,
    lengths_with_arrivals,
    mmpp2_arrivals,
    mmpp2_rates,
    poisson_arrivals,
    predicted_decode_tokens,
    read_lengths_csv,
    read_trace_csv,
    trace_time_scale_for_rate,
)
from olproute.types import Request

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACES = REPO_ROOT / "data" / "traces"
CONV = TRACES / "splitwise_conv.csv"
CODE = TRACES / "splitwise_code.csv"
ARXIV = TRACES / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"

HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=60)


def _dispersion(arrival_s: np.ndarray, bin_s: float) -> float:
    """Variance-to-mean ratio of arrival counts in complete bins of ``bin_s`` seconds."""
    num_bins = int(arrival_s[-1] // bin_s)
    counts = np.bincount((arrival_s // bin_s).astype(np.int64), minlength=num_bins + 1)
    counts = counts[:num_bins]
    return float(counts.var() / counts.mean())


def _small_trace() -> Trace:
    return Trace(
        np.array([0.0, 1.0, 2.0, 3.0, 4.0]),
        np.array([10, 11, 12, 13, 14], dtype=np.int64),
        np.array([1, 2, 3, 4, 5], dtype=np.int64),
    )


# ---------------------------------------------------------------------------- MMPP-2 rates


@pytest.mark.parametrize(
    ("mean", "ratio", "low", "high"),
    [
        (6, 3, 4.29, 12.86),
        (7, 3, 5.00, 15.00),
        (8, 3, 5.71, 17.14),
        (6, 6, 3.00, 18.00),
        (7, 6, 3.50, 21.00),
        (8, 6, 4.00, 24.00),
    ],
)
def test_mmpp2_rates_reproduce_bear_table_3(
    mean: float, ratio: float, low: float, high: float
) -> None:
    got_low, got_high = mmpp2_rates(mean, ratio)
    assert round(got_low, 2) == low
    assert round(got_high, 2) == high


@DETERMINISTIC
@given(
    mean=st.floats(0.01, 1000.0),
    ratio=st.floats(1.0, 50.0),
    high_fraction=st.floats(0.0, 1.0),
)
def test_mmpp2_rates_preserve_the_time_averaged_rate(
    mean: float, ratio: float, high_fraction: float
) -> None:
    low, high = mmpp2_rates(mean, ratio, high_fraction)
    assert high == pytest.approx(ratio * low)
    assert (1 - high_fraction) * low + high_fraction * high == pytest.approx(mean)


@pytest.mark.parametrize(
    ("mean", "ratio", "high_fraction"),
    [(0.0, 3.0, 0.2), (6.0, 0.5, 0.2), (6.0, 3.0, -0.1), (6.0, 3.0, 1.5), (math.inf, 3, 0.2)],
)
def test_mmpp2_rates_reject_bad_parameters(mean: float, ratio: float, high_fraction: float) -> None:
    with pytest.raises(ValueError):
        mmpp2_rates(mean, ratio, high_fraction)


# ------------------------------------------------------------------------ MMPP-2 arrivals


@pytest.fixture(scope="module")
def long_mmpp() -> Mmpp2Arrivals:
    return mmpp2_arrivals(6.0, 3.0, 200_000, np.random.default_rng(20240601))


def test_mmpp2_long_run_rate_and_high_fraction(long_mmpp: Mmpp2Arrivals) -> None:
    arrivals = long_mmpp.arrival_s
    assert len(arrivals) == 200_000
    assert abs(len(arrivals) / arrivals[-1] - 6.0) / 6.0 < 0.03
    assert abs(long_mmpp.time_in_high_fraction() - 0.2) < 0.03


def test_mmpp2_is_bursty_but_poisson_is_not(long_mmpp: Mmpp2Arrivals) -> None:
    assert _dispersion(long_mmpp.arrival_s, 10.0) > 2.0
    poisson = poisson_arrivals(6.0, 200_000, np.random.default_rng(7))
    assert 0.85 <= _dispersion(poisson, 10.0) <= 1.15


def test_mmpp2_arrivals_follow_the_hidden_state(long_mmpp: Mmpp2Arrivals) -> None:
    # Count the arrivals that fall in high-state periods and divide by the time spent there:
    # this must match alpha_H, and the rest must match alpha_L.
    low_rate, high_rate = mmpp2_rates(6.0, 3.0)
    bounds = np.concatenate(([0.0], long_mmpp.state_change_s, [long_mmpp.horizon_s]))
    period = np.searchsorted(bounds, long_mmpp.arrival_s, side="right") - 1
    state = (long_mmpp.first_state + period) % 2
    durations = np.diff(bounds)
    period_state = (long_mmpp.first_state + np.arange(len(durations))) % 2
    high_time = durations[period_state == 1].sum()
    low_time = durations[period_state == 0].sum()
    assert np.count_nonzero(state == 1) / high_time == pytest.approx(high_rate, rel=0.03)
    assert np.count_nonzero(state == 0) / low_time == pytest.approx(low_rate, rel=0.03)


def test_mmpp2_path_is_well_formed(long_mmpp: Mmpp2Arrivals) -> None:
    assert long_mmpp.arrival_s.dtype == np.float64
    assert long_mmpp.arrival_s[0] >= 0.0
    assert np.all(np.diff(long_mmpp.arrival_s) >= 0.0)
    assert np.all(np.diff(long_mmpp.state_change_s) > 0.0)
    assert long_mmpp.state_change_s[-1] < long_mmpp.horizon_s
    assert long_mmpp.horizon_s >= long_mmpp.arrival_s[-1]
    # The last sojourn holds the last arrival.
    assert long_mmpp.arrival_s[-1] >= long_mmpp.state_change_s[-1]


def test_mmpp2_is_deterministic_per_seed() -> None:
    first = mmpp2_arrivals(7.0, 6.0, 5_000, np.random.default_rng(3))
    second = mmpp2_arrivals(7.0, 6.0, 5_000, np.random.default_rng(3))
    other = mmpp2_arrivals(7.0, 6.0, 5_000, np.random.default_rng(4))
    np.testing.assert_array_equal(first.arrival_s, second.arrival_s)
    np.testing.assert_array_equal(first.state_change_s, second.state_change_s)
    assert first.first_state == second.first_state
    assert first.horizon_s == second.horizon_s
    assert not np.array_equal(first.arrival_s, other.arrival_s)


@DETERMINISTIC
@given(num_requests=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_mmpp2_returns_exactly_the_requested_count(num_requests: int, seed: int) -> None:
    result = mmpp2_arrivals(0.5, 6.0, num_requests, np.random.default_rng(seed))
    assert len(result.arrival_s) == num_requests
    assert np.all(np.diff(result.arrival_s) >= 0.0)
    assert result.horizon_s >= (result.arrival_s[-1] if num_requests else 0.0)
    assert 0.0 <= result.time_in_high_fraction() <= 1.0


def test_mmpp2_rejects_high_fraction_that_disagrees_with_switch_rates() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="high_fraction"):
        mmpp2_arrivals(6.0, 3.0, 10, rng, high_fraction=0.3)
    # Consistent non-default switching is accepted: 0.2 / (0.2 + 0.2) = 0.5.
    result = mmpp2_arrivals(
        6.0,
        3.0,
        10,
        rng,
        high_fraction=0.5,
        switch_low_to_high_per_s=0.2,
        switch_high_to_low_per_s=0.2,
    )
    assert len(result.arrival_s) == 10


def test_time_in_high_fraction_of_a_hand_built_path() -> None:
    # low on [0, 2), high on [2, 5), low on [5, 10]: 3 of 10 seconds high.
    path = Mmpp2Arrivals(np.array([1.0, 3.0]), np.array([2.0, 5.0]), 0, 10.0)
    assert path.time_in_high_fraction() == pytest.approx(0.3)
    starts_high = Mmpp2Arrivals(np.array([1.0]), np.array([2.0, 5.0]), 1, 10.0)
    assert starts_high.time_in_high_fraction() == pytest.approx(0.7)
    assert Mmpp2Arrivals(np.empty(0), np.empty(0), 1, 0.0).time_in_high_fraction() == 1.0


# ----------------------------------------------------------------------- Poisson arrivals


def test_poisson_mean_rate() -> None:
    arrivals = poisson_arrivals(8.0, 200_000, np.random.default_rng(11))
    assert arrivals.dtype == np.float64
    assert abs(len(arrivals) / arrivals[-1] - 8.0) / 8.0 < 0.02


@DETERMINISTIC
@given(rate=st.floats(0.01, 100.0), n=st.integers(0, 500), seed=st.integers(0, 2**32 - 1))
def test_poisson_arrivals_are_sorted_and_start_after_zero(rate: float, n: int, seed: int) -> None:
    arrivals = poisson_arrivals(rate, n, np.random.default_rng(seed))
    assert len(arrivals) == n
    assert np.all(np.diff(arrivals) >= 0.0)
    if n:
        assert arrivals[0] > 0.0


def test_poisson_arrivals_reject_bad_rate() -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 5, np.random.default_rng(0))
    with pytest.raises(ValueError):
        poisson_arrivals(1.0, -1, np.random.default_rng(0))


# ----------------------------------------------------------------------------- real traces


def _csv_totals(path: Path, columns: tuple[str, ...]) -> tuple[int, ...]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return (len(rows), *(sum(int(float(row[c])) for row in rows) for c in columns))


def test_read_trace_csv_keeps_every_row_of_splitwise_conv() -> None:
    trace = read_trace_csv(CONV)
    rows, prompt_total, decode_total = _csv_totals(
        CONV, ("num_prefill_tokens", "num_decode_tokens")
    )
    assert len(trace) == rows == 19_366
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0.0)
    assert trace.arrival_s.dtype == np.float64
    assert trace.prompt_tokens.dtype == np.int64
    assert int(trace.prompt_tokens.sum()) == prompt_total
    assert int(trace.decode_tokens.sum()) == decode_total


def test_read_trace_csv_splitwise_code_row_count() -> None:
    assert len(read_trace_csv(CODE)) == 8_819


def test_read_trace_csv_time_scale_multiplies_the_span() -> None:
    base = read_trace_csv(CODE)
    stretched = read_trace_csv(CODE, time_scale=2.5)
    np.testing.assert_allclose(stretched.arrival_s, 2.5 * base.arrival_s, rtol=1e-12)
    np.testing.assert_array_equal(stretched.prompt_tokens, base.prompt_tokens)
    with pytest.raises(ValueError):
        read_trace_csv(CODE, time_scale=0.0)
    with pytest.raises(ValueError):
        read_trace_csv(CODE, time_scale=-1.0)


def test_trace_time_scale_for_rate_hits_the_target() -> None:
    base = read_trace_csv(CONV)
    scale = trace_time_scale_for_rate(base, 10.0)
    scaled = read_trace_csv(CONV, time_scale=scale)
    assert (len(scaled) - 1) / scaled.arrival_s[-1] == pytest.approx(10.0, rel=1e-9)
    assert trace_time_scale_for_rate(_small_trace(), 0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        trace_time_scale_for_rate(_small_trace().head(1), 1.0)


def test_read_lengths_csv_arxiv() -> None:
    prompt, decode = read_lengths_csv(ARXIV)
    rows, prompt_total, decode_total = _csv_totals(
        ARXIV, ("num_prefill_tokens", "num_decode_tokens")
    )
    assert len(prompt) == len(decode) == rows == 28_257
    assert prompt.dtype == decode.dtype == np.int64
    assert int(prompt.sum()) == prompt_total
    assert int(decode.sum()) == decode_total


# -------------------------------------------------------------------------- parsing rules


def test_read_trace_csv_accepts_float_counts_any_column_order_and_extra_columns(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ok.csv"
    path.write_text(
        "num_decode_tokens,extra,arrived_at,num_prefill_tokens\n"
        "44.0,x,100.5,374\n"
        "7,y,100.5,396.0\n"
        "\n"
        "1,z,103.0,2\n"
    )
    trace = read_trace_csv(path)
    np.testing.assert_array_equal(trace.arrival_s, [0.0, 0.0, 2.5])
    np.testing.assert_array_equal(trace.prompt_tokens, [374, 396, 2])
    np.testing.assert_array_equal(trace.decode_tokens, [44, 7, 1])


@pytest.mark.parametrize(
    ("body", "line", "fragment"),
    [
        ("0.0,10,5\n1.0,10,abc\n", 3, "num_decode_tokens"),
        ("0.0,10,5\n1.0,12.5,4\n", 3, "num_prefill_tokens"),
        ("0.0,10,5\n1.0,10,5\n0.5,10,5\n", 4, "arrived_at"),
        ("0.0,10,5\n1.0,10,0\n", 3, "num_decode_tokens"),
        ("0.0,0,5\n", 2, "num_prefill_tokens"),
        ("0.0,10,5\nnan,10,5\n", 3, "arrived_at"),
        ("0.0,10,5\n1.0,10\n", 3, "fields"),
    ],
)
def test_read_trace_csv_names_file_and_line_of_bad_rows(
    tmp_path: Path, body: str, line: int, fragment: str
) -> None:
    path = tmp_path / "bad_trace.csv"
    path.write_text(HEADER + body)
    with pytest.raises(WorkloadError) as info:
        read_trace_csv(path)
    message = str(info.value)
    assert str(path) in message
    assert f"line {line}:" in message
    assert fragment in message


def test_read_trace_csv_names_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "no_decode.csv"
    path.write_text("arrived_at,num_prefill_tokens\n0.0,10\n")
    with pytest.raises(WorkloadError) as info:
        read_trace_csv(path)
    assert str(path) in str(info.value)
    assert "num_decode_tokens" in str(info.value)


def test_read_lengths_csv_validates_like_read_trace_csv(tmp_path: Path) -> None:
    path = tmp_path / "lengths.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,pd_ratio\n5,1,5.0\n6,0,inf\n")
    with pytest.raises(WorkloadError) as info:
        read_lengths_csv(path)
    assert str(path) in str(info.value)
    assert "line 3:" in str(info.value)
    missing = tmp_path / "no_prefill.csv"
    missing.write_text("num_decode_tokens\n3\n")
    with pytest.raises(WorkloadError, match="num_prefill_tokens"):
        read_lengths_csv(missing)


def test_read_trace_csv_rejects_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(WorkloadError, match="line 1"):
        read_trace_csv(path)


# ------------------------------------------------------------------------ Trace behaviour


def test_trace_head_and_window() -> None:
    trace = _small_trace()
    head = trace.head(2)
    np.testing.assert_array_equal(head.arrival_s, [0.0, 1.0])
    np.testing.assert_array_equal(head.prompt_tokens, [10, 11])
    assert len(trace.head(100)) == 5
    assert len(trace.head(0)) == 0
    window = trace.window(1.0, 3.0)
    np.testing.assert_array_equal(window.arrival_s, [0.0, 1.0])
    np.testing.assert_array_equal(window.decode_tokens, [2, 3])
    offset = trace.window(1.5, 3.5)
    np.testing.assert_array_equal(offset.arrival_s, [0.5, 1.5])
    np.testing.assert_array_equal(offset.prompt_tokens, [12, 13])
    with pytest.raises(ValueError):
        trace.head(-1)
    with pytest.raises(ValueError):
        trace.window(3.0, 1.0)


def test_a_trace_workload_window_may_run_to_the_end() -> None:
    """``start_s`` without ``duration_s``: from start_s to the last row."""
    trace = _small_trace()
    np.testing.assert_array_equal(trace.window(2.5, math.inf).prompt_tokens, [13, 14])
    with pytest.raises(ValueError):
        trace.window(math.inf, math.inf)
    from olproute.sim.requests import build_trace
    from tests.conftest import make_config

    loaded = make_config(workload={"kind": "trace", "path": str(CONV), "start_s": 3500.0})
    full = read_trace_csv(CONV)
    assert len(build_trace(loaded, np.random.default_rng(0))) == int(
        (full.arrival_s >= 3500.0).sum())


@DETERMINISTIC
@given(
    gaps=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40),
    start=st.floats(0.0, 200.0),
    length=st.floats(0.0, 200.0),
)
def test_trace_window_selects_half_open_interval(
    gaps: list[float], start: float, length: float
) -> None:
    arrivals = np.cumsum(gaps)
    n = len(arrivals)
    trace = Trace(arrivals, np.arange(1, n + 1, dtype=np.int64), np.ones(n, dtype=np.int64))
    end = start + length
    window = trace.window(start, end)
    mask = (arrivals >= start) & (arrivals < end)
    np.testing.assert_array_equal(window.prompt_tokens, trace.prompt_tokens[mask])
    np.testing.assert_allclose(window.arrival_s, arrivals[mask] - start)
    assert np.all(window.arrival_s >= 0.0)


def test_trace_validates_and_is_immutable() -> None:
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError):
        Trace(np.array([1.0, 0.5]), ones, ones)
    with pytest.raises(ValueError):
        Trace(np.array([-1.0, 0.5]), ones, ones)
    with pytest.raises(ValueError):
        Trace(np.array([0.0, 1.0]), ones, np.array([1, 0], dtype=np.int64))
    with pytest.raises(ValueError):
        Trace(np.array([0.0, 1.0]), ones, np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError):
        Trace(np.array([0.0, 1.0]), np.array([1.5, 2.0]), ones)
    source = np.array([0.0, 1.0])
    trace = Trace(source, ones, ones)
    source[0] = 5.0
    assert trace.arrival_s[0] == 0.0
    with pytest.raises(ValueError):
        trace.arrival_s[0] = 1.0


def test_lengths_with_arrivals_cycles_and_truncates() -> None:
    prompt = np.array([10, 20, 30], dtype=np.int64)
    decode = np.array([1, 2, 3], dtype=np.int64)
    longer = lengths_with_arrivals(prompt, decode, np.arange(7, dtype=np.float64))
    np.testing.assert_array_equal(longer.prompt_tokens, [10, 20, 30, 10, 20, 30, 10])
    np.testing.assert_array_equal(longer.decode_tokens, [1, 2, 3, 1, 2, 3, 1])
    np.testing.assert_array_equal(longer.arrival_s, np.arange(7))
    shorter = lengths_with_arrivals(prompt, decode, np.array([0.5, 0.75]))
    np.testing.assert_array_equal(shorter.prompt_tokens, [10, 20])
    np.testing.assert_array_equal(shorter.arrival_s, [0.5, 0.75])
    with pytest.raises(ValueError):
        lengths_with_arrivals(prompt, decode[:2], np.arange(3, dtype=np.float64))


# ------------------------------------------------------------------------- TTFT targets


def test_bear_ttft_targets_are_clipped_to_the_band() -> None:
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, 400_000, size=20_000)
    targets = bear_ttft_targets_s(prompts, rng)
    assert targets.shape == prompts.shape
    assert np.all((targets >= 0.150) & (targets <= 1.120))
    huge = bear_ttft_targets_s(np.full(100, 1_000_000), rng)
    assert np.all(huge == 1.120)


def test_bear_ttft_targets_for_a_zero_token_prompt_sit_just_above_the_floor() -> None:
    # With p = 0 the formula gives u + 155 v in [1 + 151.9, 5 + 158.1] ms, which is above
    # the 150 ms floor, so the max() does not bind for any non-negative prompt.
    targets = bear_ttft_targets_s(np.zeros(5_000, dtype=np.int64), np.random.default_rng(6))
    assert np.all(targets >= (1 + 155 * 0.98) / 1000)
    assert np.all(targets <= (5 + 155 * 1.02) / 1000)


def test_bear_ttft_targets_unclipped_region() -> None:
    targets = bear_ttft_targets_s(np.full(5_000, 10_000), np.random.default_rng(8))
    assert np.all(targets >= (1 + (155 + 35) * 0.98) / 1000)
    assert np.all(targets <= (5 + (155 + 35) * 1.02) / 1000)
    # Draws are spread over the band, not collapsed onto one value.
    assert targets.max() - targets.min() > 0.005


# ---------------------------------------------------------------- predicted decode tokens


@DETERMINISTIC
@given(
    decode=st.lists(st.integers(1, 100_000), min_size=1, max_size=200),
    noise=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**32 - 1),
)
def test_predicted_decode_tokens_stay_in_the_noise_band(
    decode: list[int], noise: float, seed: int
) -> None:
    true = np.array(decode, dtype=np.int64)
    predicted = predicted_decode_tokens(true, noise, np.random.default_rng(seed))
    assert predicted.dtype == np.int64
    assert np.all(predicted >= 1)
    assert np.all(predicted >= np.floor((1 - noise) * true))
    assert np.all(predicted <= np.ceil((1 + noise) * true))


def test_predicted_decode_tokens_oracle_and_determinism() -> None:
    true = np.array([1, 5, 129, 4000], dtype=np.int64)
    oracle = predicted_decode_tokens(true, 0.0, np.random.default_rng(0))
    np.testing.assert_array_equal(oracle, true)
    assert oracle is not true
    big = np.arange(1, 5_001, dtype=np.int64)
    first = predicted_decode_tokens(big, 0.5, np.random.default_rng(9))
    second = predicted_decode_tokens(big, 0.5, np.random.default_rng(9))
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, big)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            predicted_decode_tokens(true, bad, np.random.default_rng(0))


# ----------------------------------------------------------------------------- SLO classes


def test_slo_class_constants() -> None:
    assert (TIGHT.ttft_s, TIGHT.tpot_s) == (0.175, 0.0397)
    assert LOOSE.ttft_s == pytest.approx(3 * TIGHT.ttft_s)
    assert LOOSE.tpot_s == pytest.approx(3 * TIGHT.tpot_s)


def test_assign_slo_classes_follows_weights() -> None:
    classes = [
        SloClass("a", 0.1, 0.01, 1.0),
        SloClass("b", 0.2, 0.02, 3.0),
        SloClass("c", 0.3, 0.03, 6.0),
    ]
    draws = assign_slo_classes(50_000, classes, np.random.default_rng(12))
    assert draws.dtype == np.int64
    shares = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(shares, [0.1, 0.3, 0.6], atol=0.02)
    even = assign_slo_classes(50_000, [TIGHT, LOOSE], np.random.default_rng(13))
    assert abs(float(np.mean(even)) - 0.5) < 0.02
    with pytest.raises(ValueError):
        assign_slo_classes(5, [], np.random.default_rng(0))
    with pytest.raises(ValueError):
        assign_slo_classes(5, [SloClass("z", 0.1, 0.01, 0.0)], np.random.default_rng(0))


# -------------------------------------------------------------------------- build_requests


def test_build_requests_fills_plain_python_fields() -> None:
    trace = _small_trace()
    ttft = np.array([0.2, 0.3, 0.4, 0.5, 0.6])
    predicted = np.array([2, 2, 3, 5, 8], dtype=np.int64)
    tpot = np.full(5, 0.05)
    names = ["tight", "loose", "tight", "loose", "tight"]
    requests = build_requests(trace, ttft, predicted, tpot, names)
    assert requests[3] == Request(
        request_id=3,
        arrival_s=3.0,
        prompt_tokens=13,
        decode_tokens=4,
        predicted_decode_tokens=5,
        ttft_target_s=0.5,
        tpot_target_s=0.05,
        slo_class="loose",
    )
    assert [r.request_id for r in requests] == list(range(5))
    for request in requests:
        assert type(request.request_id) is int
        assert type(request.arrival_s) is float
        assert type(request.prompt_tokens) is int
        assert type(request.decode_tokens) is int
        assert type(request.predicted_decode_tokens) is int
        assert type(request.ttft_target_s) is float
        assert type(request.tpot_target_s) is float
    plain = build_requests(trace, ttft, predicted)
    assert all(r.tpot_target_s is None and r.slo_class == "default" for r in plain)


@pytest.mark.parametrize("argument", ["ttft_target_s", "predicted", "tpot_target_s", "slo_class"])
def test_build_requests_names_the_mismatched_argument(argument: str) -> None:
    trace = _small_trace()
    ttft = np.full(5 if argument != "ttft_target_s" else 4, 0.2)
    predicted = np.ones(5 if argument != "predicted" else 6, dtype=np.int64)
    tpot = np.full(5 if argument != "tpot_target_s" else 3, 0.05)
    names = ["x"] * (5 if argument != "slo_class" else 2)
    with pytest.raises(ValueError, match=argument):
        build_requests(trace, ttft, predicted, tpot, names)


def test_end_to_end_workload_pipeline_is_deterministic() -> None:
    def build(seed: int) -> list[Request]:
        rng = np.random.default_rng(seed)
        prompt, decode = read_lengths_csv(ARXIV)
        order = rng.permutation(len(prompt))
        arrivals = mmpp2_arrivals(8.0, 6.0, 2_000, rng).arrival_s
        trace = lengths_with_arrivals(prompt[order], decode[order], arrivals)
        classes = (TIGHT, LOOSE)
        chosen = assign_slo_classes(len(trace), classes, rng)
        return build_requests(
            trace,
            np.array([classes[i].ttft_s for i in chosen]),
            predicted_decode_tokens(trace.decode_tokens, 0.2, rng),
            np.array([classes[i].tpot_s for i in chosen]),
            [classes[i].name for i in chosen],
        )

    first, second = build(21), build(21)
    assert len(first) == 2_000
    assert first == second
