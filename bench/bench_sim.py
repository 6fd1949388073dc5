"""Simulator speed: the Cython batch core against its Python reference, and the wall time
of a whole-hour trace replay.

    python bench/bench_sim.py [--steps N] [--json PATH]

1. Batch steps per second (schedule + commit) of ``BatchCore`` and ``ReferenceCore`` on
   the same steady state: a Llama-2-7B / A100 engine (7,481 KV blocks, B = 256,
   kappa = 2048) kept at about ``--residents`` requests by re-admitting a request with
   lengths drawn from splitwise_conv whenever one finishes. The ratio is measured in
   this run.
2. Wall time to simulate the full splitwise_conv hour (19,366 requests, real arrivals) on
   4 Llama-2-7B / A100 instances with round_robin (batch log recorded, no progress bar).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute._core import BatchCore
from olproute.config.loader import load_config
from olproute.core_ref import FINISHED, ReferenceCore
from olproute.sim.scenario import build_requests, simulate
from olproute.sim.workloads import read_trace_csv

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"


def steps_per_second(cls: type[BatchCore] | type[ReferenceCore], num_steps: int,
                     residents: int, seed: int = 0) -> tuple[float, float]:
    """(steps/s, mean batch size) of schedule+commit at a steady resident count."""
    trace = read_trace_csv(TRACE)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(trace), size=num_steps + residents + 1)
    prompts = trace.prompt_tokens[idx].tolist()
    outs = trace.decode_tokens[idx].tolist()
    core = cls(7481, 16, 256, 2048)
    nxt = 0
    for _ in range(residents):
        core.add_request(min(prompts[nxt], 8192), outs[nxt])
        nxt += 1
    batch_total = 0
    t0 = time.perf_counter()
    for _ in range(num_steps):
        n, _sums = core.schedule()
        batch_total += n
        if core.commit():
            for slot, flags in core.event_list():
                if flags & FINISHED:
                    core.release_slot(slot)
                    core.add_request(min(prompts[nxt], 8192), outs[nxt])
                    nxt += 1
    elapsed = time.perf_counter() - t0
    return num_steps / elapsed, batch_total / num_steps


def whole_hour_s() -> tuple[float, int, int]:
    loaded = load_config(REPO / "configs" / "default.yaml")
    wl = loaded.config.workload.model_copy(update={"duration_s": None, "time_scale": 1.0,
                                                   "path": str(TRACE)})
    loaded = loaded.with_updates(workload=wl)
    reqs = build_requests(loaded)
    t0 = time.perf_counter()
    res = simulate(loaded, "round_robin", reqs)
    return time.perf_counter() - t0, len(reqs), int(res.batch_log.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20_000, help="core steps per variant")
    ap.add_argument("--residents", type=int, default=64, help="requests kept in the engine")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)

    fast, batch = steps_per_second(BatchCore, args.steps, args.residents)
    ref_steps = max(args.steps // 10, 1000)
    slow, _ = steps_per_second(ReferenceCore, ref_steps, args.residents)
    hour_s, n_req, n_batches = whole_hour_s()

    rows = [
        ("core steps/s, Cython BatchCore", f"{fast:,.0f}"),
        ("core steps/s, Python reference", f"{slow:,.0f}"),
        ("core speed-up (same run)", f"{fast / slow:.1f}x   (goal >= 30x)"),
        ("mean batch size (requests)", f"{batch:.1f}"),
        ("splitwise_conv hour, 4 instances, round_robin", f"{hour_s:.1f} s   (goal <= 60 s)"),
        ("  requests / batches simulated", f"{n_req:,} / {n_batches:,}"),
        ("  simulated batches per wall second", f"{n_batches / hour_s:,.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 24}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.json:
        write_results(args.json, {
            "core_steps_per_s": fast, "reference_steps_per_s": slow, "core_speedup": fast / slow,
            "mean_batch_size": batch, "residents": args.residents,
            "hour_wall_s": hour_s, "hour_requests": n_req, "hour_batches": n_batches,
        })


if __name__ == "__main__":
    main()
