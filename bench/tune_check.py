"""The profile ``olproute tune`` selected, on seeds it was not selected on: ``bid_price``
with ``runs/tune/selected.yaml`` against round robin and BEAR on the tuning run's
workload (``configs/tune/bear_pool.yaml``), on the report seeds.

    olproute tune --config configs/tune/bear_pool.yaml --grid configs/tune/grid.yaml \\
                  --jobs 2 --out runs/tune                  # selects on sim.seed (0)
    python bench/tune_check.py [--selected runs/tune/selected.yaml] [--seeds 10,11,12]
                               [--json PATH]

The sweep picks its point on the config's seed, a tuning seed (``TUNING_SEEDS`` of
``bench/common.py``), so its own figures for the selected point are optimistic: the best
of 72 draws on one seed. This script reports the selected profile on ``REPORT_SEEDS``,
each figure as its mean [min-max] over seeds. On each seed the three policies see the same
requests, predictions, calibration (a round-robin profiling run on the next seed) and
batch-time noise; ``round_robin`` and ``bear`` run with the config as it is (``bear`` in
its default constrained form reads only ``reward.cost_lambda``, which the profile keeps).

``bid_price`` refuses requests under the selected profile, so its latencies (over the
served requests) stand beside its served fraction, tokens/s over the arrival window, and
the P90 / P99 TTFT over all requests with a refused one counted as infinitely late.
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
    TUNING_SEEDS,
    add_harness_args,
    begin,
    fmt_spread,
    seed_figure,
    write_results,
)
from olproute.config.loader import LoadedConfig, load_config
from olproute.sim import metrics
from olproute.sim.scenario import CalibrationSource, build_requests, simulate

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tune" / "bear_pool.yaml"
POLICIES = ("round_robin", "bear", "bid_price")
# the table's rows: label, Summary field, scale, format
ROWS = (("served", "served_fraction", 1.0, "{:.3f}"),
        ("shed", "num_shed", 1.0, "{:.0f}"),
        ("tokens/s (arrivals)", "throughput_tokens_per_s", 1.0, "{:,.0f}"),
        ("OnTimeUtility", "on_time_utility", 1.0, "{:.3f}"),
        ("TTFT attainment (all)", "slo_attainment", 1.0, "{:.3f}"),
        ("TTFT mean ms (served)", "ttft_mean_s", 1e3, "{:.1f}"),
        ("TTFT p50 ms (served)", "ttft_p50_s", 1e3, "{:.1f}"),
        ("TTFT p99 ms (served)", "ttft_p99_s", 1e3, "{:.1f}"),
        ("TTFT p90 ms (all)", "ttft_p90_all_s", 1e3, "{:.1f}"),
        ("TTFT p99 ms (all)", "ttft_p99_all_s", 1e3, "{:.1f}"),
        ("EEL mean s (served)", "eel_mean_s", 1.0, "{:.2f}"),
        ("EEL p99 s (served)", "eel_p99_s", 1.0, "{:.2f}"),
        ("TPOT p99 ms (served)", "tpot_p99_s", 1e3, "{:.1f}"),
        ("preempted", "num_preemptions", 1.0, "{:.0f}"))


def run_seed(base: LoadedConfig, tuned: LoadedConfig, seed: int) -> dict[str, dict[str, Any]]:
    """The three policies on one seed's requests, with one calibration."""
    on_seed = base.with_updates(sim=base.config.sim.model_copy(update={"seed": seed}))
    tuned_seed = tuned.with_updates(sim=on_seed.config.sim)
    reqs = build_requests(on_seed)
    cal = CalibrationSource(on_seed)
    out: dict[str, dict[str, Any]] = {}
    for name in POLICIES:
        run = tuned_seed if name == "bid_price" else on_seed
        t0 = time.perf_counter()
        res = simulate(run, name, reqs, calibration=cal)
        s = metrics.summarize(res, run.profiles, run.config.reward.cost_lambda)
        out[name] = s.as_dict()
        print(f"  seed {seed} {name:<12} served {s.served_fraction:.3f} OnTimeU "
              f"{s.on_time_utility:.3f} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    return out


def _cell(values: list[float], fmt: str, scale: float) -> str:
    if all(np.isinf(v) for v in values):
        return "inf"
    return fmt_spread(values, fmt, scale)


def table(per_seed: list[dict[str, dict[str, Any]]]) -> str:
    """A row per figure, a column per policy; each cell mean [min-max] over seeds."""
    header = ["", *POLICIES]
    rows = [[label, *(_cell([float(r[p][key]) for r in per_seed], fmt, scale)
                      for p in POLICIES)] for label, key, scale, fmt in ROWS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt_row = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}"
                        for i, w in enumerate(widths))
    lines = [fmt_row.format(*header), "  ".join("-" * w for w in widths)]
    return "\n".join([*lines, *(fmt_row.format(*r) for r in rows)])


def summary(per_seed: list[dict[str, dict[str, Any]]], seeds: list[int],
            selected: Path) -> dict[str, Any]:
    """Per policy and figure: mean, min, max and the seeds' values (None for inf)."""
    return {"config": str(CONFIG.relative_to(REPO)), "selected": str(selected),
            "seeds": seeds, "policies": {
                p: {key: seed_figure([float(r[p][key]) for r in per_seed])
                    for _, key, _, _ in ROWS} for p in POLICIES}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--selected", type=Path, default=REPO / "runs" / "tune" / "selected.yaml",
                    help="the weight profile olproute tune wrote (default: %(default)s)")
    ap.add_argument("--seeds", default=",".join(map(str, REPORT_SEEDS)),
                    help="comma-separated seeds (default: the report seeds %(default)s)")
    add_harness_args(ap, digest=True)
    args = ap.parse_args()
    begin(args, ap)

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = load_config(CONFIG)
    tuned = load_config(CONFIG, [args.selected])
    if base.config.sim.seed in seeds:
        print(f"note: seed {base.config.sim.seed} is the one the sweep selected on",
              file=sys.stderr)
    t0 = time.perf_counter()
    per_seed = [run_seed(base, tuned, seed) for seed in seeds]
    shown = (args.selected.resolve().relative_to(REPO)
             if args.selected.resolve().is_relative_to(REPO) else args.selected)
    kind = ("report seeds" if set(seeds) <= set(REPORT_SEEDS)
            else "tuning seeds" if set(seeds) <= set(TUNING_SEEDS) else "seeds")
    print(f"{CONFIG.relative_to(REPO)}, {per_seed[0]['bid_price']['num_requests']} requests "
          f"per seed; bid_price with {shown}; {kind} {','.join(map(str, seeds))}"
          + (": mean [min-max]" if len(seeds) > 1 else ""))
    print(table(per_seed))
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_results(args.json, summary(per_seed, seeds, shown), seeds)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
