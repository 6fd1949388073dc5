"""LP vs dual across loads and seeds, as one table.

    python -m solvers.compare [--rates 8,12,16] [--seeds 0,1,2] [--requests N]
                              [--max-num-seqs B] [--json PATH] [--png PATH]

Four Llama-2-7B / A100 engines with ``max_num_seqs`` B (default 16, so that batch slots
bind: with vLLM's default of 256 neither capacity row of the LP binds at any load these
engines sustain, the LP's prices are 0 and the check is trivially tight), splitwise_conv
lengths, stationary Poisson arrivals, predicted lengths with +/-20% noise, bid_price with
its default reward and prices. For each (rate, seed): LP*, the online reward, D(p_online),
the certificate D(p_online)/LP* - 1, the best rescaling lambda of the online prices and
its certificate D(lambda p_online)/LP* - 1 (shape vs level of the prices), the online
reward as a share of LP*, binding and priced rows, and the LP's time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from olproute.config import Config, LoadedConfig, load_profiles
from solvers.check import CheckResult, plot_prices, run_check

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"


def scenario(rate: float, num_requests: int, seed: int, max_num_seqs: int) -> LoadedConfig:
    data: dict[str, Any] = {
        "instances": [{"name": "llama7b", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4, "max_num_seqs": max_num_seqs}],
        "workload": {"kind": "poisson", "rate_per_s": rate, "num_requests": num_requests,
                     "lengths_path": str(TRACE)},
        "prediction": {"mode": "noisy", "noise": 0.2},
        "router": {"policy": "bid_price"},
        "sim": {"seed": seed},
    }
    return LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                        load_profiles(REPO / "configs" / "profiles.yaml"))


def run(rates: list[float], seeds: list[int], num_requests: int, max_num_seqs: int,
        gap_tol: float = 0.0, png: Path | None = None) -> list[tuple[float, int, CheckResult]]:
    """Every (rate, seed); with ``png``, the price plot of the last one."""
    rows = []
    for rate in rates:
        for seed in seeds:
            t0 = time.perf_counter()
            loaded = scenario(rate, num_requests, seed, max_num_seqs)
            res, prob, sol, p_online = run_check(loaded, gap_tol=gap_tol)
            print(f"  rate {rate:g} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
            rows.append((rate, seed, res))
    if png is not None and rows:
        plot_prices(prob, sol.p, p_online, png, [s.name for s in loaded.specs])
    return rows


def table(rows: list[tuple[float, int, CheckResult]]) -> str:
    head = (f"{'req/s':>6} {'seed':>4} {'N':>5} {'LP*':>10} {'online':>10} {'D(p_on)':>10} "
            f"{'D/LP*-1':>8} {'x best':>7} {'scaled':>7} {'on/LP*':>7} {'binding':>8} "
            f"{'LP>0':>6} {'on>0':>6} {'LP s':>6}")
    lines = [head, "-" * len(head)]
    for rate, seed, r in rows:
        lines.append(
            f"{rate:>6g} {seed:>4} {r.num_requests:>5} {r.lp_value:>10.1f} "
            f"{r.online_reward:>10.1f} {r.d_online:>10.1f} {r.certificate * 100:>7.1f}% "
            f"{r.best_scale:>7.3f} {r.certificate_scaled * 100:>6.2f}% "
            f"{r.online_reward / r.lp_value * 100:>6.1f}% {r.lp_binding:>8} "
            f"{r.lp_priced:>6} {r.online_priced:>6} {r.lp_seconds:>6.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="8,12,16", help="Poisson rates, req/s")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--requests", type=int, default=1000, help="requests per run")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="batch slots B per engine")
    ap.add_argument("--gap-tol", type=float, default=0.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH", help="price plot of the last (rate, seed)")
    args = ap.parse_args()
    rows = run([float(r) for r in args.rates.split(",")],
               [int(s) for s in args.seeds.split(",")], args.requests, args.max_num_seqs,
               args.gap_tol, Path(args.png) if args.png else None)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"rate_per_s": rate, "seed": seed, **r.as_dict()} for rate, seed, r in rows],
            indent=2) + "\n")


if __name__ == "__main__":
    main()
