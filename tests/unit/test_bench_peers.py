"""bench/peers.py's pure parts: prompts, arrivals, a run's figures, the goals' ratios, the
olproute config it serves with, and the peers' command lines."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.peers import (
    LOADS,
    Reply,
    olproute_config,
    olproute_figures,
    olproute_samples,
    parse_override,
    poisson_offsets,
    port_of,
    prompt,
    ratios,
    sglang_argv,
    summarise,
    table,
    vllm_router_argv,
)
from olproute.config.loader import load_config


def test_prompts_are_distinct_and_seeded() -> None:
    ps = [prompt(0, i) for i in range(200)]
    assert len(set(ps)) == len(ps)
    assert prompt(0, 5) == prompt(0, 5) and prompt(1, 5) != prompt(0, 5)


def test_poisson_offsets_seeded_increasing_within_duration() -> None:
    a = poisson_offsets(50.0, 20.0, seed=3)
    assert a == poisson_offsets(50.0, 20.0, seed=3)
    assert a != poisson_offsets(50.0, 20.0, seed=4)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert a[0] > 0 and a[-1] < 20.0
    assert abs(len(a) - 1000) < 150   # 50/s over 20 s, well within 5 sigma
    assert poisson_offsets(0.0, 20.0, seed=3) == []


def _reply(status: int, complete: bool, ttft: float | None = None, e2e: float | None = None,
           sent: float = 0.0, end: float = 1.0, reason: str = "") -> Reply:
    return Reply(status, ttft, e2e, complete, sent, end, reason)


def test_summarise_counts_and_rates() -> None:
    replies = [_reply(200, True, 0.01 * (i + 1), 0.1, sent=0.0, end=2.0) for i in range(10)]
    replies += [_reply(429, False, reason="request refused: shed after 2003 ms"),
                _reply(429, False, reason="request refused: shed after 2010 ms"),
                _reply(503, False), _reply(0, False, reason="TimeoutError"),
                _reply(200, False, reason="error event")]
    s = summarise(replies, router_cpu_s=0.05, client_cpu_s=0.02)
    assert (s["sent"], s["ok"]) == (15, 10)
    assert s["requests_per_s"] == pytest.approx(10 / 2.0)
    assert (s["refused"], s["refused_429"], s["refused_other"], s["failed"]) == (3, 2, 1, 2)
    assert s["ttft_p50_s"] == pytest.approx(0.055)
    assert s["router_cpu_ms_per_request"] == pytest.approx(5.0)
    assert s["client_cpu_ms_per_request"] == pytest.approx(2.0)
    # digits folded: both sheds are one reason
    assert s["not_served"]["429 request refused: shed after N ms"] == 2


def test_summarise_nothing_served_is_nan_not_an_error() -> None:
    s = summarise([_reply(429, False)], router_cpu_s=None, client_cpu_s=0.0)
    assert s["ok"] == 0 and math.isnan(s["ttft_p99_s"])
    assert s["router_cpu_ms_per_request"] is None


def _row(router: str, policy: str, load: str, rps: float, p99: float,
         refused: int = 0, sent: int = 100) -> dict[str, Any]:
    return {"router": router, "policy": policy, "load": load, "requests_per_s": rps,
            "ttft_p99_s": p99, "refused": refused, "sent": sent}


def test_ratios_per_policy_pair_and_refusals() -> None:
    runs: list[dict[str, Any]] = [_row("olproute", "round_robin", "closed", 90.0, 0.02),
            _row("olproute", "round_robin", "0.5", 40.0, 0.02),
            {**_row("olproute", "round_robin", "0.9", 80.0, 0.02, refused=5),
             "olproute_metrics": {"decisions": {"dispatch": 95, "hold": 7}}},
            _row("sglang", "round_robin", "closed", 100.0, 0.04),
            {"router": "sglang", "policy": "cache_aware", "load": "closed",
             "skipped": "not installed"}]
    r = ratios(runs)
    assert r["vs_sglang"] == [{"olproute_policy": "round_robin",
                               "sglang_policy": "round_robin",
                               "throughput_ratio": pytest.approx(0.9),
                               "ttft_p99_ratio": pytest.approx(0.5)}]
    assert [(x["load"], x["refused"], x["fraction"], x["hold_decisions"])
            for x in r["refusals"]] == [("0.5", 0, 0.0, 0), ("0.9", 5, 0.05, 7)]


def test_table_shows_skips_with_their_reason() -> None:
    row = {"router": "vllm-router", "policy": "round_robin", "load": "closed",
           "skipped": "not installed"}
    assert "skipped: not installed" in table([row])


def test_olproute_config_loads_with_the_engines_as_backends(tmp_path: Path) -> None:
    urls = ["http://127.0.0.1:4001", "http://127.0.0.1:4002", "http://127.0.0.1:4003"]
    cfg = olproute_config(urls, "least_outstanding", 8123,
                          [parse_override("admission.max_waiting=4")])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config(path)
    assert loaded.config.router.policy == "least_outstanding"
    assert loaded.config.admission.max_waiting == 4
    assert [b.url for b in loaded.config.server.backends] == urls
    assert loaded.config.server.host == "127.0.0.1" and loaded.config.server.port == 8123


def test_parse_override_needs_a_key_and_reads_yaml() -> None:
    assert parse_override("router.slot_ms=25") == ("router.slot_ms", 25)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_override("router.slot_ms")


def test_peer_command_lines_bind_loopback() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for argv in (sglang_argv(Path("py"), urls, "round_robin", 9000, 9001),
                 vllm_router_argv(Path("vr"), urls, "cache_aware", 9000, 9001)):
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
        assert port_of(argv) == 9000
        i = argv.index("--worker-urls")
        assert argv[i + 1:i + 3] == urls


METRICS_BEFORE = """\
olproute_decisions_total{action="dispatch",instance="a"} 10.0
olproute_decisions_total{action="dispatch",instance="b"} 5.0
olproute_decisions_total{action="hold",instance="a"} 2.0
olproute_held_full_total 0.0
olproute_loop_lag_seconds_bucket{le="0.001"} 90.0
olproute_loop_lag_seconds_bucket{le="0.01"} 100.0
olproute_loop_lag_seconds_bucket{le="+Inf"} 100.0
olproute_decision_seconds_sum 0.001
olproute_decision_seconds_count 15.0
"""
METRICS_AFTER = """\
olproute_decisions_total{action="dispatch",instance="a"} 60.0
olproute_decisions_total{action="dispatch",instance="b"} 55.0
olproute_decisions_total{action="hold",instance="a"} 2.0
olproute_decisions_total{action="shed",instance="a"} 3.0
olproute_held_full_total 1.0
olproute_loop_lag_seconds_bucket{le="0.001"} 190.0
olproute_loop_lag_seconds_bucket{le="0.01"} 299.0
olproute_loop_lag_seconds_bucket{le="+Inf"} 300.0
olproute_decision_seconds_sum 0.011
olproute_decision_seconds_count 115.0
"""


def test_olproute_figures_are_deltas_over_the_run() -> None:
    f = olproute_figures(olproute_samples(METRICS_BEFORE), olproute_samples(METRICS_AFTER))
    assert f["decisions"] == {"dispatch": 100, "shed": 3}
    assert f["held_full"] == 1
    # 200 lag samples in the run: 100 <= 1 ms, 199 <= 10 ms, so P99 <= 10 ms
    assert f["loop_lag_p99_s"] == pytest.approx(0.01)
    assert f["decision_mean_s"] == pytest.approx(0.01 / 100)


def test_loads_are_the_ones_the_results_name() -> None:
    assert LOADS == ("closed", "0.5", "0.9", "1.5")
