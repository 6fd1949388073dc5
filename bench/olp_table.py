"""The OLP paper's experiment: every policy on the same seeded workloads, % change vs
round robin, over three seeds.

    python bench/olp_table.py [--json PATH] [--png PATH] [--requests N] [--seeds S,S,..]
                              [--ablations] [--quick] [--workers N]
                              [--executor {process,ray}] [--ray-address ADDR]

Four Llama-2-7B / A100-80GB engines; prompt and output lengths from splitwise_conv
(shuffled), Poisson arrivals at a stable rate (16 req/s, about 80% of what the four
engines sustain) and a slightly overloaded one (24 req/s, where round robin's queues
and preemptions start to grow); predicted output lengths with +/-20% uniform noise.
Every policy on a seed sees the same requests, predictions and calibration (a round-robin
profiling run on another seed).

For each policy: mean / P95 / P99 end-to-end latency, mean TTFT (over served requests),
the served fraction, tokens/s over the arrival window, and the requests each instance
got (max / min over instances; the check: <= 1.5 for every policy on this pool of
identical engines). Latency is shown as % change against round_robin on the same seed:
the mean over the seeds, with [min-max] over seeds for mean and P95 EEL. The seeds are
``bench/common.REPORT_SEEDS``; every constant ``bid_price`` runs with (the default
reward and prices) was chosen on tuning seeds (0 or 1).

``bid_price`` runs with the default reward (sigma 1, beta = gamma = 0.01 per slot saved)
and prices (step 2.0, constant, every 10 slots of 50 ms, K = 5), and with a patience of
60 s: this experiment judges end-to-end latency, not a TTFT target, so held requests
wait in the router's buffer until an instance can take them rather than being deferred
to a queue after the default patience (their TTFT target). It refuses nothing
(``admission: defer``), so every policy here is measured over the same served set.

``--ablations`` adds bid_price variants at the overloaded rate: the default patience
(each request's TTFT target) instead of 60 s, the step rule of before issue 14 (a
constant 2.0, no averaging) instead of adagrad with averaged prices, prices off
(``prices.enabled: false``; the start-and-fit checks still run every tick), and the held
requests decided together at each slot boundary (``release: density``, ``score`` or
``assignment``) instead of one by one in arrival order, and BEAR's constrained form
(``form: constrained``) instead of the Lagrangian.

Each (rate, seed) is a point of its own: by default they run one after another in this
process; ``--workers N`` runs N at a time in worker processes, ``--executor ray`` as Ray
tasks (a local Ray of N CPUs, or the cluster at ``--ray-address``). The figures are the
same either way.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import (
    REPORT_SEEDS,
    add_executor_args,
    add_harness_args,
    add_quick_arg,
    begin,
    executor_from,
    spread,
    write_results,
)
from olproute.config.loader import Config, LoadedConfig, load_profiles
from olproute.operator.executors import Executor
from olproute.policies import REGISTRY
from olproute.sim.metrics import Summary, summarize
from olproute.sim.scenario import CalibrationSource, build_requests, simulate

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
RATES = (("stable", 16.0), ("overloaded", 24.0))
# (column, Summary key, JSON key, sign that is better)
CHANGES = (("mean EEL", "eel_mean_s", "mean_eel", -1), ("P95 EEL", "eel_p95_s", "p95_eel", -1),
           ("P99 EEL", "eel_p99_s", "p99_eel", -1), ("mean TTFT", "ttft_mean_s", "mean_ttft", -1),
           ("tokens/s", "throughput_tokens_per_s", "tokens_per_s", +1))
IMBALANCE_LIMIT = 1.5
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "bid_price, patience = TTFT target": {"admission": {"patience_s": None,
                                                         "max_patience_s": 30.0}},
    # the step rule of before issue 14 (its other fixes stay: clipping, prorating, N_H)
    "bid_price, constant step 2.0, no averaging": {"prices": {
        "step_size": 2.0, "schedule": "constant", "average_halflife_updates": 0.0}},
    "bid_price, prices off": {"prices": {"enabled": False}},
    # the held requests decided together each slot (issue 16), not one by one
    "bid_price, release by density": {
        "router": {"policy_params": {"bid_price": {"release": "density"}}}},
    "bid_price, release by score": {
        "router": {"policy_params": {"bid_price": {"release": "score"}}}},
    "bid_price, release by assignment": {
        "router": {"policy_params": {"bid_price": {"release": "assignment"}}}},
    # BEAR's constrained form (issue 16): the on-time instances only, ranked by r - a.p
    "bid_price, constrained form": {
        "router": {"policy_params": {"bid_price": {"form": "constrained"}}}},
}


@dataclass(frozen=True, slots=True)
class Run:
    """One policy on one seed: its summary and requests per instance."""

    summary: Summary
    per_instance: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        lo = min(self.per_instance)
        return math.inf if lo == 0 else max(self.per_instance) / lo


def scenario(rate: float, num_requests: int, seed: int,
             overrides: dict[str, dict[str, Any]] | None = None) -> LoadedConfig:
    data: dict[str, Any] = {
        "instances": [{"name": "llama7b", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4}],
        "workload": {"kind": "poisson", "rate_per_s": rate, "num_requests": num_requests,
                     "lengths_path": str(TRACE)},
        "prediction": {"mode": "noisy", "noise": 0.2},
        # hold up to 60 s, then send to the best instance; no cap on the buffer (the OLP
        # paper's central buffer): the router's own defaults (shed, 256 held, 30 s) are
        # for serving, not for this latency experiment
        "admission": {"mode": "defer", "patience_s": 60.0, "max_patience_s": 60.0,
                      "max_held": 1_000_000},
        "sim": {"seed": seed},
    }
    for section, values in (overrides or {}).items():
        data[section] = {**data.get(section, {}), **values}
    return LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                        load_profiles(REPO / "configs" / "profiles.yaml"))


Results = dict[str, dict[str, list[Run]]]   # rate label -> policy -> one Run per seed


def run_point(label: str, rate: float, num_requests: int, seed: int,
              policies: Sequence[str], ablations: bool) -> dict[str, Run]:
    """Every policy (and at the overloaded rate the ablations) on one (rate, seed), on
    the same requests, predictions and calibration."""
    loaded = scenario(rate, num_requests, seed)
    reqs = build_requests(loaded)
    cal = CalibrationSource(loaded)
    variants: list[tuple[str, LoadedConfig, str]] = [(n, loaded, n) for n in policies]
    if ablations and label == "overloaded":
        variants += [(name, scenario(rate, num_requests, seed, over), "bid_price")
                     for name, over in ABLATIONS.items()]
    runs: dict[str, Run] = {}
    for name, cfg, policy in variants:
        t0 = time.perf_counter()
        res = simulate(cfg, policy, reqs, calibration=cal)
        counts = np.bincount(res.instance[res.instance >= 0], minlength=4)
        runs[name] = Run(summarize(res), tuple(int(c) for c in counts))
        print(f"  {label:>10} seed {seed:<3} {name:<34} {time.perf_counter() - t0:6.1f} s",
              file=sys.stderr, flush=True)
    return runs


def run(num_requests: int, policies: Sequence[str], seeds: Sequence[int],
        ablations: bool, executor: Executor) -> Results:
    """Every (rate, seed) point by ``executor``, gathered by rate and policy in seed
    order."""
    points = [(label, rate, seed) for label, rate in RATES for seed in seeds]
    finished = itertools.count(1)

    def progress(i: int, _: dict[str, Run]) -> None:
        label, _rate, seed = points[i]
        print(f"[{next(finished)}/{len(points)}] {label} seed {seed} done", file=sys.stderr,
              flush=True)

    per_point = executor.run(
        run_point, [(label, rate, num_requests, seed, tuple(policies), ablations)
                    for label, rate, seed in points],
        on_done=progress, describe=lambda i: f"{points[i][0]} seed {points[i][2]}")
    out: Results = {label: {} for label, _ in RATES}
    for (label, _, _), runs in zip(points, per_point, strict=True):
        for name, r in runs.items():
            out[label].setdefault(name, []).append(r)
    return out


def change(runs: list[Run], base: list[Run], key: str) -> list[float]:
    """Per seed: the policy's figure over round robin's on the same seed, minus 1."""
    return [float(getattr(r.summary, key)) / float(getattr(b.summary, key)) - 1.0
            for r, b in zip(runs, base, strict=True)]


def mean_of(runs: list[Run], key: str) -> float:
    return spread([float(getattr(r.summary, key)) for r in runs])[0]


def table(results: Results, label: str, seeds: Sequence[int]) -> str:
    rows = results[label]
    base = rows["round_robin"]
    head = (f"{'policy':<34}{'mean EEL':>22}{'P95 EEL':>22}{'P99 EEL':>9}{'mean TTFT':>10}"
            f"{'tok/s':>8}{'served':>8}{'max/min':>8}")
    lines = [f"{label} ({dict(RATES)[label]:g} req/s), seeds {', '.join(map(str, seeds))}: "
             f"% change vs round_robin on the same seed, mean [min-max] over seeds "
             f"(round_robin: mean EEL {mean_of(base, 'eel_mean_s'):.2f} s, "
             f"P95 {mean_of(base, 'eel_p95_s'):.2f} s, tokens/s "
             f"{mean_of(base, 'throughput_tokens_per_s'):,.0f})",
             head, "-" * len(head)]
    order = sorted(rows, key=lambda n: spread(change(rows[n], base, "eel_mean_s"))[0])
    for name in order:
        runs = rows[name]
        cells = [_pct_spread(change(runs, base, key)) for _, key, _, _ in CHANGES[:2]]
        cells += [f"{spread(change(runs, base, key))[0] * 100:+.1f}%"
                  for _, key, _, _ in CHANGES[2:]]
        served = mean_of(runs, "served_fraction")
        worst = max(r.imbalance for r in runs)
        lines.append(f"{name:<34}{cells[0]:>22}{cells[1]:>22}{cells[2]:>9}{cells[3]:>10}"
                     f"{cells[4]:>8}{served:>8.3f}{worst:>8.2f}")
    return "\n".join(lines)


def _pct_spread(values: list[float]) -> str:
    """``mean% [min, max]`` of fractions over seeds."""
    mean, lo, hi = spread(values)
    return f"{mean * 100:+.1f}% [{lo * 100:+.1f}, {hi * 100:+.1f}]"


def balance_lines(results: Results) -> list[str]:
    out = []
    for label, rows in results.items():
        worst = {n: max(r.imbalance for r in runs) for n, runs in rows.items()}
        over = sorted(n for n, w in worst.items() if w > IMBALANCE_LIMIT)
        top = max(worst, key=lambda n: worst[n])
        out.append(f"{label}: requests per instance max/min <= {IMBALANCE_LIMIT} for every "
                   f"policy: {'met' if not over else 'missed by ' + ', '.join(over)} "
                   f"(largest {worst[top]:.2f}, {top})")
    return out


def as_json(results: Results, seeds: Sequence[int]) -> dict[str, Any]:
    cases = []
    for label, rate in RATES:
        rows = results[label]
        base = rows["round_robin"]
        policies = {}
        for name, runs in rows.items():
            per = np.mean([r.per_instance for r in runs], axis=0)
            policies[name] = {
                "mean_eel_s": mean_of(runs, "eel_mean_s"),
                "p95_eel_s": mean_of(runs, "eel_p95_s"),
                "p99_eel_s": mean_of(runs, "eel_p99_s"),
                "mean_ttft_s": mean_of(runs, "ttft_mean_s"),
                "tokens_per_s": mean_of(runs, "throughput_tokens_per_s"),
                "served_fraction": mean_of(runs, "served_fraction"),
                "requests_per_instance": [float(x) for x in per],
                "change_vs_round_robin": {
                    jkey: spread(change(runs, base, key))[0]
                    for _, key, jkey, _ in CHANGES},
                "change_vs_round_robin_min_max": {
                    jkey: list(spread(change(runs, base, key))[1:])
                    for _, key, jkey, _ in CHANGES[:2]},
                "max_over_min_requests_per_instance": max(r.imbalance for r in runs),
                "per_seed": [r.summary.as_json() for r in runs],
            }
        cases.append({"rate": rate, "label": label, "seeds": list(seeds),
                      "policies": policies})
    return {"cases": cases}


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(14, 4.8), constrained_layout=True)
    for ax, (label, rate) in zip(axes, RATES, strict=True):
        rows = {n: r for n, r in results[label].items() if n in REGISTRY.names()}
        base = rows["round_robin"]
        names = sorted(rows, key=lambda n: spread(change(rows[n], base, "eel_mean_s"))[0])
        x = np.arange(len(names))
        for j, (metric, key, _, _) in enumerate(CHANGES[:3]):
            stats = [spread(change(rows[n], base, key)) for n in names]
            mean = np.array([s[0] for s in stats]) * 100
            err = np.array([[s[0] - s[1], s[2] - s[0]] for s in stats]).T * 100
            ax.bar(x + (j - 1) * 0.27, mean, width=0.27, label=metric, yerr=err,
                   capsize=2, error_kw={"lw": 0.8})
        ax.axhline(0, color="black", lw=0.7)
        ax.set_xticks(x, names, rotation=45, ha="right")
        ax.set_ylabel("% change vs round_robin (bars: seed mean, whiskers: min-max)")
        ax.set_title(f"{label}: Poisson {rate:g} req/s, 4 x Llama-2-7B / A100")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="requests per rate and seed")
    ap.add_argument("--seeds", default=",".join(map(str, REPORT_SEEDS)),
                    help="comma-separated seeds (default: the report seeds)")
    ap.add_argument("--ablations", action="store_true",
                    help="also bid_price variants at the overloaded rate")
    add_quick_arg(ap, "600 requests, four policies, 1 seed")
    add_harness_args(ap, digest=True)
    ap.add_argument("--png", metavar="PATH", default="runs/olp_table.png",
                    help="bar chart (default runs/olp_table.png)")
    ap.add_argument("--workers", type=int, default=1,
                    help="points at a time in worker processes (default: 1, in this process)")
    add_executor_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    executor = executor_from(ap, args, args.workers)
    policies = REGISTRY.names()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.quick:
        args.requests, seeds = 600, seeds[:1]
        policies = ["round_robin", "least_outstanding", "power_of_two", "bid_price"]
    t0 = time.perf_counter()
    results = run(args.requests, policies, seeds, args.ablations, executor)
    for label, _ in RATES:
        print()
        print(table(results, label, seeds))
    print()
    for line in balance_lines(results):
        print(line)
    over = results["overloaded"]
    bid = spread(change(over["bid_price"], over["round_robin"], "eel_mean_s"))
    p95 = spread(change(over["bid_price"], over["round_robin"], "eel_p95_s"))
    print(f"bid_price overloaded: mean EEL {bid[0] * 100:+.1f}% [{bid[1] * 100:+.1f}% to "
          f"{bid[2] * 100:+.1f}%] (goal <= -50%), P95 EEL {p95[0] * 100:+.1f}% "
          f"[{p95[1] * 100:+.1f}% to {p95[2] * 100:+.1f}%] (goal <= -45%)")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot(results, Path(args.png))
    print(f"\nwrote {args.png}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_results(args.json, as_json(results, seeds), seeds)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
