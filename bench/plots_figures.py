"""The figures of ``olproute plots`` (docs/guides/operating.md, "Operator plots"),
measured on the run ``olproute plots`` draws (same config, weights, requests, calibration and seed).

    python bench/plots_figures.py --config configs/tune/bear_pool.yaml \\
        --weights runs/tune/selected.yaml

Prints, from ``record_prices`` (the prices after every tick, as in prices.png and
bottleneck.png): the number of ticks and their period; per instance, when each resource
is first priced (any slot > 0), the share of ticks on which each resource is the
bottleneck (``PriceTrace.bottlenecks``, the numbers bottleneck.png prints), split into the
arrival window and the drain after the last arrival, and the peak horizon-summed price of
each resource, over the run and after the first ``--settle-s``; the learner's window size,
N_H and adagrad scale (``PriceBook.last_price_scale``) whenever the scale changes; and the
share of requests bid_price sends to each instance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute.config.loader import load_config
from olproute.operator.plots import PriceRecorder, PriceTrace
from olproute.policies.bid_price import BidPrice
from olproute.pricing.reward import RESOURCES
from olproute.sim.scenario import CalibrationSource, build_requests, make_cluster, make_policy
from olproute.types import EngineSnapshot


class BookRecorder(PriceRecorder):
    """``record_prices``' recorder, also keeping the price book's learner state per tick:
    (time, window size, N_H, adagrad scale)."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        # bid_price on mixed instances has one book; any other policy: no learner state
        self.book = inner.book if isinstance(inner, BidPrice) else None
        self.state: list[tuple[float, int, float, float]] = []

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        super().tick(now_s, snapshots)
        b = self.book
        if b is not None:
            self.state.append((now_s, int(b.num_samples), float(b.arrivals_in_horizon),
                               float(b.last_price_scale)))


def _shares(which: np.ndarray) -> str:
    """'batch x%, kv y%, compute z%, none w%' of a (T,) bottleneck column."""
    if which.size == 0:
        return "(no ticks)"
    parts = [f"{r} {(which == i).mean():.1%}" for i, r in enumerate(RESOURCES)]
    return ", ".join([*parts, f"none {(which == -1).mean():.1%}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tune/bear_pool.yaml")
    ap.add_argument("--weights", action="append", default=[])
    ap.add_argument("--policy", default="bid_price")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="also report each price's peak after this time")
    add_harness_args(ap, digest=True)
    args = ap.parse_args()
    begin(args, ap)

    loaded = load_config(args.config, args.weights)
    reqs = build_requests(loaded)
    # what record_prices does (the run `olproute plots` draws), keeping the book's state
    probe = BookRecorder(make_policy(loaded, args.policy, calibration=CalibrationSource(loaded)))
    res = make_cluster(loaded, probe).run(reqs)
    trace = PriceTrace(tuple(s.name for s in loaded.specs), loaded.config.router.slot_ms / 1e3,
                       np.array(probe.times), np.stack(probe.samples).astype(np.float64))
    t = trace.time_s
    last_arrival = max(r.arrival_s for r in reqs)
    tot = trace.totals()
    which = trace.bottlenecks()
    arriving = t <= last_arrival
    print(f"{len(reqs)} requests, last arrival {last_arrival:.1f} s, run ends {res.end_s:.1f} s")
    print(f"{len(t)} ticks from {t[0]:.2f} to {t[-1]:.2f} s, "
          f"period {np.median(np.diff(t)):.3f} s; {arriving.sum()} ticks up to the last "
          "arrival")
    last_scale = None
    for k, (now, window, n_h, scale) in enumerate(probe.state):
        if scale != last_scale or k == len(probe.state) - 1:
            print(f"  update {k + 1:3d} at {now:6.2f} s: window {window} requests, "
                  f"N_H {n_h:.0f}, adagrad scale {scale:.2f}")
            last_scale = scale
    later = t > args.settle_s
    for g, name in enumerate(trace.names):
        print(f"\n{name}:")
        for r, resource in enumerate(RESOURCES):
            priced = np.flatnonzero(trace.prices[:, g, :, r].max(axis=1) > 0)
            first = f"first priced at {t[priced[0]]:.2f} s" if priced.size else "never priced"
            peak = int(np.argmax(tot[:, g, r]))
            print(f"  {resource:8s} {first}; priced on {priced.size / len(t):.1%} of ticks; "
                  f"horizon sum peak {tot[peak, g, r]:.1f} at {t[peak]:.1f} s, "
                  f"after {args.settle_s:g} s {tot[later, g, r].max(initial=0.0):.1f}, "
                  f"last tick {tot[-1, g, r]:.1f}")
        print(f"  bottleneck, all ticks:      {_shares(which[:, g])}")
        print(f"  bottleneck, arrival window: {_shares(which[arriving, g])}")
        print(f"  bottleneck, after it:       {_shares(which[~arriving, g])}")
    served = ~res.shed
    print(f"\n{args.policy}: {int(res.shed.sum())} of {len(reqs)} refused")
    for g, spec in enumerate(res.specs):
        n = int(((res.instance == g) & served).sum())
        print(f"  {spec.name:12s} {n:5d} requests, {n / len(reqs):.1%} of all, "
              f"{n / max(int(served.sum()), 1):.1%} of the served")
    write_results(args.json, {
        "requests": len(reqs), "refused": int(res.shed.sum()), "ticks": len(t),
        "served_by_instance": {spec.name: int(((res.instance == g) & served).sum())
                               for g, spec in enumerate(res.specs)}})


if __name__ == "__main__":
    main()
