"""BEA estimator: speed per decision and accuracy in simulation.

    python bench/bench_bea.py [--json PATH] [--quick]

1. Time per estimate, the Python call and the snapshot marshalling included (engine
   state -> EngineSnapshot -> replay -> TtftEstimate), for one instance and for 8
   instances together, at 8 / 32 / 64 / 128 resident requests (Llama-2-7B / A100 engine
   limits; each engine kept in steady state at that many residents with splitwise_conv
   lengths, a batch in flight). Median of many repeats.
2. Accuracy on splitwise_conv rescaled to load 0.7 of a Qwen3-0.6B / H100 instance (the
   trace's arrivals compressed so its mean rate is 0.7 x the instance's saturation
   throughput, measured in this run), all 19,366 requests: BEA MAPE with oracle
   lengths and with +/-20% length noise, the 4-term batch-time model's MAPE, and the
   prefill-throughput estimator beside them. Calibration comes from a profiling run on
   another seed. Then the same noisy run with snapshots 0, 25, 100, 400 and 1000 ms old.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute.config.loader import Config, LoadedConfig, load_profiles
from olproute.estimate.bea import BeaEstimator
from olproute.estimate.calibration import InstanceCalibration
from olproute.sim.engine import FINISHED, SimEngine
from olproute.sim.estimate_eval import error_rows, run_estimate_eval
from olproute.sim.scenario import profile_calibration, saturation_profile
from olproute.sim.workloads import read_trace_csv
from olproute.types import InstanceSpec, Request, RoutingContext

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
STALENESS_MS = (0, 25, 100, 400, 1000)
SPEC = InstanceSpec(name="llama", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
                    num_kv_blocks=7481)
CAL = InstanceCalibration(beta=(1.1e-2, 4.2e-5, 2.8e-7, 1.3e-8), prefill_tokens_per_s=12_000,
                          tpot_s=0.024, mean_batch_seqs=25)


def _engine(residents: int, seed: int) -> SimEngine:
    """An engine in steady state at ``residents`` requests: whenever one finishes, a new
    one (lengths from splitwise_conv) joins, for 400 batches; then a batch is left in
    flight, as a router would find it."""
    trace = read_trace_csv(TRACE)
    rng = np.random.default_rng(seed)
    eng = SimEngine(0, SPEC, lambda sums: 0.01)
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        j = int(rng.integers(len(trace)))
        prompt, decode = min(int(trace.prompt_tokens[j]), 4096), int(trace.decode_tokens[j])
        eng.admit(next_id, prompt, decode, decode)
        next_id += 1

    for _ in range(residents):
        admit()
    for _ in range(400):
        eng.start_batch(0.0)
        for _rid, flags, _pre in eng.finish_batch():
            if flags & FINISHED:
                admit()
    eng.start_batch(0.0)
    return eng


def time_per_estimate(residents: int, instances: int, repeats: int) -> tuple[float, float]:
    """(median seconds per estimate, mean batches replayed per instance)."""
    engines = [_engine(residents, seed=k) for k in range(instances)]
    specs = (SPEC,) * instances
    est = BeaEstimator(specs, [CAL] * instances)
    req = Request(request_id=10**6, arrival_s=0.005, prompt_tokens=1020, decode_tokens=129,
                  predicted_decode_tokens=129, ttft_target_s=1.0)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctx = RoutingContext(request=req, now_s=0.005, instances=(), specs=specs,
                             snapshots=tuple(e.snapshot(0.005) for e in engines))
        est.estimate(ctx)
        samples.append(time.perf_counter() - t0)
    snaps = [e.snapshot(0.005) for e in engines]
    from olproute._core import replay_ttft

    out = replay_ttft(snaps, np.array([(SPEC.num_kv_blocks, SPEC.block_size, SPEC.max_num_seqs,
                                        SPEC.max_num_batched_tokens)] * instances),
                      est.beta, req.prompt_tokens, np.full(instances, 129), 0.005)
    return float(np.median(samples)), float(out[:, 2].mean())


def accuracy(quick: bool) -> dict[str, float]:
    base = {
        "instances": [{"name": "qwen06", "model": "qwen3-0.6b", "gpu": "h100"}],
        "workload": {"kind": "trace", "path": str(TRACE)},
        "prediction": {"mode": "oracle"},
    }
    profiles = load_profiles(REPO / "configs" / "profiles.yaml")
    loaded = LoadedConfig(REPO / "configs" / "default.yaml", Config.model_validate(base),
                          profiles)
    mu = saturation_profile(loaded)[0].requests_per_s
    rate = 0.7 * mu
    out: dict[str, float] = {"saturation_rps": mu, "rate_rps": rate}
    cal = None
    for mode in ("oracle", "noisy"):
        cfg = dict(base)
        cfg["workload"] = {"kind": "trace", "path": str(TRACE), "rate_per_s": rate,
                           "duration_s": 120.0 if quick else 600.0}
        cfg["prediction"] = {"mode": mode, "noise": 0.2}
        lc = LoadedConfig(loaded.path, Config.model_validate(cfg), profiles)
        if cal is None:
            cal = profile_calibration(lc, "round_robin")
        ev = run_estimate_eval(lc, "round_robin", ["bea", "prefill_tps"], cal)
        rows = {str(r["estimator"]): r for r in error_rows(ev)}
        out[f"bea_mape_{mode}_pct"] = float(rows["bea"]["mape_pct"])
        out[f"bea_p90_ape_{mode}_pct"] = float(rows["bea"]["p90_ape_pct"])
        out[f"prefill_tps_mape_{mode}_pct"] = float(rows["prefill_tps"]["mape_pct"])
        out[f"batch_time_mape_{mode}_pct"] = float(np.mean(ev.batch_time_ape) * 100)
        out[f"requests_{mode}"] = float(len(ev.observed_s))
    # staleness (BEAR sec. 5): the same noisy-length run, estimators fed old snapshots
    for age_ms in STALENESS_MS:
        ev = run_estimate_eval(lc, "round_robin", ["bea", "prefill_tps"], cal,
                               snapshot_age_s=age_ms / 1e3)
        rows = {str(r["estimator"]): r for r in error_rows(ev)}
        out[f"bea_mape_age{age_ms}_pct"] = float(rows["bea"]["mape_pct"])
        out[f"prefill_tps_mape_age{age_ms}_pct"] = float(rows["prefill_tps"]["mape_pct"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_harness_args(ap, digest=True)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 2 min of arrivals")
    args = ap.parse_args()
    begin(args, ap)
    repeats = 200 if args.quick else 2000

    speed = {}
    print(f"{'residents':>9}  {'1 instance (us)':>16}  {'8 instances (us)':>17}  "
          f"{'batches replayed':>16}")
    print(f"{'-' * 9}  {'-' * 16}  {'-' * 17}  {'-' * 16}")
    for n in (8, 32, 64, 128):
        one, batches = time_per_estimate(n, 1, repeats)
        eight, _ = time_per_estimate(n, 8, repeats // 4)
        speed[n] = (one * 1e6, eight * 1e6, batches)
        print(f"{n:>9}  {one * 1e6:>16.1f}  {eight * 1e6:>17.1f}  {batches:>16.1f}")
    print("goals at 64 residents: <= 15 us for one instance, <= 60 us for 8 together\n")

    acc = accuracy(args.quick)
    print(f"Qwen3-0.6B / H100: saturation {acc['saturation_rps']:.1f} req/s, "
          f"load 0.7 = {acc['rate_rps']:.1f} req/s (splitwise_conv rescaled)")
    print(f"{'measure':<40} {'oracle lengths':>15} {'+/-20% noise':>13}")
    print("-" * 70)
    for label, key in (("BEA TTFT MAPE %", "bea_mape"), ("BEA TTFT P90 APE %", "bea_p90_ape"),
                       ("batch-time model MAPE %", "batch_time_mape"),
                       ("prefill-throughput TTFT MAPE %", "prefill_tps_mape")):
        print(f"{label:<40} {acc[key + '_oracle_pct']:>15.2f} {acc[key + '_noisy_pct']:>13.2f}")
    print(f"{'requests evaluated':<40} {acc['requests_oracle']:>15.0f} "
          f"{acc['requests_noisy']:>13.0f}")
    print("goals: BEA MAPE <= 5% (goal 4%) with oracle lengths; batch-time MAPE <= 3%\n")
    print("snapshot staleness (+/-20% length noise; the router adds its own later dispatches)")
    print(f"{'snapshot age (ms)':<20} {'BEA MAPE %':>11} {'prefill-TPS MAPE %':>19}")
    print("-" * 52)
    for age in STALENESS_MS:
        print(f"{age:<20} {acc[f'bea_mape_age{age}_pct']:>11.2f} "
              f"{acc[f'prefill_tps_mape_age{age}_pct']:>19.2f}")
    if args.json:
        write_results(args.json, {
            "time_per_estimate_us": {str(n): {"one_instance": a, "eight_instances": b,
                                              "batches_replayed": c}
                                     for n, (a, b, c) in speed.items()},
            "accuracy": acc})


if __name__ == "__main__":
    main()
