"""bench/prefix_table.py, quick, run as its own process: two seeds of the trace's first
30 s, the results file's keys and sane values, and an unknown policy named rather than
skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench_run import results_of, run_bench

REQUIRED = ("ttft_mean_s", "ttft_p99_s", "goodput", "hit_rate", "served_fraction",
            "tokens_per_s")
# the bench's POLICIES (the five) and TIME_SCALE
POLICIES = ("round_robin", "least_outstanding", "cache_aware", "prefix_load", "bid_price")
TIME_SCALE = 0.57


def test_a_short_window_gives_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    printed = run_bench("prefix_table", "--seeds", "10,11", "--window", "30",
                        "--json", str(out)).stdout
    doc = json.loads(out.read_text())
    assert doc["seeds"] == [10, 11] and "prefix_table.py" in doc["command"]
    assert {"commit", "machine", "started", "wall_s"} <= set(doc)
    s = doc["results"]
    assert s["seeds"] == [10, 11] and s["window_s"] == 30.0
    assert s["time_scale"] == TIME_SCALE and s["num_requests"] > 50
    assert list(s["policies"]) == list(POLICIES)
    assert s["index"] == "approximate" and "prefix index approximate" in printed
    for name, p in s["policies"].items():
        assert name in printed
        for key in REQUIRED:
            spread = p[f"{key}_spread"]
            assert len(spread["per_seed"]) == 2, (name, key)
            # the required key is the mean over the seeds
            assert p[key] == pytest.approx(sum(spread["per_seed"]) / 2), (name, key)
            assert spread["min"] <= p[key] <= spread["max"]
        assert 0.0 < p["ttft_mean_s"] <= p["ttft_p99_s"] < 60.0
        assert 0.0 <= p["goodput"] <= p["ttft_attainment"] <= 1.0
        assert 0.0 <= p["hit_rate"] < 1.0 and p["tokens_per_s"] > 0.0
        assert 0.0 < p["served_fraction"] <= 1.0
        assert p["index"] == "approximate"
    # nobody refuses a request (the scenario defers at patience), so every TTFT is over
    # the same requests; the trace's shared first block gives some cache hits (30 s holds
    # no later turn of a conversation: tests/sim/test_prefix_routing.py compares the
    # policies' hit rates on a longer stretch)
    for name in POLICIES:
        assert s["policies"][name]["served_fraction"] == 1.0
        assert s["policies"][name]["hit_rate"] > 0.0


def test_an_unknown_policy_is_an_error_naming_it() -> None:
    proc = run_bench("prefix_table", "--policies", "round_robin,no_such_policy",
                     "--window", "30", check=False)
    assert proc.returncode == 2
    err = proc.stderr
    assert "unknown policy 'no_such_policy'" in err and "round_robin" in err


def test_estimate_eval_splits_by_the_cached_share(tmp_path: Path) -> None:
    out = tmp_path / "ee.json"
    run_bench("prefix_table", "--estimate-eval", "--seeds", "10", "--window", "30",
              "--estimators", "bea", "--json", str(out))
    ev = results_of(out)["estimates"][0]
    parts = ev["parts"]
    assert list(parts) == ["all", "cached 0%-10%", "cached 10%-50%", "cached 50%-100%"]
    (everyone,) = parts["all"]
    assert everyone["estimator"] == "bea" and everyone["mape_pct"] >= 0.0
    # the three shares split the requests
    assert sum(rows[0]["n"] for name, rows in parts.items() if name != "all" and rows) \
        == everyone["n"]
    # the half-cached figure is that part's BEA row (None where no request is in it)
    half = parts["cached 50%-100%"]
    want = half[0]["mape_pct"] if half else None
    assert results_of(out)["bea_mape_half_cached"] == want


def test_a_kv_budget_gives_every_engine_that_cache(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    printed = run_bench("prefix_table", "--seeds", "10", "--window", "30", "--kv-tokens",
                        "131072", "--policies", "round_robin", "--json", str(out)).stdout
    s = results_of(out)
    assert s["kv_tokens"] == 131072 and "KV 131,072 tokens an engine" in printed
    from bench.prefix_table import scenario

    specs = scenario(TIME_SCALE, 30.0, 10, kv_tokens=131072).specs
    assert {sp.num_kv_blocks for sp in specs} == {131072 // 16} and len(specs) == 8
    assert {sp.num_kv_blocks for sp in scenario(TIME_SCALE, 30.0, 10).specs} \
        == {405776 // 16}


def test_the_exact_index_is_named_in_the_table_and_every_run(tmp_path: Path) -> None:
    out = tmp_path / "exact.json"
    printed = run_bench("prefix_table", "--seeds", "10", "--window", "30", "--index", "exact",
                        "--policies", "round_robin,cache_aware", "--json", str(out)).stdout
    s = results_of(out)
    assert s["index"] == "exact" and "prefix index exact" in printed
    assert [p["index"] for p in s["policies"].values()] == ["exact", "exact"]
    assert all(p["served_fraction"] == 1.0 and p["hit_rate"] > 0.0
               for p in s["policies"].values())
    bad = run_bench("prefix_table", "--index", "nearly", "--window", "30", check=False)
    assert bad.returncode == 2 and "--index" in bad.stderr
