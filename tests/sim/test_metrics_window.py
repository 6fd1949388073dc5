"""Served fraction, tails over all requests (refused = infinitely late) and throughput
over the arrival window, on a hand-built run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from olproute.sim import metrics
from tests.sim.test_metrics_utility import PROFILES, _result


def test_served_fraction_and_tails_over_all_requests() -> None:
    s = metrics.summarize(_result(), PROFILES)
    assert s.served_fraction == 0.75
    # over the served: TTFT 0.1, 0.2, 0.5; over all: the shed one is infinitely late
    assert s.ttft_p99_s == pytest.approx(np.percentile([0.1, 0.2, 0.5], 99))
    assert math.isinf(s.ttft_p99_all_s) and math.isinf(s.ttft_p90_all_s)
    assert math.isinf(s.eel_p95_all_s) and math.isinf(s.eel_p99_all_s)
    res = _result()
    all_served = replace(res, shed=np.zeros(4, dtype=bool),
                         first_token_s=res.first_token_s[[0, 1, 2, 2]] + [0, 0, 0, 1.0],
                         finish_s=res.finish_s[[0, 1, 2, 2]] + [0, 0, 0, 1.0],
                         decode_tokens=np.array([50, 100, 100, 10]),
                         instance=np.array([0, 1, 1, 0]))
    s = metrics.summarize(all_served, PROFILES)
    assert s.served_fraction == 1.0
    # every request served: the same figure as over the served (TTFTs 0.1, 0.2, 0.5, 0.5)
    assert s.ttft_p99_all_s == s.ttft_p99_s == pytest.approx(0.5)
    assert s.eel_p95_all_s == pytest.approx(s.eel_p95_s)
    assert metrics.pct_all(np.array([0.3, 0.1, 0.2]), np.ones(3, bool), 50) == 0.2
    # one of 200 refused: the P99 over all requests is finite, the P99.9 is not
    x = np.linspace(0.1, 2.0, 200)
    served = np.ones(200, bool)
    served[17] = False
    assert math.isfinite(metrics.pct_all(x, served, 99))
    assert math.isinf(metrics.pct_all(x, served, 99.9))


def test_throughput_is_over_the_arrival_window() -> None:
    """Arrivals at 0, 1, 2, 3 s: the window is [0, 3]. Request 0 (prompt 100, 50 out)
    delivers everything in it; request 1 (200, 100 out) too; request 2 (200, 100 out,
    first token at 2.5 s, last at 3.5 s) its prompt and first token, then 99 x 0.5 of
    the rest; request 3 was shed."""
    s = metrics.summarize(_result(), PROFILES)
    assert s.window_s == 3.0
    assert s.throughput_tokens_per_s == pytest.approx((150 + 300 + 201 + 99 * 0.5) / 3.0)
    assert s.throughput_requests_per_s == pytest.approx(2 / 3.0)   # finishes at 1.1, 2.2
    # the makespan figure, under its own name: every served token over 0 .. 5 s
    assert s.makespan_tokens_per_s == pytest.approx((150 + 300 + 300) / 5.0)


def test_json_has_no_nan_or_infinity() -> None:
    d = metrics.summarize(_result(), PROFILES).as_json()
    assert d["ttft_p99_all_s"] is None and d["served_fraction"] == 0.75
    text = json.dumps(d, allow_nan=False)
    assert "Infinity" not in text and "NaN" not in text
