"""Objective weights move the bid-price router where they say: one workload, ``bid_price``
under four weight profiles, and a check that each moves its own metric the expected way
relative to the balanced profile.

    python bench/weights_table.py [--quick] [--json PATH] [--png PATH] [--seeds 10,11,12]
                                  [--requests N] [--rate QPS] [--workers N]
                                  [--executor {process,ray}] [--ray-address ADDR]

Seeds run in parallel worker processes (``--workers``), or as Ray tasks with ``--executor
ray`` (a local Ray of ``--workers`` CPUs, or the cluster at ``--ray-address``); the
figures are the same either way.

Workload: 4 x Llama-2-7B on A100-80GB (vLLM defaults), splitwise_conv prompt and output
lengths (shuffled), Poisson arrivals at 25 qps, BEAR TTFT targets, predicted lengths
+/-20% noisy. 25 qps is just past this pool's saturation: round_robin's mean TTFT is
0.18 s at 22 qps and 2.2 s at 24 (its queues grow without bound), and at 25 qps a
router that admits everything starts preempting (KV cache full) - the regime where the
objective has choices to make. Every profile runs on the same requests, predictions,
calibration and batch-time noise (per seed); the table shows each figure as its mean
[min-max] over the report seeds (``REPORT_SEEDS`` of ``bench/common.py``: 10, 11, 12),
and the checks count the seeds on which each profile's own metric moved the expected way
relative to balanced.

Three profiles refuse requests, so their latencies are over fewer requests than the
throughput profile's: every latency row stands beside the served fraction, tokens/s over
the arrival window (first to last arrival), and the P99 TTFT over all requests with a
refused one counted as infinitely late (inf when more than 1% are refused).

The profiles (sections of the run config; weights in docs/design.md section 1 units: sigma per
request, alpha per 1000 tokens, beta / gamma per 50 ms slot saved within the 30 s
horizon, zeta1 / zeta2 per indicator, delta per second of estimated TTFT):

- ``balanced``: a little of everything (per request, tokens, EEL and TTFT slots saved,
  the TTFT target indicator, TTFT penalty); a request no instance can start within its
  TTFT target is refused (admission shed, patience = the target).
- ``throughput``: tokens and requests served, almost no latency terms; nothing is
  refused - a request waits in the central buffer (patience 10 s) until an instance can
  start it, instead of over-committing an engine's KV cache. Expected: more tokens/s.
- ``mean_latency``: end-to-end latency saved (beta) and an EEL-within-10 s bonus (zeta1),
  some TTFT; shed. Expected: lower mean EEL.
- ``tail_ttft``: the TTFT indicator at a 250 ms threshold (zeta2), TTFT slots saved
  and a strong TTFT penalty; shed. Expected: lower P99 TTFT.

Where the values come from: the profiles were written from what each term does, then
checked on seeds 0-2 at 24-26 qps while writing this script
(docs/experiments/weights.md); the rate of 25 qps (just past round robin's saturation)
was set while writing it too, before the report seeds existed. Seeds 0-2 are tuning seeds now
(``TUNING_SEEDS``); no value was chosen on the report seeds, and the profiles are not
tuned per metric beyond that check.
"""

from __future__ import annotations

import argparse
import sys
import time
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
    fmt_spread,
    spread,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
RATE = 25.0

PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "balanced": {
        "reward": {"sigma": 1.0, "alpha": 0.5, "beta": 0.01, "gamma": 0.01,
                   "zeta1": 0.0, "zeta2": 1.0, "ttft_threshold_s": None, "delta": 1.0},
        "admission": {"mode": "shed", "patience_s": None, "max_waiting": 0},
    },
    "throughput": {
        "reward": {"sigma": 1.0, "alpha": 2.0, "beta": 0.0, "gamma": 0.0,
                   "zeta1": 0.0, "zeta2": 0.0, "delta": 0.1},
        "admission": {"mode": "defer", "patience_s": 10.0, "max_waiting": 0},
    },
    "mean_latency": {
        "reward": {"sigma": 1.0, "alpha": 0.0, "beta": 0.1, "gamma": 0.02,
                   "zeta1": 5.0, "eel_threshold_s": 10.0, "zeta2": 0.0, "delta": 2.0},
        "admission": {"mode": "shed", "patience_s": None, "max_waiting": 0},
    },
    "tail_ttft": {
        "reward": {"sigma": 1.0, "alpha": 0.0, "beta": 0.0, "gamma": 0.05,
                   "zeta1": 0.0, "zeta2": 10.0, "ttft_threshold_s": 0.25, "delta": 20.0},
        "admission": {"mode": "shed", "patience_s": None, "max_waiting": 0},
    },
}
# profile -> (metric key, +1 if it should rise relative to balanced, -1 if it should fall)
EXPECTED = {"throughput": ("throughput_tokens_per_s", +1),
            "mean_latency": ("eel_mean_s", -1),
            "tail_ttft": ("ttft_p99_s", -1)}
# the table's rows: label, Summary field, scale, format
METRICS = (("tokens/s (arrivals)", "throughput_tokens_per_s", 1.0, "{:,.0f}"),
           ("served", "served_fraction", 1.0, "{:.3f}"),
           ("mean EEL s (served)", "eel_mean_s", 1.0, "{:.2f}"),
           ("mean TTFT ms (served)", "ttft_mean_s", 1e3, "{:.0f}"),
           ("P99 TTFT ms (served)", "ttft_p99_s", 1e3, "{:.0f}"),
           ("P90 TTFT ms (all)", "ttft_p90_all_s", 1e3, "{:.0f}"),
           ("P99 TTFT ms (all)", "ttft_p99_all_s", 1e3, "{:.0f}"),
           ("TTFT attainment", "slo_attainment", 1.0, "{:.3f}"),
           ("shed", "num_shed", 1.0, "{:.0f}"),
           ("preempted", "num_preemptions", 1.0, "{:.0f}"))


def _loaded(rate: float, num_requests: int, seed: int, profile: dict[str, Any]) -> Any:
    from olproute.config.loader import DEFAULT_CONFIG, Config, LoadedConfig, load_profiles

    data: dict[str, Any] = {
        "instances": [{"name": "llama7b-a100", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4}],
        "workload": {"kind": "poisson", "rate_per_s": rate, "num_requests": num_requests,
                     "lengths_path": str(TRACE)},
        "slo": {"mode": "bear"},
        "prediction": {"mode": "noisy", "noise": 0.2},
        "sim": {"seed": seed},
        **profile,
    }
    return LoadedConfig(DEFAULT_CONFIG, Config.model_validate(data),
                        load_profiles(REPO / "configs" / "profiles.yaml"))


def run_seed(args: tuple[float, int, int]) -> dict[str, Any]:
    """Every profile on one seed's requests, with one shared calibration."""
    from olproute.sim import metrics
    from olproute.sim.scenario import CalibrationSource, build_requests, simulate

    rate, n, seed = args
    t0 = time.perf_counter()
    base = _loaded(rate, n, seed, {})
    calibration = CalibrationSource(base)
    reqs = build_requests(base)
    out = {}
    for name, profile in PROFILES.items():
        loaded = _loaded(rate, n, seed, profile)
        res = simulate(loaded, "bid_price", reqs, calibration=calibration)
        out[name] = metrics.summarize(res).as_dict()
        print(f"  seed {seed}: {name} done ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return {"seed": seed, "profiles": out, "wall_s": time.perf_counter() - t0}


def _values(results: list[dict[str, Any]], name: str, key: str) -> list[float]:
    return [float(r["profiles"][name][key]) for r in results]


def checks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per profile with an expectation: its metric's change against balanced (of the
    means over seeds) and the number of seeds on which it moved the expected way."""
    out: dict[str, Any] = {}
    for n, (key, sign) in EXPECTED.items():
        mine, ref = _values(results, n, key), _values(results, "balanced", key)
        change = float(np.mean(mine)) / float(np.mean(ref)) - 1.0
        per_seed = [a / b - 1.0 for a, b in zip(mine, ref, strict=True)]
        out[n] = {"metric": key, "expected": "up" if sign > 0 else "down",
                  "change_vs_balanced": change, "change_per_seed": per_seed,
                  "ok": sign * change > 0,
                  "seeds_ok": sum(sign * c > 0 for c in per_seed), "num_seeds": len(results)}
    return out


def _cell(values: list[float], fmt: str, scale: float) -> str:
    if all(np.isinf(v) for v in values):
        return "inf"
    return fmt_spread(values, fmt, scale)


def table(results: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The printed table (a row per figure, a column per profile, each cell mean
    [min-max] over seeds), the check lines, and the same as JSON-ready figures."""
    names = list(PROFILES)
    figures = {n: {key: dict(zip(("mean", "min", "max"),
                                 (None if not np.isfinite(v) else v
                                  for v in spread(_values(results, n, key))), strict=True))
                   for _, key, _, _ in METRICS} for n in names}
    found = checks(results)
    header = ["", *names]
    rows = [[label, *(_cell(_values(results, n, key), fmt, scale) for n in names)]
            for label, key, scale, fmt in METRICS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt_row = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}"
                        for i, w in enumerate(widths))
    lines = [fmt_row.format(*header), "  ".join("-" * w for w in widths)]
    lines += [fmt_row.format(*r) for r in rows]
    lines.append("")
    lines.append("own metric against balanced (change of the means; seeds on which it moved "
                 "the expected way):")
    for n, c in found.items():
        label = next(h for h, key, _, _ in METRICS if key == c["metric"])
        seeds = ", ".join(f"{x:+.1%}" for x in c["change_per_seed"])
        lines.append(f"  {'✓' if c['ok'] else '✗'} {n:<13} {label} {c['expected']}: "
                     f"{c['change_vs_balanced']:+.1%} ({c['seeds_ok']}/{c['num_seeds']} "
                     f"seeds; per seed {seeds})")
    return ("\n".join(line.rstrip() for line in lines) + "\n",
            {"figures": figures, "checks": found})


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(PROFILES)
    shown = [m for m in METRICS if m[1] in ("throughput_tokens_per_s", "served_fraction",
                                            "eel_mean_s", "ttft_p99_s", "slo_attainment")]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.8),
                             constrained_layout=True)
    x = np.arange(len(names))
    for ax, (label, key, scale, _) in zip(axes, shown, strict=True):
        per_seed = np.array([[r["profiles"][n][key] * scale for n in names] for r in results])
        ax.bar(x, per_seed.mean(axis=0), color=["grey", "tab:blue", "tab:green", "tab:red"])
        for row in per_seed:
            ax.plot(x, row, "k.", ms=4)
        if key == "ttft_p99_s":
            ax.set_yscale("log")
        else:
            lo, hi = per_seed.min(), per_seed.max()
            ax.set_ylim(lo - 0.15 * (hi - lo + 1e-9), hi + 0.15 * (hi - lo + 1e-9))
        ax.set_xticks(x, names, rotation=20)
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_arg(ap, "smoke run: 1 seed, 400 requests")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: the "
                    f"report seeds {','.join(map(str, REPORT_SEEDS))}; --quick: "
                    f"{REPORT_SEEDS[0]})")
    ap.add_argument("--requests", type=int, default=None, help="requests per seed (3000)")
    ap.add_argument("--rate", type=float, default=RATE, help="Poisson rate, qps")
    ap.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    add_executor_args(ap)
    add_harness_args(ap, digest=True)
    ap.add_argument("--png", metavar="PATH", default=None,
                    help="figure path (default docs/weights_table.png; quick: none)")
    args = ap.parse_args()
    begin(args, ap)
    executor = executor_from(ap, args, args.workers)

    default = REPORT_SEEDS[:1] if args.quick else REPORT_SEEDS
    seeds = [int(s) for s in (args.seeds or ",".join(map(str, default))).split(",")]
    n = args.requests or (400 if args.quick else 3000)
    t0 = time.perf_counter()
    finished: list[int] = []

    def progress(_: int, r: dict[str, Any]) -> None:
        finished.append(r["seed"])
        print(f"[{len(finished)}/{len(seeds)}] seed {r['seed']}: {r['wall_s']:.1f} s",
              file=sys.stderr, flush=True)

    results = executor.run(run_seed, [((args.rate, n, s),) for s in seeds],
                           on_done=progress, describe=lambda i: f"seed {seeds[i]}")
    results.sort(key=lambda r: r["seed"])
    text, summary = table(results)
    print(f"bid_price on 4 x Llama-2-7B / A100, splitwise_conv lengths, Poisson "
          f"{args.rate:g} qps, {n} requests; mean [min-max] over seeds "
          f"{','.join(map(str, seeds))}")
    print(text)
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    png = args.png or (None if args.quick else str(REPO / "docs" / "weights_table.png"))
    if png:
        plot(results, Path(png), f"bid_price weight profiles, 4 x Llama-2-7B / A100, "
             f"Poisson {args.rate:g} qps (bars: mean; dots: seeds)")
    if args.json:
        write_results(args.json, {
            "rate_qps": args.rate, "num_requests": n, "seeds": seeds, "profiles": PROFILES,
            "summary": summary,
            "per_seed": [{**r, "profiles": {k: _finite(v) for k, v in r["profiles"].items()}}
                         for r in results],
        }, seeds)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf or NaN: None stands for them."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v
            for k, v in d.items()}


if __name__ == "__main__":
    main()
