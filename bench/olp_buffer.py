"""How much the router's buffer holds in the OLP table's overloaded scenario: what a
buffer-wide release (issue 16) has to reorder there.

    python bench/olp_buffer.py [--seeds S,S,..] [--rate R] [--json PATH]

The OLP table's pool and workload (``olp_table.scenario``: four Llama-2-7B / A100
engines, splitwise_conv lengths, +/-20% noisy predictions, held up to 60 s then deferred),
bid_price with each ``release``. Per seed and release: the share of requests ever held
(dispatched after their arrival instant) and their mean wait, the passes over the held
requests (one per slot boundary while any is held, for the joint releases) and the
requests per pass, and where a served request's time goes: mean TTFT, mean end-to-end
latency and mean decode time (first token to finish). Default seeds: the tuning seeds
0 and 1 (``common.TUNING_SEEDS``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import TUNING_SEEDS, add_harness_args, begin, write_results
from bench.olp_table import scenario
from olproute.sim.scenario import CalibrationSource, build_requests, make_cluster, make_policy
from olproute.types import Decision, Request

RELEASES = ("in_order", "density")


def held_figures(rate: float, seed: int, release: str, num_requests: int
                 ) -> dict[str, float]:
    loaded = scenario(rate, num_requests, seed,
                      {"router": {"policy_params": {"bid_price": {"release": release}}}})
    reqs = build_requests(loaded)
    policy = make_policy(loaded, "bid_price", calibration=CalibrationSource(loaded))
    sizes: list[int] = []
    inner = policy.decide_held

    def counted(requests: Sequence[Request],
                context: Any) -> Iterator[Decision]:  # the pass, counted
        sizes.append(len(requests))
        return inner(requests, context)

    policy.decide_held = counted  # type: ignore[method-assign]
    res = make_cluster(loaded, policy).run(reqs)
    arrival = np.array([r.arrival_s for r in reqs])
    waited = res.dispatch_s - arrival
    held = waited > 0
    per_pass = np.array(sizes, dtype=np.float64)
    return {
        "held_share": float(held.mean()),
        "held_mean_wait_s": float(waited[held].mean()) if held.any() else 0.0,
        "passes": float(len(sizes)),
        "held_per_pass_mean": float(per_pass.mean()) if sizes else 0.0,
        "held_per_pass_max": float(per_pass.max()) if sizes else 0.0,
        "ttft_mean_s": float(np.nanmean(res.first_token_s - arrival)),
        "eel_mean_s": float(np.nanmean(res.finish_s - arrival)),
        "decode_mean_s": float(np.nanmean(res.finish_s - res.first_token_s)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seeds", default=",".join(map(str, TUNING_SEEDS[:2])))
    ap.add_argument("--rate", type=float, default=24.0, help="req/s (the table's overload)")
    ap.add_argument("--requests", type=int, default=4000)
    add_harness_args(ap, digest=True)
    args = ap.parse_args()
    begin(args, ap)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, dict[str, float]] = {}
    print(f"{'seed':>4} {'release':<9} {'held':>6} {'wait ms':>8} {'passes':>7} "
          f"{'per pass':>9} {'max':>4} {'TTFT s':>7} {'EEL s':>7} {'decode s':>9}")
    for seed in seeds:
        for release in RELEASES:
            f = held_figures(args.rate, seed, release, args.requests)
            rows[f"{seed}/{release}"] = f
            print(f"{seed:>4} {release:<9} {f['held_share'] * 100:5.1f}% "
                  f"{f['held_mean_wait_s'] * 1e3:8.0f} {f['passes']:7.0f} "
                  f"{f['held_per_pass_mean']:9.1f} {f['held_per_pass_max']:4.0f} "
                  f"{f['ttft_mean_s']:7.3f} {f['eel_mean_s']:7.2f} {f['decode_mean_s']:9.2f}",
                  flush=True)
    if args.json:
        write_results(args.json, {"rate": args.rate, "seeds": seeds, "runs": rows}, seeds)


if __name__ == "__main__":
    sys.exit(main())
