"""Where a bid_price decision's time goes: each part timed inside the decisions.

    python bench/profile_decision.py [--instances G] [--predictor] [--out PATH]

Runs the simulator (G Llama-2-7B / A100 instances, Poisson at 4.25 req/s per instance,
noisy lengths; with ``--predictor``, 8 Qwen3-8B / H100 instances on synthetic prompts
with the LightGBM predictor run on each request's text before its first decision, as
the server's router runs it when a request arrives) with bid_price's parts wrapped in
perf_counter timers: the predictor (``PoolPredictor.predict``, outside ``decide``), the
outlook, the BEA replay, the compiled counts for the step times and scoring kernel, the
fit check and the accounting; and the whole ``decide``. Prints each part's median per
decision and its share of the median decision (the predictor's share is of the decide
it precedes); ``--out`` writes the same text to a file (docs/profile-decision.txt).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench import bench_prices
from bench.common import add_harness_args, begin, write_results
from olproute.estimate import bea
from olproute.policies import bid_price as bp
from olproute.predict import PoolPredictor
from olproute.routing import outlook

PARTS: tuple[tuple[str, Any, str], ...] = (
    ("predictor (before decide)", PoolPredictor, "predict"),
    ("outlook (predictions, cost)", outlook.OutlookSource, "__call__"),
    ("BEA replay (compiled)", bea.BeaEstimator, "ttft_many"),
    ("counts and scoring (compiled)", bp, "Scorer"),
    ("fit check", bp.BidPrice, "_fits_at"),
    ("accounting", bp.BidPrice, "_account"),
    ("the whole decide", bp.BidPrice, "decide"),
)


def _wrap(owner: Any, name: str, into: list[float]) -> Callable[[], None]:
    inner = getattr(owner, name)
    if name == "Scorer":   # a compiled class: its method timed in a subclass
        class Timed(inner):  # type: ignore[misc, valid-type]
            def score(self, *args: Any) -> Any:
                t0 = time.perf_counter()
                out = super().score(*args)
                into.append(time.perf_counter() - t0)
                return out

        setattr(owner, name, Timed)
        return lambda: setattr(owner, name, inner)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--predictor", action="store_true")
    ap.add_argument("--out", metavar="PATH")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    times: dict[str, list[float]] = {label: [] for label, _, _ in PARTS}
    undo = [_wrap(owner, name, times[label]) for label, owner, name in PARTS]
    try:
        if args.predictor:
            bench_prices.decision_times(False, use_predictor=True)
            setup = ("8 Qwen3-8B / H100 instances, LightGBM predictor before each "
                     "request's first decision")
        else:
            bench_prices.fleet_run(args.instances, "bid_price", None, False)
            setup = f"{args.instances} Llama-2-7B / A100 instances, lengths given"
    finally:
        for u in undo:
            u()
    decisions = len(times["the whole decide"])
    whole = float(np.median(times["the whole decide"])) * 1e6
    lines = [f"# python bench/profile_decision.py --instances {args.instances}"
             f"{' --predictor' if args.predictor else ''}",
             f"# {setup}; {decisions} decisions",
             f"{'part':<30} {'calls/decision':>14} {'p50 us':>8} {'x calls / p50':>14}"]
    parts: dict[str, dict[str, float]] = {}
    for label, _, _ in PARTS:
        ts = np.array(times[label]) * 1e6
        per = len(ts) / max(decisions, 1)
        p50 = float(np.median(ts)) if ts.size else 0.0
        lines.append(f"{label:<30} {per:>14.2f} {p50:>8.1f} {per * p50 / whole:>13.0%}")
        parts[label] = {"calls_per_decision": per, "p50_us": p50}
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    write_results(args.json, {"setup": setup, "decisions": decisions, "parts": parts})


if __name__ == "__main__":
    main()
