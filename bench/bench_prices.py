"""Shadow-price learning and bid-price decisions: how long they take.

    python bench/bench_prices.py [--json PATH] [--quick]

1. Time per projected dual step for G = 8 instances, H = 600 slots, three resources
   (batch, KV and compute), mini-batch 256 from a window of 2,000 requests with the
   default four delay options: the jitted JAX update (K steps in one call, timed for
   K = 5 and K = 50) against the NumPy implementation of the same step, measured in the
   same run. The JAX result is checked against NumPy first.
2. One whole price update as bid_price runs it at the defaults (``PriceBook.update``:
   the shift to now and K = 5 adagrad steps), and its share of one core at the default
   period of 0.5 s (issue 14's goals: <= 2 ms and <= 1%).
3. Decision time of ``bid_price`` for 8 instances with predictions and BEA included:
   8 Qwen3-8B / H100 instances under a synthetic workload at about 60% load, the
   LightGBM predictor trained here on synthetic prompts (prediction mode ``predictor``),
   every ``decide`` call timed with perf_counter (the simulator calls it exactly as the
   server will), the predictor's run on the request's text (``PoolPredictor``, as the
   server's router runs it when the request arrives) timed with its first decision; and the
   same with the lengths given (``noisy`` mode, no predictor), to
   separate the predictor's share (its featurisation grows with the prompt: the
   synthetic document prompts run to thousands of tokens). Price updates run off the
   request path and are not in these times.
   least_outstanding's decisions are timed the same way in the same run; the ratio is
   reported on short prompts and on 2k-token ones, the worse of the two (issue 19's
   goals: <= 10x at p50 and <= 20x at p99 with the predictor, <= 5x with lengths given).
4. One slot's pass over a buffer of 64 held requests on the same 8 instances, per
   ``release`` (``buffer_pass_times``; issue 16's goal: 2 ms, 4% of a 50 ms slot); the
   JSON's ``buffer_slot_ms`` is the median pass of the greedy by density.
5. Decision time by fleet size: 4, 16, 64 and 128 Llama-2-7B / A100 instances under
   Poisson arrivals at 4.25 req/s per instance, least_outstanding and bid_price in the
   same run (JSON ``scaling``); at 128, bid_price with ``admission.candidates`` d = 4, 8
   and 16 too, and what sampling costs in mean EEL and TTFT attainment against d = 128
   (JSON ``sampling_quality``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute.config.loader import Config, LoadedConfig, load_profiles
from olproute.config.schema import PriceConfig
from olproute.pricing.reward import NUM_RESOURCES
from olproute.pricing.step_jax import _build_jax_steps
from olproute.pricing.step_ref import Samples, dual_step_numpy, step_sizes

REPO = Path(__file__).resolve().parents[1]
G, H, W, S = 8, 600, 2000, 256


def _window(rng: np.random.Generator) -> Samples:
    """W random samples: decode intervals from up to 40 slots ahead, prefills of 1 to 4
    slots, rewards of the later delays a little lower than the delay-0 one."""
    smp = Samples.empty(W, G, PriceConfig().sample_delays_slots)
    smp.start[:] = rng.integers(0, 40, (W, G))
    smp.end[:] = np.minimum(smp.start + rng.integers(1, 400, (W, G)), H)
    smp.reward[:] = rng.uniform(0, 12, (W, G, 1)) * np.linspace(1.0, 0.7, len(smp.delays))
    smp.batch_a[:] = 1 / 256
    smp.kv_a[:] = rng.uniform(0, 0.02, (W, G))
    smp.kv_b[:] = rng.uniform(0, 2e-4, (W, G))
    smp.pre_lo[:] = rng.integers(0, 4, (W, G))
    smp.prefill_work[:] = rng.uniform(0, 4, (W, G))
    return smp


def dual_step_times(repeats: int) -> dict[str, float]:
    import jax

    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, (G, H, NUM_RESOURCES))
    c = rng.uniform(-0.2, 1, (G, H, NUM_RESOURCES))
    acc = np.zeros_like(p)
    smp = _window(rng)
    out: dict[str, float] = {}
    steps = _build_jax_steps()
    for k in (5, 50):
        idx = rng.integers(0, W, (k, S))
        mask = np.ones((k, S), dtype=bool)
        off = rng.integers(0, H, (k, S))
        etas = step_sizes(2.0, "constant", 0, k)
        ref, ref_acc = p, acc
        for j in range(k):
            ref, ref_acc = dual_step_numpy(ref, ref_acc, c, smp, idx[j], mask[j], off[j],
                                           400.0, float(etas[j]))
        args = (smp.arrays, smp.delays, idx, mask, off, 400.0, etas, 1.0)
        with jax.enable_x64(True):
            got = np.asarray(steps(p, acc, c, *args)[0])
            if not np.allclose(got, ref, rtol=1e-6, atol=1e-9):
                raise AssertionError("JAX and NumPy steps disagree")
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                steps(p, acc, c, *args)[0].block_until_ready()
                samples.append((time.perf_counter() - t0) / k)
        out[f"jax_K{k}_us"] = float(np.median(samples) * 1e6)
    samples = []
    for _ in range(max(repeats // 5, 5)):
        t0 = time.perf_counter()
        dual_step_numpy(p, acc, c, smp, idx[0], mask[0], off[0], 400.0, 2.0)
        samples.append(time.perf_counter() - t0)
    out["numpy_us"] = float(np.median(samples) * 1e6)
    return out


def update_times(repeats: int) -> dict[str, float]:
    """One price update as bid_price runs it (``PriceBook.update`` at the defaults: K = 5
    adagrad steps of mini-batch 256 on a full window of 2,000 samples with 4 delays, three
    resources, G = 8, H = 600, the shift to now included), and its share of one core at
    the default period (10 slots of 50 ms)."""
    from olproute.pricing.book import PriceBook
    from olproute.pricing.reward import sample_extent, usage_columns
    from olproute.types import InstanceSpec

    cfg = PriceConfig()
    spec = InstanceSpec(name="a", model="m", gpu="g", tensor_parallel=1, max_num_seqs=256,
                        max_num_batched_tokens=2048, block_size=16, num_kv_blocks=10_000)
    slot = 0.05
    book = PriceBook([spec] * G, slot, H, cfg, np.random.default_rng(0),
                     compute_budget=np.full(G, 600.0))
    rng = np.random.default_rng(1)
    for i in range(cfg.window):
        prompt, decode = int(rng.integers(100, 3000)), rng.uniform(50, 500, G)
        cols = usage_columns(prompt, decode, rng.uniform(0.05, 2.0, G), np.full(G, 0.03),
                             np.full(G, 256.0), np.full(G, 160_000.0), np.full(G, 600.0), slot,
                             H)
        book.observe_arrival(i * 0.03)
        book.add_sample(rng.uniform(5, 15, (G, len(cfg.sample_delays_slots))), cols,
                        sample_extent(cols, prompt, decode, np.full(G, 0.03),
                                       np.full(G, 600.0), slot))
    book.set_free_capacity(rng.uniform(0, 1, (G, H, NUM_RESOURCES)))
    period = cfg.period_slots * slot
    t = 60.0
    for _ in range(5):  # compile and warm up
        book.update(t)
        t += period
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        book.update(t)
        samples.append(time.perf_counter() - t0)
        t += period
    med = float(np.median(samples))
    return {"update_ms": med * 1e3, "core_share": med / period}


SHORT_MAX, LONG_RANGE = 256, (1500, 2500)   # prompt tokens: "short" and "2k-token" decisions


def decision_times(quick: bool, use_predictor: bool,
                   policy_name: str = "bid_price") -> dict[str, float]:
    """Decision times of one policy on the 8 Qwen3-8B / H100 instances (part 3), overall
    and for the decisions on short prompts (<= 256 tokens) and on prompts of about 2k
    tokens (1,500 to 2,500). With the predictor, it runs on each request's text when the
    request is first decided, timed with that decision (as the server runs it on each
    request when it arrives), not once over the workload."""
    from dataclasses import replace

    from olproute.predict import PoolPredictor, TrainConfig, train_and_evaluate
    from olproute.sim.prompts import generate_prompts, training_data
    from olproute.sim.scenario import (
        CalibrationSource,
        build_requests,
        make_cluster,
        make_policy,
    )

    profiles = load_profiles(REPO / "configs" / "profiles.yaml")
    traits = {n: (m.num_params, m.max_context_tokens) for n, m in profiles.models.items()}
    prompts = generate_prompts(2000 if quick else 6000, ["qwen3-8b"],
                               np.random.default_rng(1))
    predictor, _ = train_and_evaluate(training_data(prompts), traits, 0.2,
                                      TrainConfig(seed=1), progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        predictor.save(Path(tmp))
        base = {
            "instances": [{"name": "q8", "model": "qwen3-8b", "gpu": "h100", "replicas": 8}],
            "workload": {"kind": "synthetic", "rate_per_s": 24.0,
                         "num_requests": 1000 if quick else 4000},
            "prediction": ({"mode": "predictor", "model_dir": tmp} if use_predictor
                           else {"mode": "noisy"}),
        }
        loaded = LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(base),
                              profiles)
        cal = CalibrationSource(loaded)
        cal()
        policy = make_policy(loaded, policy_name, calibration=cal)
        pool = PoolPredictor(predictor, [s.model for s in loaded.specs])
        times, lengths = _timed(policy, pool if use_predictor else None)
        requests = build_requests(loaded)
        if use_predictor:
            # the simulator predicts a whole workload at once when it builds it; the
            # server predicts each request as it arrives: drop the batch's predictions
            # so that the predictor runs at each request's first decision, timed with it
            requests = [replace(r, predicted_decode_by_model=None,
                                predicted_quality_by_model=None) for r in requests]
        make_cluster(loaded, policy).run(requests)
    arr = np.array(times) * 1e6
    size = np.array(lengths)
    out = {"decisions": float(len(arr)), **_quantiles(arr)}
    for label, inside in (("short", size <= SHORT_MAX),
                          ("long", (size >= LONG_RANGE[0]) & (size <= LONG_RANGE[1]))):
        q = _quantiles(arr[inside])
        out.update({f"{label}_{k}": v for k, v in q.items()}, **{f"{label}_decisions":
                                                                  float(inside.sum())})
    return out


def _timed(policy: Any, pool: Any = None) -> tuple[list[float], list[int]]:
    """Wrap ``policy.decide`` to record each call's time and the request's prompt; with a
    ``PoolPredictor``, a request's first decision runs it on the request's text first
    (timed with the decision) and every decision of it reads those predictions."""
    from dataclasses import replace

    times: list[float] = []
    lengths: list[int] = []
    predicted: dict[int, Any] = {}
    inner = policy.decide

    def timed(ctx):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        if pool is not None:
            r = ctx.request
            req = predicted.get(r.request_id)
            if req is None:
                found = pool.predict(r.text, 1_000_000)
                req = predicted[r.request_id] = replace(
                    r, predicted_decode_tokens=found.decode_tokens,
                    predicted_decode_by_model=found.decode_by_model,
                    predicted_quality_by_model=found.quality_by_model)
            ctx = replace(ctx, request=req)
        d = inner(ctx)
        times.append(time.perf_counter() - t0)
        lengths.append(ctx.request.prompt_tokens)
        return d

    policy.decide = timed
    return times, lengths


def _quantiles(us: npt.NDArray[np.float64]) -> dict[str, float]:
    if us.size == 0:
        return {"p50_us": float("nan"), "p90_us": float("nan"), "p99_us": float("nan")}
    return {"p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99))}


def ratios_to_lor(bid: dict[str, float], lor: dict[str, float]) -> dict[str, float]:
    """bid_price's decision time over least_outstanding's (same run, same workload), on
    short and on 2k-token prompts: the worse of the two."""
    def worse(q: str) -> float:
        return max(bid[f"short_{q}"], bid[f"long_{q}"]) / lor[q]
    return {"p50": worse("p50_us"), "p99": worse("p99_us")}


SCALING = (4, 16, 64, 128)
SAMPLED = (4, 8, 16)      # admission.candidates at the largest fleet


def fleet_run(instances: int, policy_name: str, candidates: int | None,
              quick: bool) -> dict[str, float]:
    """One policy on ``instances`` Llama-2-7B / A100 engines under Poisson arrivals at
    4.25 req/s per instance (the Splitwise conversation lengths, noisy predictions):
    its decision times and what it delivered (mean EEL, TTFT attainment, served)."""
    from olproute.sim.metrics import summarize, ttft_s
    from olproute.sim.scenario import (
        CalibrationSource,
        build_requests,
        make_cluster,
        make_policy,
    )

    per = 25 if quick else 40
    data: dict[str, object] = {
        "instances": [{"name": "l7", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": instances}],
        "workload": {"kind": "poisson", "rate_per_s": 4.25 * instances,
                     "num_requests": max(per * instances, 400),
                     "lengths_path": str(REPO / "data" / "traces" / "splitwise_conv.csv")},
        "prediction": {"mode": "noisy"},
    }
    if candidates is not None:
        data["admission"] = {"candidates": candidates}
    loaded = LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                          load_profiles(REPO / "configs" / "profiles.yaml"))
    cal = CalibrationSource(loaded)
    cal()
    requests = build_requests(loaded)
    policy = make_policy(loaded, policy_name, calibration=cal)
    times, _ = _timed(policy)
    res = make_cluster(loaded, policy).run(requests)
    summary = summarize(res)
    target = np.array([r.ttft_target_s for r in requests])
    on_time = np.nan_to_num(ttft_s(res), nan=np.inf) <= target
    return {**_quantiles(np.array(times) * 1e6), "mean_eel_s": summary.eel_mean_s,
            "ttft_attainment": float(on_time.mean()),
            "served_fraction": summary.served_fraction}


def scaling(quick: bool) -> tuple[list[dict[str, float | None]], list[dict[str, float]]]:
    """Decision time by fleet size, least_outstanding and bid_price in the same run (the
    issue's ``scaling`` rows, one more at the largest fleet per sampled d), and what
    sampling d instances costs in quality there against scoring all of them."""
    rows: list[dict[str, float | None]] = []
    quality: list[dict[str, float]] = []
    for g in SCALING:
        lor = fleet_run(g, "least_outstanding", None, quick)
        bid = fleet_run(g, "bid_price", None, quick)
        rows.append({"instances": g, "lor_p50_us": lor["p50_us"],
                     "bid_price_p50_us": bid["p50_us"], "bid_price_p99_us": bid["p99_us"],
                     "candidates": None})
        print(f"  scaling: {g} instances done", flush=True)
    top = SCALING[-1]
    everyone = bid
    quality.append({"candidates": float(top), **everyone})
    for d in SAMPLED:
        run = fleet_run(top, "bid_price", d, quick)
        rows.append({"instances": top, "lor_p50_us": lor["p50_us"],
                     "bid_price_p50_us": run["p50_us"], "bid_price_p99_us": run["p99_us"],
                     "candidates": d})
        quality.append({"candidates": float(d), **run})
    return rows, quality


BUFFER = 64  # held requests in one pass (issue 16: 64 x 8 instances within 2 ms)
RELEASES = ("in_order", "density", "score", "assignment")
DEFAULT_JOINT = "density"   # the release buffer_slot_ms reports (the greedy by density)


def buffer_pass_times(quick: bool) -> dict[str, dict[str, float]]:
    """One slot's pass over a buffer of 64 held requests on 8 instances, per ``release``:
    the 8 Qwen3-8B / H100 instances of the decision benchmark under its workload (lengths
    given); at every 25th arrival the run pauses and the pass is timed on that arrival's
    context over 64 requests of the workload, each held for 10 to 100 ms, all of it
    (every decision drawn) for each release in turn from the same state (the policy's
    free capacity and what it has seen put back after each; ``in_order`` decides each
    request on the one context, as the simulator's one-by-one path would without the
    dispatches in between). Goal: 2 ms per pass (4% of a 50 ms slot)."""
    from dataclasses import replace

    from olproute.policies import Policy
    from olproute.sim.scenario import (
        CalibrationSource,
        build_requests,
        make_cluster,
        make_policy,
    )
    from olproute.types import Decision, Outcome, RoutingContext

    profiles = load_profiles(REPO / "configs" / "profiles.yaml")
    base = {"instances": [{"name": "q8", "model": "qwen3-8b", "gpu": "h100", "replicas": 8}],
            "workload": {"kind": "synthetic", "rate_per_s": 24.0,
                         "num_requests": 1000 if quick else 3000},
            "prediction": {"mode": "noisy"}}
    def loaded_with(release: str) -> LoadedConfig:
        data = {**base, "router": {"policy_params": {"bid_price": {"release": release}}}}
        return LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(data),
                            profiles)

    loaded = loaded_with("in_order")
    cal = CalibrationSource(loaded)
    cal()
    requests = build_requests(loaded)
    policies = {r: make_policy(loaded_with(r), "bid_price", calibration=cal)
                for r in RELEASES}
    driver = policies["in_order"]
    times: dict[str, list[float]] = {r: [] for r in RELEASES}
    rng = np.random.default_rng(2)

    class Timed(Policy):
        name = "bid_price"
        needs_snapshots = True
        tick_s = driver.tick_s

        def __init__(self) -> None:
            self.count = 0

        def decide(self, ctx: RoutingContext) -> Decision:
            self.count += 1
            if self.count % 25 == 0:
                self._time(ctx)
            return driver.decide(ctx)

        def observe(self, outcome: Outcome) -> None:
            driver.observe(outcome)

        def tick(self, now_s: float, snapshots: tuple) -> None:  # type: ignore[type-arg]
            for p in policies.values():
                p.tick(now_s, snapshots)

        def _time(self, ctx: RoutingContext) -> None:
            picks = rng.choice(len(requests), BUFFER, replace=False)
            held = [replace(requests[int(i)], request_id=10**7 + k,
                            arrival_s=ctx.now_s - float(rng.uniform(0.01, 0.1)))
                    for k, i in enumerate(picks)]
            for name, p in policies.items():
                free = None if p._free is None else p._free.copy()  # type: ignore[attr-defined]
                p._seen.update(r.request_id for r in held)  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                if name == "in_order":
                    for r in held:
                        p.decide(replace(ctx, request=r))
                else:
                    list(p.decide_held(held, lambda r: replace(ctx, request=r)))
                times[name].append(time.perf_counter() - t0)
                p._free = free  # type: ignore[attr-defined]
                p._seen.difference_update(r.request_id for r in held)  # type: ignore[attr-defined]

    make_cluster(loaded, Timed()).run(requests)
    out = {}
    for name, ts in times.items():
        arr = np.array(ts[2:]) * 1e3   # the first two passes warm up
        out[name] = {"passes": float(len(arr)), "p50_ms": float(np.percentile(arr, 50)),
                     "p99_ms": float(np.percentile(arr, 99))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_harness_args(ap)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and decisions")
    args = ap.parse_args()
    begin(args, ap)
    step = dual_step_times(10 if args.quick else 40)
    upd = update_times(20 if args.quick else 100)
    dec = decision_times(args.quick, use_predictor=True)
    bare = decision_times(args.quick, use_predictor=False)
    lor_pred = decision_times(args.quick, use_predictor=True, policy_name="least_outstanding")
    lor_bare = decision_times(args.quick, use_predictor=False,
                              policy_name="least_outstanding")
    with_pred, given = ratios_to_lor(dec, lor_pred), ratios_to_lor(bare, lor_bare)
    ratio = {"predictor_p50": with_pred["p50"], "predictor_p99": with_pred["p99"],
             "lengths_p50": given["p50"]}
    passes = buffer_pass_times(args.quick)
    scale, quality = scaling(args.quick)
    rows = [
        ("dual step, NumPy (us)", f"{step['numpy_us']:.0f}"),
        ("dual step, JAX, K = 5 per call (us/step)", f"{step['jax_K5_us']:.0f}"),
        ("dual step, JAX, K = 50 per call (us/step)", f"{step['jax_K50_us']:.0f}"),
        ("JAX speed-up over NumPy (K = 50)", f"{step['numpy_us'] / step['jax_K50_us']:.1f}x"),
        ("goal per step after jit (us)", "100"),
        ("price update per period, defaults (ms)", f"{upd['update_ms']:.2f}"),
        ("share of one core at the default period", f"{upd['core_share'] * 100:.2f}%"),
        ("goal per period / share of a core", "2 ms / 1%"),
        ("bid_price decisions timed", f"{dec['decisions']:.0f}"),
        ("decision p50 / p90 / p99 (us), LightGBM predictor",
         f"{dec['p50_us']:.0f} / {dec['p90_us']:.0f} / {dec['p99_us']:.0f}"),
        ("decision p50 / p90 / p99 (us), lengths given",
         f"{bare['p50_us']:.0f} / {bare['p90_us']:.0f} / {bare['p99_us']:.0f}"),
        ("goal p50 / p99 (us)", "200 / 400"),
        ("least_outstanding p50 (us), predictor / lengths given",
         f"{lor_pred['p50_us']:.1f} / {lor_bare['p50_us']:.1f}"),
        ("bid_price p50 on short / 2k-token prompts (us), predictor",
         f"{dec['short_p50_us']:.0f} / {dec['long_p50_us']:.0f}"),
        ("bid_price p50 on short / 2k-token prompts (us), lengths given",
         f"{bare['short_p50_us']:.0f} / {bare['long_p50_us']:.0f}"),
        ("bid_price / least_outstanding p50, predictor (worse prompt size)",
         f"{ratio['predictor_p50']:.1f}x   (goal <= 10x)"),
        ("bid_price / least_outstanding p99, predictor (worse prompt size)",
         f"{ratio['predictor_p99']:.1f}x   (goal <= 20x)"),
        ("bid_price / least_outstanding p50, lengths given (worse prompt size)",
         f"{ratio['lengths_p50']:.1f}x   (goal <= 5x)"),
        *((f"pass over {BUFFER} held x {G} instances, {name}: p50 / p99 (ms)",
           f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f} ({f['passes']:.0f} passes)")
          for name, f in passes.items()),
        ("goal per pass (ms)", "2"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 16}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    print("decision time by fleet size (Llama-2-7B / A100, 4.25 req/s per instance; "
          "goal: bid_price p50 <= 10x least_outstanding's)")
    print(f"{'instances':>9}  {'candidates':>10}  {'LOR p50 us':>10}  {'bid p50 us':>10}  "
          f"{'bid p99 us':>10}  {'ratio p50':>9}")
    for r in scale:
        print(f"{r['instances']:>9}  {r['candidates'] or 'all':>10}  {r['lor_p50_us']:>10.1f}  "
              f"{r['bid_price_p50_us']:>10.1f}  {r['bid_price_p99_us']:>10.1f}  "
              f"{r['bid_price_p50_us'] / r['lor_p50_us']:>8.1f}x")  # type: ignore[operator]
    print()
    print(f"sampling d of {SCALING[-1]} instances: what it costs in quality")
    print(f"{'d':>5}  {'mean EEL s':>10}  {'TTFT attainment':>15}  {'served':>7}")
    for q in quality:
        print(f"{q['candidates']:>5.0f}  {q['mean_eel_s']:>10.3f}  "
              f"{q['ttft_attainment']:>15.3f}  {q['served_fraction']:>7.3f}")
    if args.json:
        write_results(args.json,
            {"dual_step": step, "price_update": upd, "decision_with_predictor": dec,
             "decision_lengths_given": bare, "lor_with_predictor": lor_pred,
             "lor_lengths_given": lor_bare, "decision_ratio_to_lor": ratio,
             "period_ms": upd["update_ms"], "price_core_fraction": upd["core_share"],
             "scaling": scale, "sampling_quality": quality,
             "buffer_slot_ms": passes[DEFAULT_JOINT]["p50_ms"], "buffer_pass": passes})


if __name__ == "__main__":
    main()
