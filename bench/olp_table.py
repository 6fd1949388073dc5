"""The OLP paper's experiment: every policy on one seeded workload, % change vs round robin.

    python bench/olp_table.py [--json PATH] [--png PATH] [--requests N] [--quick]

Four Llama-2-7B / A100-80GB engines; prompt and output lengths from splitwise_conv
(shuffled), Poisson arrivals at a stable rate (16 req/s, about 80% of what the four
engines sustain) and a slightly overloaded one (24 req/s, where round robin's queues
and preemptions start to grow); predicted output lengths with +/-20% uniform noise.
For each policy: mean / P95 / P99 end-to-end latency, mean TTFT and token throughput,
as % change against round_robin measured in the same run (negative is better for
latency, positive for throughput).

``bid_price`` runs with the default reward (sigma 1, beta = gamma = 0.01 per slot saved)
and prices (step 2.0, constant, every 10 slots of 50 ms, K = 5), and with a patience of
60 s: this experiment judges end-to-end latency, not a TTFT target, so held requests
wait in the router's buffer until an instance can take them rather than being deferred
to a queue after the default patience (their TTFT target).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from olproute.config import Config, LoadedConfig, load_profiles
from olproute.policies import REGISTRY
from olproute.sim.metrics import Summary, summarize
from olproute.sim.scenario import CalibrationSource, build_requests, simulate

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
RATES = (("stable", 16.0), ("overloaded", 24.0))
METRICS = (("mean EEL", "eel_mean_s", -1), ("P95 EEL", "eel_p95_s", -1),
           ("P99 EEL", "eel_p99_s", -1), ("mean TTFT", "ttft_mean_s", -1),
           ("throughput", "throughput_tokens_per_s", +1))


def scenario(rate: float, num_requests: int) -> LoadedConfig:
    data: dict[str, Any] = {
        "instances": [{"name": "llama7b", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4}],
        "workload": {"kind": "poisson", "rate_per_s": rate, "num_requests": num_requests,
                     "lengths_path": str(TRACE)},
        "prediction": {"mode": "noisy", "noise": 0.2},
        "admission": {"patience_s": 60.0},
        "sim": {"seed": 0},
    }
    return LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                        load_profiles(REPO / "configs" / "profiles.yaml"))


def run(num_requests: int, policies: list[str]) -> dict[str, dict[str, Summary]]:
    out: dict[str, dict[str, Summary]] = {}
    for label, rate in RATES:
        loaded = scenario(rate, num_requests)
        reqs = build_requests(loaded)
        cal = CalibrationSource(loaded)
        out[label] = {}
        for name in policies:
            t0 = time.perf_counter()
            out[label][name] = summarize(simulate(loaded, name, reqs, calibration=cal))
            print(f"  {label:>10} {name:<18} {time.perf_counter() - t0:6.1f} s", flush=True)
    return out


def pct(value: float, base: float) -> float:
    return (value / base - 1.0) * 100.0


def table(results: dict[str, dict[str, Summary]], rate: str) -> str:
    rows = results[rate]
    base = rows["round_robin"].as_dict()
    head = f"{'policy':<18}" + "".join(f"{m:>12}" for m, _, _ in METRICS)
    lines = [f"{rate} ({dict(RATES)[rate]:g} req/s): % change vs round_robin "
             f"(round_robin: mean EEL {base['eel_mean_s']:.2f} s, "
             f"P95 {base['eel_p95_s']:.2f} s, tokens/s {base['throughput_tokens_per_s']:.0f})",
             head, "-" * len(head)]
    for name, s in sorted(rows.items(), key=lambda kv: kv[1].eel_mean_s):
        d = s.as_dict()
        lines.append(f"{name:<18}" + "".join(
            f"{pct(float(d[key]), float(base[key])):>+11.1f}%" for _, key, _ in METRICS))
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Summary]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(RATES), figsize=(13, 4.6), constrained_layout=True)
    for ax, (label, rate) in zip(axes, RATES, strict=True):
        rows = results[label]
        base = rows["round_robin"].as_dict()
        names = sorted(rows, key=lambda n: rows[n].eel_mean_s)
        x = np.arange(len(names))
        for j, (metric, key, _) in enumerate(METRICS[:3]):
            vals = [pct(float(rows[n].as_dict()[key]), float(base[key])) for n in names]
            ax.bar(x + (j - 1) * 0.27, vals, width=0.27, label=metric)
        ax.axhline(0, color="black", lw=0.7)
        ax.set_xticks(x, names, rotation=45, ha="right")
        ax.set_ylabel("% change vs round_robin")
        ax.set_title(f"{label}: Poisson {rate:g} req/s, 4 x Llama-2-7B / A100")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="requests per rate")
    ap.add_argument("--quick", action="store_true", help="600 requests, four policies")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--png", metavar="PATH", default="olp_table.png", help="bar chart")
    args = ap.parse_args()
    policies = REGISTRY.names()
    if args.quick:
        args.requests = 600
        policies = ["round_robin", "least_outstanding", "power_of_two", "bid_price"]
    results = run(args.requests, policies)
    for label, _ in RATES:
        print()
        print(table(results, label))
    plot(results, Path(args.png))
    print(f"\nwrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {label: {n: s.as_dict() for n, s in rows.items()}
             for label, rows in results.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
