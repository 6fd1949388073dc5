"""bench/live_table.py's live path, quick, run as its own process: the same requests
through ``olproute serve`` (its own process) in front of ``olproute emulate`` (its own
process), every request finished or refused with a reason, and the simulator's replay of
the same requests beside it (from the bench's results file)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tests.support.bench_run import results_of, run_bench


def _policy(tmp_path: Path, scenario: str, policy: str, n: int) -> dict[str, Any]:
    out = tmp_path / "live.json"
    run_bench("live_table", "--seeds", "10", "--scenarios", scenario, "--policies", policy,
              "--requests", str(n), "--live-only", "--keep", str(tmp_path / "keep"),
              "--json", str(out))
    (sc,) = results_of(out)["scenarios"]
    assert sc["name"] == scenario and sc["seeds"] == [10]
    entry: dict[str, Any] = sc["policies"][policy]
    return entry


def _check_replies(entry: dict[str, Any], n: int) -> int:
    (live,) = entry["live"]["per_seed"]
    (side,) = entry["live_side"]
    served = round(live["served_fraction"] * n)
    not_served = side["not_served"]
    # every request either finished (complete stream, a finish reason) or was refused
    # with a reason the router gave
    assert served + sum(not_served.values()) == n
    for key in not_served:
        status, _, reason = key.partition(" ")
        assert status in {"429", "503"}, key
        assert reason and reason != "None", key
    assert math.isfinite(live["ttft_mean_s"]) and live["ttft_mean_s"] > 0
    assert live["eel_mean_s"] >= live["ttft_mean_s"]
    finish = side["finish_reasons"]
    assert finish["stop"] + finish["length"] == served
    return served


def test_olp_bid_price_live_quick(tmp_path: Path) -> None:
    n = 30
    entry = _policy(tmp_path, "olp", "bid_price", n)
    served = _check_replies(entry, n)
    # the emulated model stopped where the truth says: no request hit max_tokens (2,048,
    # above every splitwise_conv output), so every served one ended with "stop"
    (side,) = entry["live_side"]
    assert side["finish_reasons"] == {"stop": served, "length": 0}
    (sim,) = entry["sim"]["per_seed"]
    assert sim["served_fraction"] >= 0.9 and served >= 0.9 * n


def test_bear_round_robin_live_quick(tmp_path: Path) -> None:
    n = 20
    entry = _policy(tmp_path, "bear", "round_robin", n)
    # round robin refuses nothing
    assert _check_replies(entry, n) == n
    (side,) = entry["live_side"]
    assert not side["not_served"]
