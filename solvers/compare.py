"""Online prices against the exact LP, across scenarios where each resource binds.

    python -m solvers.compare [--scenarios batch,kv,compute] [--seeds 10,11,12]
                              [--requests N] [--json PATH] [--png PATH]

Four Llama-2-7B / A100 engines, stationary Poisson arrivals, predicted lengths with
+/-20% noise, bid_price with its default reward and prices, in three scenarios, each
overloaded so that its resource binds in the LP:

- ``batch``: max_num_seqs 16 (batch slots bind long before KV or the prefill budget),
  splitwise_conv lengths, 16 req/s;
- ``kv``: a KV cache of 8,192 tokens per engine and long outputs (1,024-token prompts,
  256-token outputs), vLLM's other defaults, 10 req/s;
- ``compute``: vLLM's defaults (max_num_seqs 256, the profile's token budget),
  splitwise_code lengths (long prompts, short outputs), 32 req/s: the prefill budget
  binds.

For each (scenario, seed): LP* (column generation, exact), the online reward, D(p_online),
the certificate D(p_online)/LP* - 1, the best rescaling lambda of the online prices and
its certificate (shape vs level of the prices), the online reward as a share of LP*, and
the capacity rows binding in the LP per resource. Then how right the model was about
time (``solvers.check.DurationFit``: realised over predicted decode time per request,
``duration_ratio``, and mean decoders per instance, ``occupancy_ratio``, with both
means), and LP* again on the durations that held (``solvers.check.realised_problem``)
with the online reward's share of it (``online_over_realised_lp``). Both LPs may start a
request up to the largest realised wait to its first token later than its earliest
slot (``lp_max_delay_s``); the online policy's patience is its TTFT target. So that the
LP's longer patience is not counted as the online policy's loss, a second online run,
the **matched** arm, gives each request that maximum delay as its patience
(``admission.patience_s``), scored on the same window's requests
(``online_matched_over_lp``, ``online_matched_over_realised_lp``). The seeds are the
report seeds of ``bench/common.py``; nothing was tuned on them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from olproute.config.loader import Config, LoadedConfig, load_profiles
from solvers.certificate import online_reward
from solvers.check import (
    CheckResult,
    DurationFit,
    duration_fit,
    plot_prices,
    realised_problem,
    run_check,
)
from solvers.lp import solve
from solvers.resolve import record_as_configured

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
REPORT_SEEDS = (10, 11, 12)

SCENARIOS: dict[str, dict[str, Any]] = {
    "batch": {"rate": 16.0, "engine": {"max_num_seqs": 16},
              "workload": {"lengths_path": str(TRACES / "splitwise_conv.csv")}},
    "kv": {"rate": 10.0, "engine": {"kv_capacity_tokens": 8192},
           "workload": {"prompt_tokens": 1024, "decode_tokens": 256}},
    "compute": {"rate": 32.0, "engine": {},
                "workload": {"lengths_path": str(TRACES / "splitwise_code.csv")}},
}


def scenario(name: str, num_requests: int, seed: int, rate: float | None = None,
             patience_s: float | None = None, prices: dict[str, Any] | None = None
             ) -> LoadedConfig:
    """The config of one scenario (module docstring) at its rate (or ``rate``); with
    ``patience_s``, requests may wait that long in the router's buffer (default: their
    TTFT target); ``prices``: keys of the ``prices`` section to override."""
    sc = SCENARIOS[name]
    data: dict[str, Any] = {
        "admission": {} if patience_s is None else {"patience_s": patience_s},
        "prices": prices or {},
        "instances": [{"name": "llama7b", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4, **sc["engine"]}],
        "workload": {"kind": "poisson", "rate_per_s": rate or sc["rate"],
                     "num_requests": num_requests, **sc["workload"]},
        "prediction": {"mode": "noisy", "noise": 0.2},
        "router": {"policy": "bid_price"},
        "sim": {"seed": seed},
    }
    return LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                        load_profiles(REPO / "configs" / "profiles.yaml"))


@dataclass(frozen=True, slots=True)
class Row:
    """One (scenario, seed): the check, how right the model was about time, and LP* on
    the durations that held."""

    scenario: str
    rate: float
    seed: int
    check: CheckResult
    fit: DurationFit
    lp_realised: float
    max_delay_s: float     # the latest start the LP may choose, after the earliest
    matched_reward: float  # the online reward with max_delay_s as patience


def run(names: list[str], seeds: list[int], num_requests: int, gap_tol: float = 0.0,
        png: Path | None = None, patience_s: float | None = None,
        prices: dict[str, Any] | None = None) -> list[Row]:
    """Every (scenario, seed); with ``png``, the price plot of the last one."""
    rows: list[Row] = []
    for name in names:
        for seed in seeds:
            t0 = time.perf_counter()
            loaded = scenario(name, num_requests, seed, patience_s=patience_s, prices=prices)
            res, prob, sol, p_online, log, ids = run_check(loaded, gap_tol=gap_tol,
                                                           record=record_as_configured)
            done = (log.instance[ids], log.first_token_s[ids], log.finish_s[ids])
            lp_real = solve(realised_problem(prob, *done), gap_tol=gap_tol).objective
            delay_s = prob.max_delay * prob.slot_s
            matched = record_as_configured(scenario(name, num_requests, seed,
                                                    patience_s=delay_s, prices=prices)).result
            won = online_reward(prob, matched.instance[ids], matched.first_token_s[ids],
                                matched.finish_s[ids])
            print(f"  {name} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
            rows.append(Row(name, float(SCENARIOS[name]["rate"]), seed, res,
                            duration_fit(prob, *done), lp_real, delay_s, float(won.sum())))
    if png is not None and rows:
        plot_prices(prob, sol.p, p_online, png, [s.name for s in loaded.specs])
    return rows


def binding_text(r: CheckResult) -> str:
    return "/".join(str(r.binding_by_resource.get(k, 0)) for k in ("batch", "kv", "compute"))


def table(rows: list[Row]) -> str:
    head = (f"{'scenario':<8} {'req/s':>5} {'seed':>4} {'N':>5} {'LP*':>9} {'online':>9} "
            f"{'D(p_on)':>9} {'D/LP*-1':>8} {'x best':>6} {'scaled':>7} {'on/LP*':>7} "
            f"{'binding b/kv/c':>15} {'LP s':>6} {'LP* real':>9} {'on/real':>7} "
            f"{'dur x':>6} {'occ x':>6} {'run p/r':>11} {'delay s':>7} {'match/real':>10}")
    lines = [head, "-" * len(head)]
    for row in rows:
        r, f = row.check, row.fit
        lines.append(
            f"{row.scenario:<8} {row.rate:>5g} {row.seed:>4} {r.num_requests:>5} "
            f"{r.lp_value:>9.1f} "
            f"{r.online_reward:>9.1f} {r.d_online:>9.1f} {r.certificate * 100:>7.2f}% "
            f"{r.best_scale:>6.3f} {r.certificate_scaled * 100:>6.2f}% "
            f"{r.online_reward / r.lp_value * 100:>6.1f}% {binding_text(r):>15} "
            f"{r.lp_seconds:>6.1f} {row.lp_realised:>9.1f} "
            f"{r.online_reward / row.lp_realised * 100:>6.1f}% {f.duration_ratio:>6.3f} "
            f"{f.occupancy_ratio:>6.3f} "
            f"{f.running_predicted:>5.1f}/{f.running_realised:<5.1f} "
            f"{row.max_delay_s:>7.2f} {row.matched_reward / row.lp_realised * 100:>9.1f}%")
    return "\n".join(lines)


def as_json(rows: list[Row]) -> dict[str, Any]:
    """The issue's keys per row, then every figure of the check."""
    return {"rows": [{"scenario": row.scenario, "rate": row.rate, "seed": row.seed,
                      "certificate": row.check.certificate,
                      "online_over_lp": row.check.online_reward / row.check.lp_value,
                      "online_over_realised_lp": row.check.online_reward / row.lp_realised,
                      "lp_realised": row.lp_realised,
                      "lp_max_delay_s": row.max_delay_s,
                      "matched_patience_s": row.max_delay_s,
                      "online_matched": row.matched_reward,
                      "online_matched_over_lp": row.matched_reward / row.check.lp_value,
                      "online_matched_over_realised_lp": row.matched_reward / row.lp_realised,
                      "duration_ratio": row.fit.duration_ratio,
                      "occupancy_ratio": row.fit.occupancy_ratio,
                      "running_predicted": row.fit.running_predicted,
                      "running_realised": row.fit.running_realised,
                      "binding_rows": row.check.lp_binding,
                      "binding_by_resource": row.check.binding_by_resource,
                      **row.check.as_dict()}
                     for row in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seeds", default=",".join(str(s) for s in REPORT_SEEDS))
    ap.add_argument("--requests", type=int, default=600, help="requests per run")
    ap.add_argument("--gap-tol", type=float, default=0.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH", help="price plot of the last (scenario, seed)")
    ap.add_argument("--patience-s", type=float, default=None,
                    help="admission.patience_s (default: each request's TTFT target)")
    ap.add_argument("--price", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the prices section (repeatable), e.g. "
                    "average_halflife_updates=0")
    args = ap.parse_args()
    prices = {}
    for item in args.price:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--price {item!r}: expected KEY=VALUE")
        prices[key] = yaml.safe_load(value)
    rows = run(args.scenarios.split(","), [int(s) for s in args.seeds.split(",")],
               args.requests, args.gap_tol, Path(args.png) if args.png else None,
               args.patience_s, prices)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
