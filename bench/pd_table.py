"""Disaggregated prefill/decode pools (issue 9; the Calibrate-then-Route setup): goodput,
P99 TTFT and P99 TPOT of every pool-routing policy on three mixed, bursty workloads,
and the scarcity case.

    python bench/pd_table.py [--json PATH] [--png PATH] [--duration S] [--seeds N]
                             [--find-rates]

It also times every routing decision (``decide``, perf_counter; the simulator calls it
as the server does; price updates are off the request path and not included).

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
what it reaches at 1 req/s (``--find-rates`` bisects for it again and prints the rates).
Scarcity: 1 prefill + 2 decode engines on the chat-like mix at the same per-engine load, where the
Calibrate-then-Route paper's greedy learned router collapsed below round robin.

Predicted output lengths carry +/-20% uniform noise. Batch-time calibration for the
estimating policies (``bid_price``, ``calibrated_cost``) comes from a round-robin
profiling run of ``configs/pd.yaml``'s own workload (another seed), as in operation.
``bid_price`` runs with ``configs/weights/goodput.yaml`` (a reward that counts on-time
first tokens) and ``admission: shed``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from olproute.config import LoadedConfig, load_config
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
# arrival rates (req/s) where round robin is mid-collapse (--find-rates)
RATES = {"chat": 7.06, "document": 4.62, "reasoning": 6.52}
MID_COLLAPSE = 0.8   # round robin's goodput at that rate, relative to light load


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
    predicted lengths; one seed stream per purpose."""
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
            cal: CalibrationSource) -> dict[str, float]:
    """One simulation (as ``simulate`` runs it), every ``decide`` call timed."""
    pol = make_policy(loaded, policy, calibration=cal)
    times: list[float] = []
    inner = pol.decide

    def timed(ctx: RoutingContext) -> Decision:
        t = time.perf_counter()
        d = inner(ctx)
        times.append(time.perf_counter() - t)
        return d

    pol.decide = timed  # type: ignore[method-assign]
    cluster = make_cluster(loaded, pol)
    t0 = time.perf_counter()
    res = cluster.run(reqs)
    s = metrics.summarize(res)
    us = np.array(times) * 1e6
    return {"goodput": s.goodput, "ttft_p99_s": s.ttft_p99_s, "tpot_p99_s": s.tpot_p99_s,
            "shed": float(res.shed.mean()), "seconds": time.perf_counter() - t0,
            "decide_p50_us": float(np.percentile(us, 50)),
            "decide_p99_us": float(np.percentile(us, 99))}


def bid_price_config(loaded: LoadedConfig, route_only: bool = False) -> LoadedConfig:
    """``loaded`` with the goodput weight profile merged over it; ``route_only``: no
    admission control (defer at once)."""
    from olproute.weights import apply_profiles

    cfg = apply_profiles(loaded.config, [REPO / "configs" / "weights" / "goodput.yaml"])
    if route_only:
        cfg = cfg.model_copy(update={"admission": cfg.admission.model_copy(
            update={"mode": "defer", "patience_s": 0.0})})
    return LoadedConfig(loaded.path, cfg, loaded.profiles, loaded.weights)


def find_rate(loaded: LoadedConfig, mix: str, duration_s: float, cal: CalibrationSource,
              lo: float = 1.0, hi: float = 40.0) -> float:
    """Bisect the rate at which round robin's goodput is MID_COLLAPSE x its goodput at
    ``lo`` req/s (seed 0): some requests miss their targets even on idle pools (a long
    prompt cannot be prefilled in 175 ms), so collapse is judged against light load."""
    def goodput(rate: float) -> float:
        reqs = mix_requests(loaded, mix, rate, duration_s, 0)
        return run_one(loaded, "round_robin", reqs, cal)["goodput"]

    target = MID_COLLAPSE * goodput(lo)
    print(f"  {mix:<10} light load {lo:g} req/s: target goodput {target:.3f}", flush=True)
    for _ in range(9):
        mid = 0.5 * (lo + hi)
        g = goodput(mid)
        print(f"  {mix:<10} {mid:6.2f} req/s: round_robin goodput {g:.3f}", flush=True)
        lo, hi = (mid, hi) if g > target else (lo, mid)
    return round(0.5 * (lo + hi), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path, help="goodput and P99 TTFT per case and policy")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--find-rates", action="store_true")
    args = ap.parse_args()

    base = load_config(REPO / "configs" / "pd.yaml")
    cal = CalibrationSource(base)
    if args.find_rates:
        rates = {m: find_rate(base, m, args.duration, cal) for m in MIXES}
        print("RATES =", rates)
        return
    small = pools(base, 1, 2)
    small_cal = CalibrationSource(small)
    cases: list[tuple[str, str, float, LoadedConfig, CalibrationSource]] = [
        (m, m, RATES[m], base, cal) for m in MIXES]
    cases.append(("scarcity 1P+2D", "chat", RATES["chat"] / 2, small, small_cal))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for label, mix, rate, loaded, c in cases:
        results[label] = {p: [] for p in POLICIES}
        variants = {"bid_price": bid_price_config(loaded),
                    "bid_price_route": bid_price_config(loaded, route_only=True)}
        for seed in range(args.seeds):
            reqs = mix_requests(loaded, mix, rate, args.duration, seed)
            for p in POLICIES:
                r = run_one(variants.get(p, loaded), p.removesuffix("_route"), reqs, c)
                results[label][p].append(r)
                print(f"  {label:<15} seed {seed} {p:<18} goodput {r['goodput']:.3f} "
                      f"({r['seconds']:.1f} s)", flush=True)
    print()
    print(render(results, cases, args))
    if args.json:
        args.json.write_text(json.dumps(summary(results, cases, args), indent=2) + "\n")
    if args.png:
        plot(summary(results, cases, args), args.png)
        print(f"wrote {args.png}")


def plot(s: dict[str, Any], path: Path) -> None:
    """Two panels, one group of bars per case: goodput, and P99 TTFT (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(s["cases"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / len(POLICIES)
    x = np.arange(len(cases))
    for k, p in enumerate(POLICIES):
        for ax, key in zip(axes, ("goodput", "ttft_p99_s"), strict=True):
            ax.bar(x + (k - (len(POLICIES) - 1) / 2) * width,
                   [s["cases"][c]["policies"][p][key] for c in cases], width, label=p)
    labels = [f"{c}\n{s['cases'][c]['rate_per_s']:g} req/s" for c in cases]
    for ax, title in zip(axes, ("goodput (both SLOs met, of all requests)",
                                "P99 TTFT of served requests (s, log)"), strict=True):
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0.5, 1.0)
    axes[1].set_yscale("log")
    axes[1].axhline(0.175, color="k", lw=0.8, ls=":")
    axes[1].axhline(0.525, color="k", lw=0.8, ls="--")
    axes[0].legend(fontsize=8, ncol=2, loc="upper left")
    fig.suptitle("Disaggregated pools (2 prefill + 4 decode Qwen2.5-3B / A40): "
                 "bid_price against the baselines; dotted / dashed: tight / loose TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def summary(results: dict[str, dict[str, list[dict[str, float]]]],
            cases: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"duration_s": args.duration, "seeds": args.seeds, "cases": {}}
    for label, mix, rate, *_ in cases:
        out["cases"][label] = {"mix": mix, "rate_per_s": rate, "policies": {
            p: {k: _mean(rows, k) for k in ("goodput", "ttft_p99_s", "tpot_p99_s", "shed",
                                            "decide_p50_us", "decide_p99_us")}
            for p, rows in results[label].items()}}
    mean = {p: float(np.mean([_mean(results[m][p], "goodput") for m in MIXES]))
            for p in POLICIES}
    best = max(BASELINES, key=lambda p: mean[p])
    out["mean_goodput_three_mixes"] = mean
    out["best_baseline"] = best
    out["bid_price_minus_best_points"] = 100.0 * (mean["bid_price"] - mean[best])
    scar = results["scarcity 1P+2D"]
    out["scarcity_bid_price_minus_round_robin_points"] = 100.0 * (
        _mean(scar["bid_price"], "goodput") - _mean(scar["round_robin"], "goodput"))
    return out


def render(results: dict[str, dict[str, list[dict[str, float]]]], cases: list[Any],
           args: argparse.Namespace) -> str:
    s = summary(results, cases, args)
    lines = [f"goodput (both SLOs met, of all requests) / P99 TTFT / P99 TPOT; mean of "
             f"{args.seeds} seed(s), {args.duration:g} s of arrivals each"]
    head = f"{'policy':<18}" + "".join(f"{label + ' @' + format(rate, 'g'):>26}"
                                       for label, _, rate, *_ in cases)
    lines += [head, "-" * len(head)]
    for p in POLICIES:
        cells = []
        for label, *_ in cases:
            rows = results[label][p]
            cells.append(f"{_mean(rows, 'goodput'):.3f} / {_mean(rows, 'ttft_p99_s'):.2f}s"
                         f" / {_mean(rows, 'tpot_p99_s') * 1e3:.0f}ms")
        lines.append(f"{p:<18}" + "".join(f"{c:>26}" for c in cells))
    lines.append("")
    lines.append("decision time p50 / p99 (us) on the chat-like mix, and p50 against "
                 "least_outstanding's in the same run:")
    chat = results["chat"]
    base = _mean(chat["least_outstanding"], "decide_p50_us")
    for p in POLICIES:
        p50, p99 = _mean(chat[p], "decide_p50_us"), _mean(chat[p], "decide_p99_us")
        lines.append(f"  {p:<18} {p50:7.0f} / {p99:7.0f}   {p50 / base:6.1f}x")
    lines.append("")
    lines.append("mean goodput over the three mixes: " + ", ".join(
        f"{p} {v:.3f}" for p, v in s["mean_goodput_three_mixes"].items()))
    lines.append(f"bid_price - best baseline ({s['best_baseline']}): "
                 f"{s['bid_price_minus_best_points']:+.1f} points (goal >= +3)")
    lines.append(f"scarcity 1P+2D: bid_price - round_robin: "
                 f"{s['scarcity_bid_price_minus_round_robin_points']:+.1f} points (goal >= 0)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
