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
the capacity rows binding in the LP per resource. The seeds are the report seeds of
``bench/common.py``; nothing was tuned on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import yaml

from olproute.config.loader import Config, LoadedConfig, load_profiles
from solvers.check import CheckResult, plot_prices, run_check

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


Row = tuple[str, float, int, CheckResult]


def run(names: list[str], seeds: list[int], num_requests: int, gap_tol: float = 0.0,
        png: Path | None = None, patience_s: float | None = None,
        prices: dict[str, Any] | None = None) -> list[Row]:
    """Every (scenario, seed); with ``png``, the price plot of the last one."""
    rows: list[Row] = []
    for name in names:
        for seed in seeds:
            t0 = time.perf_counter()
            loaded = scenario(name, num_requests, seed, patience_s=patience_s, prices=prices)
            res, prob, sol, p_online = run_check(loaded, gap_tol=gap_tol)
            print(f"  {name} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
            rows.append((name, float(SCENARIOS[name]["rate"]), seed, res))
    if png is not None and rows:
        plot_prices(prob, sol.p, p_online, png, [s.name for s in loaded.specs])
    return rows


def binding_text(r: CheckResult) -> str:
    return "/".join(str(r.binding_by_resource.get(k, 0)) for k in ("batch", "kv", "compute"))


def table(rows: list[Row]) -> str:
    head = (f"{'scenario':<8} {'req/s':>5} {'seed':>4} {'N':>5} {'LP*':>9} {'online':>9} "
            f"{'D(p_on)':>9} {'D/LP*-1':>8} {'x best':>6} {'scaled':>7} {'on/LP*':>7} "
            f"{'binding b/kv/c':>15} {'LP s':>6}")
    lines = [head, "-" * len(head)]
    for name, rate, seed, r in rows:
        lines.append(
            f"{name:<8} {rate:>5g} {seed:>4} {r.num_requests:>5} {r.lp_value:>9.1f} "
            f"{r.online_reward:>9.1f} {r.d_online:>9.1f} {r.certificate * 100:>7.2f}% "
            f"{r.best_scale:>6.3f} {r.certificate_scaled * 100:>6.2f}% "
            f"{r.online_reward / r.lp_value * 100:>6.1f}% {binding_text(r):>15} "
            f"{r.lp_seconds:>6.1f}")
    return "\n".join(lines)


def as_json(rows: list[Row]) -> dict[str, Any]:
    """The issue's keys per row, then every figure of the check."""
    return {"rows": [{"scenario": name, "rate": rate, "seed": seed,
                      "certificate": r.certificate,
                      "online_over_lp": r.online_reward / r.lp_value,
                      "binding_rows": r.lp_binding,
                      "binding_by_resource": r.binding_by_resource, **r.as_dict()}
                     for name, rate, seed, r in rows]}


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
