"""Online prices against the exact LP, and how right the model is about time, in the
batch-, KV- and compute-bound scenarios of ``solvers.compare``, as a results file.

    python bench/lp_compare.py [--quick] [--seeds 10,11,12] [--json PATH]

Each (scenario, seed) runs bid_price on 600 requests (``--quick``: 300, seed 10) and
reports, under the keys of ``solvers.compare.as_json``: the certificate D(p)/LP* - 1,
``online_over_lp``, ``online_over_realised_lp`` (LP* on the durations that held),
``duration_ratio`` and ``occupancy_ratio`` (realised over predicted decode time per
request, and mean decoders per instance), ``lp_max_delay_s`` and the binding rows.
Goals: duration and occupancy within +/-10%; online >= 90% of the realised-duration
LP* where a row binds; certificate <= 5%.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    REPORT_SEEDS,
    add_harness_args,
    add_quick_arg,
    begin,
    parse_seeds,
    write_results,
)
from solvers.compare import SCENARIOS, as_json, run, table  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_arg(ap, "300 requests a scenario, seed 10 only: a smoke run")
    ap.add_argument("--seeds", type=parse_seeds, default=None)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    add_harness_args(ap)
    args = ap.parse_args(argv)
    begin(args, ap)
    seeds = args.seeds or ((10,) if args.quick else REPORT_SEEDS)
    rows = run(args.scenarios.split(","), list(seeds), 300 if args.quick else 600)
    print()
    print(table(rows))
    write_results(args.json, as_json(rows), seeds)


if __name__ == "__main__":
    main()
