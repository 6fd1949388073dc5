"""Build and solve times of the exact LP at (N, G, K) = (500, 4, 200), (2000, 8, 400),
(10000, 8, 1000): N requests, G instances, K slots of 50 ms.

    python bench/bench_lp.py [--sizes 500x4x200,...] [--time-limit S] [--naive-max-n N]
                             [--compute-load L] [--json PATH]

The instances are ``solvers.problem.random_instance`` (seed 0): arrivals uniform over
the grid, lognormal lengths, batch, KV and compute (prefill budget) capacity sized for
1.3x overload (``--compute-load`` sets the compute overload alone; 0: an unlimited
budget, the two-resource LP of before), residents draining over the first 100 slots,
start windows of 100 slots (5 s) after the earliest start. At 1.3x, compute binds in
nearly every slot and column generation needs several times more columns and rounds
than with batch and KV alone. Every row solves the same LP (a coarse grid solves a
relaxation of it):

- ``naive``: every column written out on the capacity rows (2 D + P + 1 nonzeros
  each), default HiGHS (dual simplex), one shot;
- ``ipm``: the difference form (9 nonzeros per column), every column, interior point
  without crossover, one shot (the two one-shot rows run only up to ``--naive-max-n``:
  above it they take many minutes);
- ``colgen``: the difference form, column generation from the earliest starts,
  interior-point masters, up to 16 new columns per request and round, until no column
  prices out (exact) -- the default;
- ``colgen 1e-3``: the same, stopped when D(p) - master <= 1e-3 master (the live check);
- ``coarse x10``: capacity rows summed over 10 slots (a relaxation, so its optimum is an
  upper bound on LP*), column generation as above; ``coarse x10 1e-3`` stops at 1e-3.

``rel. to exact`` is (objective - LP*) / LP* with LP* from ``colgen``; ``bound`` is the
certified D(p) >= LP* where the row computes one. Timings on this 2-core machine are
shared with other work: treat them as +/-30%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from solvers.lp import LpSolution, solve
from solvers.problem import random_instance

SIZES = ((500, 4, 200), (2000, 8, 400), (10000, 8, 1000))
GOALS = {(2000, 8, 400): 3.0, (10000, 8, 1000): 30.0}


def variants(n: int, naive_max_n: int, limit: float) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if n <= naive_max_n:
        out.append(("naive", {"strategy": "full", "form": "dense", "method": "simplex"}))
        out.append(("ipm", {"strategy": "full", "method": "ipm", "crossover": False}))
    out += [("colgen", {"strategy": "colgen"}),
            ("colgen 1e-3", {"strategy": "colgen", "gap_tol": 1e-3}),
            ("coarse x10", {"strategy": "colgen", "coarsen": 10}),
            ("coarse x10 1e-3", {"strategy": "colgen", "coarsen": 10, "gap_tol": 1e-3})]
    for _, kw in out:
        kw["time_limit_s"] = limit
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join("x".join(map(str, s)) for s in SIZES))
    ap.add_argument("--time-limit", type=float, default=120.0, help="per solve, seconds")
    ap.add_argument("--naive-max-n", type=int, default=500,
                    help="run the one-shot rows only up to this N (they take minutes above)")
    ap.add_argument("--compute-load", type=float, default=None,
                    help="overload of the prefill budget alone (default: the 1.3 of the "
                         "others; 0: unlimited)")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    rows: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        n, g, k = (int(v) for v in size.split("x"))
        prob = random_instance(n, g, k, seed=0, compute_load=args.compute_load)
        exact: float | None = None
        for name, kw in variants(n, args.naive_max_n, args.time_limit):
            t0 = time.perf_counter()
            sol: LpSolution = solve(prob, **kw)
            wall = time.perf_counter() - t0
            if name == "colgen" and sol.status == "Optimal":
                exact = sol.objective
            build_s = sol.timings.get("build_s", 0.0)
            row: dict[str, Any] = {
                "N": n, "G": g, "K": k, "variant": name, "status": sol.status,
                "method": sol.method, "columns": sol.num_cols, "nnz": sol.nnz,
                "rounds": sol.rounds, "build_s": build_s, "solve_s": wall - build_s,
                "total_s": wall, "objective": sol.objective, "bound": sol.bound}
            rows.append(row)
            print(f"  {size} {name:<12} {wall:8.2f} s  {sol.status}", flush=True)
        for row in rows:
            if (row["N"], row["G"], row["K"]) == (n, g, k):
                row["rel_to_exact"] = (None if exact is None
                                       else (row["objective"] - exact) / exact)
    head = (f"{'(N, G, K)':<17} {'variant':<12} {'method':<31} {'columns':>9} {'nnz':>10} "
            f"{'rounds':>6} {'build s':>8} {'solve s':>8} {'total s':>8} {'goal s':>6} "
            f"{'rel. to exact':>13} {'bound gap':>9}")
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        key = (r["N"], r["G"], r["K"])
        goal = GOALS.get(key)
        rel = r.get("rel_to_exact")
        bgap = (None if r["bound"] is None or not r["objective"]
                else (r["bound"] - r["objective"]) / r["objective"])
        print(f"{key!s:<17} {r['variant']:<12} {r['method'][:31]:<31} {r['columns']:>9} "
              f"{r['nnz']:>10} {r['rounds']:>6} {r['build_s']:>8.2f} {r['solve_s']:>8.2f} "
              f"{r['total_s']:>8.2f} {'' if goal is None else f'{goal:g}':>6} "
              f"{'' if rel is None else f'{rel:+.2e}':>13} "
              f"{'' if bgap is None else f'{bgap:.1e}':>9}"
              + ("" if r["status"] == "Optimal" else f"  ({r['status']})"))
    if args.json:
        write_results(args.json, rows)


if __name__ == "__main__":
    main()
