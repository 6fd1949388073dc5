"""Disaggregated prefill/decode pools (issue 9; the Calibrate-then-Route setup): goodput,
served fraction, tokens/s, P99 TTFT (over the served requests and over all of them) and
P99 TPOT of every pool-routing policy on three mixed, bursty workloads, and the
scarcity case.

    python bench/pd_table.py [--json PATH] [--png PATH] [--duration S] [--seeds 10,11,12]
                             [--workers N] [--executor {process,ray}] [--ray-address ADDR]
    python bench/pd_table.py --find-rates [--tune-seeds 0]      # the RATES below
    python bench/pd_table.py --check-step-size [--tune-seeds 0,1,2]

It also times every routing decision (``decide``, perf_counter; the simulator calls it
as the server does; price updates are off the request path and not included).

Each (case, seed) of the table is a point of its own: by default they run one after
another in this process; ``--workers N`` runs N at a time in worker processes,
``--executor ray`` as Ray tasks (a local Ray of N CPUs, or the cluster at
``--ray-address``). Every figure is the same either way but the decision times, which are
timed in whichever process runs the point, with the others' load beside it: read them
from a run with one worker.

The pools of ``configs/pd.yaml``: 2 prefill + 4 decode Qwen2.5-3B engines on A40s, 60k
KV tokens per decode engine, KV moved over 12.5 GB/s with 1 ms latency. Two SLO classes
drawn half and half: tight (TTFT 175 ms, TPOT 39.7 ms) and loose (3x). Goodput is the
fraction of all requests (shed ones included) that meet both targets of their class.

Workload mixes (lengths sampled from the traces in ``data/traces``; arrivals MMPP-2 with
rate ratio 3, BEAR paper App. B):
- chat-like: 80% splitwise_conv, 20% splitwise_code requests;
- document-like: 60% arxiv summarization, 40% splitwise_conv;
- reasoning-like: splitwise_conv prompts with 4x their outputs (no public reasoning trace
  is at hand, so long outputs are made by stretching chat ones).

Each mix runs at the arrival rate where round robin is mid-collapse: its goodput 80% of
what it reaches at 1 req/s (``--find-rates`` bisects for it on a tuning seed and prints
the rates).
Scarcity: 1 prefill + 2 decode engines on the chat-like mix at the same per-engine load, where the
Calibrate-then-Route paper's greedy learned router collapsed below round robin.

Seeds: the table reports ``REPORT_SEEDS`` (``bench/common.py``), the mean with the
min-max over seeds. The constants it runs with were chosen on tuning seeds, never on
these: the RATES on seed 0 (``--find-rates``), ``prices.step_size`` of
``configs/pd.yaml`` on seed 0 (``--check-step-size`` rechecks it on tuning seeds). On
each (case, seed) every policy sees the same requests, predictions, calibration and
batch-time noise, and its generator is that seed's policy stream.

Predicted output lengths carry +/-20% uniform noise. Batch-time calibration for the
estimating policies (``bid_price``, ``calibrated_cost``) comes from a round-robin
profiling run of ``configs/pd.yaml``'s own workload on seed 1 (the config's seed + 1,
a tuning seed), once per pool shape, as in operation. ``bid_price`` runs with
``configs/weights/goodput.yaml`` (a reward that counts on-time first tokens) and
``admission: shed``.

A policy that refuses requests has its served-request latency measured over another set
than one that serves all: every latency column stands beside the served fraction and
tokens/s (over the arrival window), and beside the P90 / P99 TTFT over all requests, a
refused one counted as infinitely late (``inf`` when the quantile reaches one).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import (
    REPORT_SEEDS,
    TUNING_SEEDS,
    add_executor_args,
    add_harness_args,
    begin,
    executor_from,
    fmt_spread,
    parse_seeds,
    seed_figure,
    write_results,
)
from olproute.config.loader import LoadedConfig, load_config
from olproute.operator.executors import Executor
from olproute.sim import metrics
from olproute.sim import workloads as wl
from olproute.sim.scenario import CalibrationSource, make_cluster, make_policy
from olproute.types import Decision, Request, RoutingContext

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
BASELINES = ("round_robin", "least_outstanding", "least_tokens", "calibrated_cost")
# bid_price_route: the same weights without admission control (admission: defer with
# patience 0, so every request goes at once to its best pair): what the routing alone does
POLICIES = (*BASELINES, "bid_price", "bid_price_route")
MIXES = ("chat", "document", "reasoning")
SCARCITY = "scarcity 1P+2D"
# arrival rates (req/s) where round robin is mid-collapse: `--find-rates` on seed 0 (a
# tuning seed); rerun after issue 13's changes, it gives the same rates
RATES = {"chat": 7.06, "document": 4.62, "reasoning": 6.52}
MID_COLLAPSE = 0.8   # round robin's goodput at that rate, relative to light load
# the dual step sizes `--check-step-size` compares (configs/pd.yaml uses 0.1)
STEP_SIZES = (2.0, 0.5, 0.1, 0.02)
# per run: key in the JSON and the rows below, Summary field
FIGURES = (("goodput", "goodput"), ("served_fraction", "served_fraction"),
           ("tokens_per_s", "throughput_tokens_per_s"),
           ("p99_ttft_s_served", "ttft_p99_s"), ("p90_ttft_s_all", "ttft_p90_all_s"),
           ("p99_ttft_s_all", "ttft_p99_all_s"), ("p99_tpot_s", "tpot_p99_s"))
# the printed columns: header, key, format, scale
COLUMNS = (("goodput", "goodput", "{:.3f}", 1.0),
           ("served", "served_fraction", "{:.3f}", 1.0),
           ("tokens/s (arrivals)", "tokens_per_s", "{:,.0f}", 1.0),
           ("P99 TTFT served s", "p99_ttft_s_served", "{:.2f}", 1.0),
           ("P90 TTFT all s", "p90_ttft_s_all", "{:.2f}", 1.0),
           ("P99 TTFT all s", "p99_ttft_s_all", "{:.2f}", 1.0),
           ("P99 TPOT ms", "p99_tpot_s", "{:.0f}", 1e3))

Case = tuple[str, str, float, LoadedConfig, CalibrationSource]
Results = dict[str, dict[str, list[dict[str, float]]]]   # case -> policy -> per seed


def _lengths(name: str) -> tuple[np.ndarray, np.ndarray]:
    files = {"conv": "splitwise_conv.csv", "code": "splitwise_code.csv",
             "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"}
    return wl.read_lengths_csv(TRACES / files[name])


def mix_lengths(mix: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs of a workload mix, sampled with replacement."""
    parts = {"chat": (("conv", 0.8), ("code", 0.2)),
             "document": (("arxiv", 0.6), ("conv", 0.4)),
             "reasoning": (("conv", 1.0),)}[mix]
    source = rng.choice(len(parts), size=n, p=[w for _, w in parts])
    prompt = np.empty(n, dtype=np.int64)
    decode = np.empty(n, dtype=np.int64)
    for k, (name, _) in enumerate(parts):
        p, d = _lengths(name)
        idx = np.flatnonzero(source == k)
        pick = rng.integers(0, len(p), size=idx.size)
        prompt[idx], decode[idx] = p[pick], d[pick]
    if mix == "reasoning":
        decode = decode * 4
    return prompt, decode


def mix_requests(loaded: LoadedConfig, mix: str, rate: float, duration_s: float,
                 seed: int) -> list[Request]:
    """MMPP-2 arrivals at ``rate`` for ``duration_s``, mix lengths, SLO classes, noisy
    predicted lengths; one seed stream per purpose. The pools run one model, so the one
    predicted length is every pool's."""
    kids = np.random.SeedSequence([seed, MIXES.index(mix)]).spawn(4)
    arr_rng, len_rng, slo_rng, pred_rng = (np.random.default_rng(k) for k in kids)
    n = int(np.ceil(rate * duration_s * 1.2))
    arrivals = wl.mmpp2_arrivals(rate, 3.0, n, arr_rng).arrival_s
    arrivals = arrivals[arrivals < duration_s]
    prompt, decode = mix_lengths(mix, len(arrivals), len_rng)
    trace = wl.lengths_with_arrivals(prompt, decode, arrivals)
    slo = [wl.SloClass(c.name, c.ttft_ms / 1e3, c.tpot_ms / 1e3, c.weight)
           for c in loaded.config.slo.classes]
    idx = wl.assign_slo_classes(len(arrivals), slo, slo_rng)
    predicted = wl.predicted_decode_tokens(trace.decode_tokens, 0.2, pred_rng)
    return wl.build_requests(trace, np.array([slo[i].ttft_s for i in idx]), predicted,
                             np.array([slo[i].tpot_s for i in idx]),
                             [slo[i].name for i in idx])


def pools(loaded: LoadedConfig, num_prefill: int, num_decode: int) -> LoadedConfig:
    insts = loaded.config.instances
    return loaded.with_updates(instances=(
        insts[0].model_copy(update={"replicas": num_prefill}),
        insts[1].model_copy(update={"replicas": num_decode})))


def run_one(loaded: LoadedConfig, policy: str, reqs: list[Request],
            cal: CalibrationSource, seed: int) -> dict[str, float]:
    """One simulation (as ``simulate`` runs it on ``seed``: that seed's policy stream and
    batch-time noise), every ``decide`` call timed."""
    pol = make_policy(loaded, policy, seed, calibration=cal)
    times: list[float] = []
    inner = pol.decide

    def timed(ctx: RoutingContext) -> Decision:
        t = time.perf_counter()
        d = inner(ctx)
        times.append(time.perf_counter() - t)
        return d

    pol.decide = timed  # type: ignore[method-assign]
    cluster = make_cluster(loaded, pol, seed)
    t0 = time.perf_counter()
    res = cluster.run(reqs)
    d = metrics.summarize(res).as_dict()
    us = np.array(times) * 1e6
    return {**{key: float(d[field]) for key, field in FIGURES},
            "shed": float(res.shed.mean()), "seconds": time.perf_counter() - t0,
            "decide_p50_us": float(np.percentile(us, 50)),
            "decide_p99_us": float(np.percentile(us, 99))}


def bid_price_config(loaded: LoadedConfig, route_only: bool = False,
                     step_size: float | None = None) -> LoadedConfig:
    """``loaded`` with the goodput weight profile merged over it; ``route_only``: no
    admission control (defer at once); ``step_size``: another dual step."""
    from olproute.config.profiles import apply_profiles

    cfg = apply_profiles(loaded.config, [REPO / "configs" / "weights" / "goodput.yaml"])
    if route_only:
        cfg = cfg.model_copy(update={"admission": cfg.admission.model_copy(
            update={"mode": "defer", "patience_s": 0.0})})
    if step_size is not None:
        cfg = cfg.model_copy(update={"prices": cfg.prices.model_copy(
            update={"step_size": step_size})})
    return LoadedConfig(loaded.path, cfg, loaded.profiles, loaded.weights)


def find_rate(loaded: LoadedConfig, mix: str, duration_s: float, cal: CalibrationSource,
              seeds: Sequence[int], lo: float = 1.0, hi: float = 40.0) -> float:
    """Bisect the rate at which round robin's goodput is MID_COLLAPSE x its goodput at
    ``lo`` req/s, both as means over ``seeds`` (tuning seeds): some requests miss their
    targets even on idle pools (a long prompt cannot be prefilled in 175 ms), so collapse
    is judged against light load."""
    def goodput(rate: float) -> float:
        return float(np.mean([run_one(loaded, "round_robin",
                                      mix_requests(loaded, mix, rate, duration_s, seed),
                                      cal, seed)["goodput"] for seed in seeds]))

    target = MID_COLLAPSE * goodput(lo)
    print(f"  {mix:<10} light load {lo:g} req/s: target goodput {target:.3f}", flush=True)
    for _ in range(9):
        mid = 0.5 * (lo + hi)
        g = goodput(mid)
        print(f"  {mix:<10} {mid:6.2f} req/s: round_robin goodput {g:.3f}", flush=True)
        lo, hi = (mid, hi) if g > target else (lo, mid)
    return round(0.5 * (lo + hi), 2)


def check_step_size(base: LoadedConfig, cal: CalibrationSource, seeds: Sequence[int],
                    duration_s: float) -> str:
    """bid_price's goodput on the three mixes at each of STEP_SIZES, on ``seeds``: the
    table configs/pd.yaml's step size was chosen from (mean over mixes, then over seeds)."""
    per: dict[float, list[float]] = {x: [] for x in STEP_SIZES}
    for seed in seeds:
        reqs = {m: mix_requests(base, m, RATES[m], duration_s, seed) for m in MIXES}
        for x in STEP_SIZES:
            run = bid_price_config(base, step_size=x)
            g = [run_one(run, "bid_price", reqs[m], cal, seed)["goodput"] for m in MIXES]
            per[x].append(float(np.mean(g)))
            print(f"  seed {seed} step_size {x:g}: goodput " + ", ".join(
                f"{m} {v:.3f}" for m, v in zip(MIXES, g, strict=True)), flush=True)
    lines = [f"bid_price mean goodput over the three mixes, by prices.step_size; seeds "
             f"{','.join(map(str, seeds))}: mean [min-max]"]
    lines += [f"  step_size {x:<5g} {fmt_spread(v)}" for x, v in per.items()]
    best = max(STEP_SIZES, key=lambda x: float(np.mean(per[x])))
    lines.append(f"  best on these seeds: {best:g}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_harness_args(ap, digest=True)
    ap.add_argument("--png", type=Path, help="goodput, served fraction and P99 TTFT")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    ap.add_argument("--seeds", type=parse_seeds, default=REPORT_SEEDS,
                    help="comma-separated seeds reported (default: the report seeds "
                         f"{','.join(map(str, REPORT_SEEDS))})")
    ap.add_argument("--find-rates", action="store_true",
                    help="bisect each mix's rate on --tune-seeds (mean goodput over them)")
    ap.add_argument("--check-step-size", action="store_true",
                    help=f"bid_price's goodput at step sizes {STEP_SIZES} on --tune-seeds")
    ap.add_argument("--tune-seeds", type=parse_seeds, default=None,
                    help="tuning seeds for --find-rates (default 0) and --check-step-size "
                         "(default 0,1,2)")
    ap.add_argument("--workers", type=int, default=1,
                    help="table points at a time in worker processes (default: 1, in this "
                         "process; decision times are read from such a run)")
    add_executor_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    executor = executor_from(ap, args, args.workers)

    t_start = time.perf_counter()
    base = load_config(REPO / "configs" / "pd.yaml")
    cal = CalibrationSource(base)
    if args.find_rates or args.check_step_size:
        tune = args.tune_seeds or ((0,) if args.find_rates else (0, 1, 2))
        if set(tune) - set(TUNING_SEEDS):
            ap.error(f"--tune-seeds must be tuning seeds ({TUNING_SEEDS}), got {tune}")
        if args.find_rates:
            rates = {m: find_rate(base, m, args.duration, cal, tune) for m in MIXES}
            print(f"RATES = {rates}  (seeds {','.join(map(str, tune))})")
        else:
            print(check_step_size(base, cal, tune, args.duration))
        print(f"wall time {time.perf_counter() - t_start:.0f} s")
        return
    if set(args.seeds) & set(TUNING_SEEDS):
        print(f"note: seeds {sorted(set(args.seeds) & set(TUNING_SEEDS))} are tuning seeds",
              file=sys.stderr)
    small = pools(base, 1, 2)
    cases: list[Case] = [(m, m, RATES[m], base, cal) for m in MIXES]
    cases.append((SCARCITY, "chat", RATES["chat"] / 2, small, CalibrationSource(small)))
    for *_, c in cases:
        t0 = time.perf_counter()
        c()
        print(f"calibrated ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    results = run_cases(cases, args.seeds, args.duration, executor)
    s = summary(results, cases, args.seeds, args.duration)
    print()
    print(render(results, s))
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        write_results(args.json, s, args.seeds)
        print(f"wrote {args.json}")
    if args.png:
        plot(s, args.png)
        print(f"wrote {args.png}")


def run_point(case: Case, seed: int, duration_s: float) -> dict[str, dict[str, float]]:
    """Every policy on one (case, seed): the same requests, calibration and seed."""
    label, mix, rate, loaded, c = case
    variants = {"bid_price": bid_price_config(loaded),
                "bid_price_route": bid_price_config(loaded, route_only=True)}
    reqs = mix_requests(loaded, mix, rate, duration_s, seed)
    out: dict[str, dict[str, float]] = {}
    for p in POLICIES:
        r = out[p] = run_one(variants.get(p, loaded), p.removesuffix("_route"), reqs, c, seed)
        print(f"  {label:<15} seed {seed} {p:<18} goodput {r['goodput']:.3f} served "
              f"{r['served_fraction']:.3f} ({r['seconds']:.1f} s)", file=sys.stderr,
              flush=True)
    return out


def run_cases(cases: Sequence[Case], seeds: Sequence[int], duration_s: float,
              executor: Executor) -> Results:
    """Every policy on every (case, seed), the (case, seed) points by ``executor``, with
    progress on stderr."""
    points = [(case, seed) for case in cases for seed in seeds]
    finished, t0 = itertools.count(1), time.perf_counter()

    def progress(i: int, _: dict[str, dict[str, float]]) -> None:
        (label, *_), seed = points[i]
        print(f"[{next(finished):>2}/{len(points)}] {label} seed {seed} done "
              f"({time.perf_counter() - t0:.0f} s in)", file=sys.stderr, flush=True)

    per_point = executor.run(run_point, [(case, seed, duration_s) for case, seed in points],
                             on_done=progress,
                             describe=lambda i: f"{points[i][0][0]} seed {points[i][1]}")
    results: Results = {label: {p: [] for p in POLICIES} for label, *_ in cases}
    for ((label, *_), _), runs in zip(points, per_point, strict=True):
        for p, r in runs.items():
            results[label][p].append(r)
    return results


def plot(s: dict[str, Any], path: Path) -> None:
    """Three panels, one group of bars per case (mean over seeds, min-max as error bars):
    goodput, served fraction, and P99 TTFT of the served requests (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(s["cases"])
    panels = (("goodput", "goodput (both SLOs met, of all requests)"),
              ("served_fraction", "served fraction"),
              ("p99_ttft_s_served", "P99 TTFT of the served requests (s, log)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4.4))
    width = 0.8 / len(POLICIES)
    x = np.arange(len(cases))
    for k, p in enumerate(POLICIES):
        for ax, (key, _) in zip(axes, panels, strict=True):
            figs = [s["cases"][c]["policies"][p][f"{key}_spread"] for c in cases]
            mean = np.array([f["mean"] for f in figs])
            err = np.array([[f["mean"] - f["min"], f["max"] - f["mean"]] for f in figs]).T
            ax.bar(x + (k - (len(POLICIES) - 1) / 2) * width, mean, width, label=p,
                   yerr=err, capsize=1.5, error_kw={"lw": 0.6})
    labels = [f"{c}\n{s['cases'][c]['rate_per_s']:g} req/s" for c in cases]
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    for ax, key in zip(axes[:2], ("goodput", "served_fraction"), strict=True):
        lowest = min(s["cases"][c]["policies"][p][f"{key}_spread"]["min"]
                     for c in cases for p in POLICIES)
        ax.set_ylim(np.floor(10 * lowest - 0.5) / 10, 1.01)
    axes[2].set_yscale("log")
    axes[2].axhline(0.175, color="k", lw=0.8, ls=":")
    axes[2].axhline(0.525, color="k", lw=0.8, ls="--")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(POLICIES), fontsize=9)
    fig.suptitle("Disaggregated pools (2 prefill + 4 decode Qwen2.5-3B / A40): bid_price "
                 f"against the baselines; seeds {','.join(map(str, s['seeds']))} (bars: mean, "
                 "whiskers: min-max); dotted / dashed: tight / loose TTFT")
    fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _per_seed(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows]




def summary(results: Results, cases: Sequence[Case], seeds: Sequence[int],
            duration_s: float) -> dict[str, Any]:
    """Everything the table says, as JSON: each figure per case and policy as its mean
    over seeds (None when infinite) with ``*_spread`` (min, max, per seed)."""
    out: dict[str, Any] = {"duration_s": duration_s, "seeds": list(seeds), "cases": {}}
    keys = [k for k, _ in FIGURES] + ["shed", "decide_p50_us", "decide_p99_us"]
    for label, mix, rate, *_ in cases:
        pols: dict[str, Any] = {}
        for p, rows in results[label].items():
            figs = {k: seed_figure(_per_seed(rows, k)) for k in keys}
            pols[p] = {**{k: f["mean"] for k, f in figs.items()},
                       **{f"{k}_spread": f for k, f in figs.items()}}
        out["cases"][label] = {"mix": mix, "rate_per_s": rate, "policies": pols}
    # per seed: each policy's goodput averaged over the three mixes
    mean3 = {p: [float(np.mean([results[m][p][i]["goodput"] for m in MIXES]))
                 for i in range(len(seeds))] for p in POLICIES}
    best = max(BASELINES, key=lambda p: float(np.mean(mean3[p])))
    gain = [100.0 * (b - a) for a, b in zip(mean3[best], mean3["bid_price"], strict=True)]
    scar = results[SCARCITY]
    scar_gain = [100.0 * (b["goodput"] - a["goodput"])
                 for a, b in zip(scar["round_robin"], scar["bid_price"], strict=True)]
    out["mean_goodput_three_mixes"] = {p: seed_figure(v) for p, v in mean3.items()}
    out["best_baseline"] = best
    out["bid_price_minus_best_points"] = seed_figure(gain)
    out["scarcity_bid_price_minus_round_robin_points"] = seed_figure(scar_gain)
    out["goals"] = {"bid_price_minus_best_at_least_3_points": float(np.mean(gain)) >= 3.0,
                    "scarcity_bid_price_at_least_round_robin": float(np.mean(scar_gain)) >= 0.0}
    return out


def render(results: Results, s: dict[str, Any]) -> str:
    """One block per case, one row per policy, each figure ``mean [min-max]`` over seeds;
    then decision times and the two goals."""
    seeds = s["seeds"]
    lines = textwrap.wrap(
        f"{len(seeds)} seeds ({','.join(map(str, seeds))}), {s['duration_s']:g} s of "
        "arrivals each; every figure: mean [min-max] over seeds. goodput: both SLOs met, of "
        "all requests; served: fraction not refused; tokens/s over the arrival window; P99 "
        "TTFT served: over the served requests only; P90/P99 TTFT all: over every request, "
        "a refused one infinitely late (inf once the quantile reaches one)", 100)
    for label, case in s["cases"].items():
        rows = [[p, *(_cell(_per_seed(results[label][p], key), fmt, scale)
                      for _, key, fmt, scale in COLUMNS)] for p in POLICIES]
        header = [f"{label} @ {case['rate_per_s']:g} req/s", *(h for h, *_ in COLUMNS)]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        fmt_row = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}"
                            for i, w in enumerate(widths))
        lines += ["", fmt_row.format(*header), "  ".join("-" * w for w in widths)]
        lines += [fmt_row.format(*r) for r in rows]
    lines += ["", "decision time p50 / p99 (us) on the chat-like mix (mean over seeds), and "
              "p50 against least_outstanding's in the same run:"]
    chat = s["cases"]["chat"]["policies"]
    ref = chat["least_outstanding"]["decide_p50_us"]
    for p in POLICIES:
        p50, p99 = chat[p]["decide_p50_us"], chat[p]["decide_p99_us"]
        lines.append(f"  {p:<18} {p50:7.0f} / {p99:7.0f}   {p50 / ref:6.1f}x")
    lines += ["", "goodput averaged over the three mixes, per seed; mean [min-max]:"]
    lines += [f"  {p:<18} {_fmt(f, '{:.3f}')}" for p, f in s["mean_goodput_three_mixes"].items()]
    gain, scar = s["bid_price_minus_best_points"], s["scarcity_bid_price_minus_round_robin_points"]
    met = s["goals"]
    lines.append(f"bid_price - best baseline ({s['best_baseline']}), points: "
                 f"{_fmt(gain, '{:+.1f}')} (goal >= +3 on the mean: "
                 f"{'met' if met['bid_price_minus_best_at_least_3_points'] else 'MISSED'})")
    lines.append(f"{SCARCITY}: bid_price - round_robin, points: {_fmt(scar, '{:+.1f}')} "
                 f"(goal >= 0 on the mean: "
                 f"{'met' if met['scarcity_bid_price_at_least_round_robin'] else 'MISSED'})")
    return "\n".join(lines)


def _cell(values: Sequence[float], fmt: str, scale: float) -> str:
    """``mean [min-max]``, or ``inf`` alone when every seed's value is."""
    if values and all(np.isinf(v) for v in values):
        return "inf"
    return fmt_spread(values, fmt, scale)


def _fmt(f: dict[str, Any], fmt: str) -> str:
    return f"{fmt.format(f['mean'])} [{fmt.format(f['min'])} to {fmt.format(f['max'])}]"


if __name__ == "__main__":
    main()
