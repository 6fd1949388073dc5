"""Many routers: what the sync buys (issue 21). N router replicas in the simulator, each
its own policy object, the requests split among them round robin, each one's view its own
ledger merged with the others' as they were published s ago (``olproute.sim.replicas``).

    python bench/replicas_table.py [--quick] [--json PATH] [--seeds S,S,..] [--ablations]

Rows, per scenario: one router (N = 1, staleness irrelevant: 0), then N = 2 and 4 with
staleness s = 0, 50, 200 and 1000 ms, and with no sync (each replica sees its own ledger
only and learns its own prices). With a sync, every replica's price books share their
demand (samples and arrival times, s late), replica 0 alone learns and the others adopt
its prices s after each of its ticks.

Scenarios (every replica runs bid_price; every row sees what a router rebuilds of the
engines from its traffic, ``sim.snapshot_view: router``, one router included: the rows
differ in the sync alone):

* ``olp``: the OLP table's overloaded scenario (``bench/olp_table.py``: four Llama-2-7B /
  A100 engines, Poisson 24 req/s, splitwise_conv lengths, +/-20% noisy predictions,
  ``admission: defer`` after up to 60 s held; 4,000 requests);
* ``pd chat``: the P/D table's chat-like mix (``bench/pd_table.py``: ``configs/pd.yaml``'s
  2 prefill + 4 decode Qwen2.5-3B pools, MMPP-2 at 7.06 req/s, 300 s of arrivals),
  bid_price with ``configs/weights/goodput.yaml`` and ``admission: shed``.

Figures: mean end-to-end latency (EEL, over the served requests), goodput (the fraction of
all requests, refused ones included, that met both their TTFT and TPOT targets:
``Summary.goodput``, as the P/D table reports it; the OLP table does not report goodput,
its requests carry TTFT targets only, so there it is the fraction of all requests with a
first token within target), the served fraction and tokens/s over the arrival window;
each as the mean [min-max] over the seeds, and against one router on the same seed (%
for EEL, points for goodput); the mean TTFT; and the share of dispatches sent to an engine
where an earlier one still waited for its first token (on P/D pools: for its prefill),
which one router's admission (``max_waiting: 0``) never does. Goal (issue 21): at N = 4,
s = 50 ms, mean EEL within 5% of one router's and goodput within 1 point, on the mean over
seeds.

``--ablations`` adds N = 4 at s = 5, 10 and 25 ms (what staleness the goal needs), and at
s = 0 and 50 ms with the ledgers shared but every replica learning its own prices (what
the price sync adds to the ledgers').
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench import pd_table
from bench.common import (
    REPORT_SEEDS,
    add_harness_args,
    add_quick_arg,
    begin,
    fmt_spread,
    seed_figure,
    write_results,
)
from bench.olp_table import scenario as olp_scenario
from olproute.config.loader import LoadedConfig, load_config
from olproute.sim.cluster import SimResult
from olproute.sim.metrics import summarize
from olproute.sim.replicas import Sync
from olproute.sim.scenario import CalibrationSource, build_requests, simulate_replicas
from olproute.types import Request

REPO = Path(__file__).resolve().parents[1]
STALENESS_MS = (0.0, 50.0, 200.0, 1000.0)


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the table: N replicas, their staleness in ms (None: no sync), whether
    the sync shares prices too (else each replica learns its own); ``ablation``: a row
    of ``--ablations``."""

    replicas: int
    staleness_ms: float | None
    prices: bool = True
    ablation: bool = False

    @property
    def sync(self) -> Sync:
        return Sync(None if self.staleness_ms is None else self.staleness_ms / 1e3,
                    self.prices)


ROWS = (Row(1, 0.0), *(Row(n, s) for n in (2, 4) for s in (*STALENESS_MS, None)))
# what staleness the goal needs, and what the ledgers' sync does without the prices'
ABLATIONS = (*(Row(4, s, ablation=True) for s in (5.0, 10.0, 25.0)),
             Row(4, 0.0, prices=False, ablation=True), Row(4, 50.0, prices=False, ablation=True))
ONE, GOAL_ROW = Row(1, 0.0), Row(4, 50.0)
GOAL_EEL_PCT, GOAL_GOODPUT_POINTS = 5.0, 1.0
FIGURES = (("mean_eel_s", "eel_mean_s"), ("goodput", "goodput"),
           ("served_fraction", "served_fraction"), ("tokens_per_s", "throughput_tokens_per_s"),
           ("mean_ttft_s", "ttft_mean_s"))


@dataclass(frozen=True, slots=True)
class Case:
    """One scenario on one seed: its config, requests and calibration."""

    scenario: str
    seed: int
    loaded: LoadedConfig
    requests: list[Request]
    calibration: CalibrationSource


def olp_case(seed: int, num_requests: int) -> Case:
    loaded = olp_scenario(24.0, num_requests, seed, {"sim": {"seed": seed,
                                                              "snapshot_view": "router"}})
    return Case("olp", seed, loaded, build_requests(loaded), CalibrationSource(loaded))


def pd_case(seed: int, duration_s: float, calibration: CalibrationSource) -> Case:
    base = load_config(REPO / "configs" / "pd.yaml")
    base = base.with_updates(sim=base.config.sim.model_copy(update={"snapshot_view": "router"}))
    reqs = pd_table.mix_requests(base, "chat", pd_table.RATES["chat"], duration_s, seed)
    return Case("pd chat", seed, pd_table.bid_price_config(base), reqs, calibration)


def run_row(case: Case, row: Row) -> dict[str, float]:
    t0 = time.perf_counter()
    res = simulate_replicas(case.loaded, "bid_price", row.replicas, row.sync, case.requests,
                            seed=case.seed, calibration=case.calibration)
    d = summarize(res).as_dict()
    return {**{key: float(d[field]) for key, field in FIGURES},
            "sent_behind_waiting": sent_behind_waiting(res),
            "seconds": time.perf_counter() - t0}


def sent_behind_waiting(res: SimResult) -> float:
    """The fraction of dispatches sent to an engine where an earlier dispatch was still
    waiting for its first token (on P/D pools: for the end of its prefill on the prefill
    engine): what one router's admission (``admission.max_waiting: 0`` in the router's
    view) never does, and a replica does when it has not seen the other's dispatch."""
    sent = ~res.shed
    end = np.where(res.decode_instance >= 0, res.prefill_end_s, res.first_token_s)
    behind = 0
    for g in np.unique(res.instance[sent]):
        mine = sent & (res.instance == g)
        starts = np.sort(res.dispatch_s[mine], kind="stable")
        ends = np.sort(end[mine])
        # earlier dispatches (by rank) less those whose wait ended by this one's dispatch
        waiting = np.arange(len(starts)) - np.searchsorted(ends, starts, side="right")
        behind += int(np.count_nonzero(waiting > 0))
    return behind / max(int(sent.sum()), 1)


Results = dict[tuple[str, Row], list[dict[str, float]]]


def run(rows: Sequence[Row], seeds: Sequence[int], num_requests: int,
        duration_s: float) -> Results:
    """Every row on every (scenario, seed), with a progress bar on stderr."""
    from tqdm import tqdm

    pd_base = load_config(REPO / "configs" / "pd.yaml")
    pd_cal = CalibrationSource(pd_base)   # the P/D table's: once per pool shape
    out: Results = {}
    with tqdm(total=2 * len(seeds) * len(rows), desc="runs", file=sys.stderr,
              unit="run") as bar:
        for seed in seeds:
            for case in (olp_case(seed, num_requests), pd_case(seed, duration_s, pd_cal)):
                for row in rows:
                    bar.set_postfix_str(f"{case.scenario} seed {seed} N={row.replicas} "
                                        f"{row.sync.label}")
                    out.setdefault((case.scenario, row), []).append(run_row(case, row))
                    bar.update()
    return out


def _per_seed(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows]


def summary(results: Results, seeds: Sequence[int], num_requests: int,
            duration_s: float) -> dict[str, Any]:
    """The JSON: one entry per (scenario, row), each figure the mean over seeds with its
    spread and its change against one router on the same seed."""
    rows = []
    for (scen, row), runs in results.items():
        one = results[(scen, ONE)]
        eel = [100.0 * (r["mean_eel_s"] / o["mean_eel_s"] - 1.0)
               for r, o in zip(runs, one, strict=True)]
        good = [100.0 * (r["goodput"] - o["goodput"]) for r, o in zip(runs, one, strict=True)]
        figs = {key: seed_figure(_per_seed(runs, key))
                for key in (*(k for k, _ in FIGURES), "sent_behind_waiting")}
        synced = row.staleness_ms is not None
        rows.append({
            "scenario": scen, "replicas": row.replicas, "staleness_ms": row.staleness_ms,
            "sync": synced, "prices_shared": synced and row.prices and row.replicas > 1,
            "ablation": row.ablation,
            **{key: f["mean"] for key, f in figs.items()},
            **{f"{key}_spread": f for key, f in figs.items()},
            "mean_eel_change_pct_vs_one_router": seed_figure(eel),
            "goodput_points_vs_one_router": seed_figure(good),
            "seconds": seed_figure(_per_seed(runs, "seconds"))})
    goals = {}
    for scen in dict.fromkeys(k[0] for k in results):
        goal = next(r for (sc, row), r in zip(results, rows, strict=True)
                    if sc == scen and row == GOAL_ROW)
        eel, good = (goal["mean_eel_change_pct_vs_one_router"]["mean"],
                     goal["goodput_points_vs_one_router"]["mean"])
        goals[scen] = {"mean_eel_change_pct": eel, "goodput_points": good,
                       "met": abs(eel) <= GOAL_EEL_PCT and abs(good) <= GOAL_GOODPUT_POINTS}
    return {"seeds": list(seeds), "olp_requests": num_requests, "pd_duration_s": duration_s,
            "policy": "bid_price", "rows": rows, "goal_n4_s50": goals}


HEADER = ("N", "sync", "mean EEL s", "EEL vs 1 router", "goodput", "goodput vs 1, pts",
          "served", "tokens/s", "mean TTFT s", "sent behind")


def render(s: dict[str, Any]) -> str:
    lines = [f"bid_price, seeds {','.join(map(str, s['seeds']))}; every figure mean [min-max] "
             "over seeds; 'vs 1 router': against one router on the same seed",
             f"olp: OLP overloaded scenario, {s['olp_requests']} requests; pd chat: P/D chat "
             f"mix, {s['pd_duration_s']:g} s of arrivals; all rows see the router's view of "
             "the engines (sim.snapshot_view: router); with a sync the prices are shared "
             "too (both policies have price books)",
             "sent behind: fraction of dispatches sent to an engine where an earlier one "
             "still waited for its first token (P/D: its prefill); one router: never"]
    for scen in dict.fromkeys(r["scenario"] for r in s["rows"]):
        mine = [r for r in s["rows"] if r["scenario"] == scen]
        body = [_cells(r) for r in mine if not r["ablation"]]
        extra = [_cells(r) for r in mine if r["ablation"]]
        widths = [max(len(c[i]) for c in [HEADER, *body, *extra])
                  for i in range(len(HEADER))]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        rule = "  ".join("-" * w for w in widths)
        lines += ["", scen, fmt.format(*HEADER), rule, *(fmt.format(*c) for c in body)]
        if extra:
            lines += [rule, *(fmt.format(*c) for c in extra)]
    lines.append("")
    for scen, g in s["goal_n4_s50"].items():
        nosync = next(r for r in s["rows"] if r["scenario"] == scen and r["replicas"] == 4
                      and r["staleness_ms"] is None)
        lines.append(
            f"{scen}: N=4, s=50 ms against one router: mean EEL "
            f"{g['mean_eel_change_pct']:+.1f}% (goal within {GOAL_EEL_PCT:g}%), goodput "
            f"{g['goodput_points']:+.1f} points (goal within {GOAL_GOODPUT_POINTS:g}): "
            f"{'met' if g['met'] else 'MISSED'}; N=4 no sync: mean EEL "
            f"{nosync['mean_eel_change_pct_vs_one_router']['mean']:+.1f}%, goodput "
            f"{nosync['goodput_points_vs_one_router']['mean']:+.1f} points")
    return "\n".join(lines)


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    def f(key: str, fmt: str) -> str:
        return fmt_spread(r[key]["per_seed"], fmt)

    sync = ("no sync" if r["staleness_ms"] is None else "-" if r["replicas"] == 1
            else f"{r['staleness_ms']:g} ms" + ("" if r["prices_shared"] else ", prices own"))
    return (str(r["replicas"]), sync, f("mean_eel_s_spread", "{:.2f}"),
            f("mean_eel_change_pct_vs_one_router", "{:+.1f}%"), f("goodput_spread", "{:.3f}"),
            f("goodput_points_vs_one_router", "{:+.1f}"), f("served_fraction_spread", "{:.3f}"),
            f("tokens_per_s_spread", "{:,.0f}"), f("mean_ttft_s_spread", "{:.3f}"),
            f("sent_behind_waiting_spread", "{:.2f}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_quick_arg(ap, "one seed, 800 OLP requests, 60 s of P/D arrivals")
    add_harness_args(ap, digest=True)
    ap.add_argument("--ablations", action="store_true",
                    help="also N=4 at 5, 10 and 25 ms, and at 0 and 50 ms with every replica "
                         "learning its own prices")
    ap.add_argument("--seeds", default=",".join(map(str, REPORT_SEEDS)),
                    help="comma-separated seeds (default: the report seeds)")
    ap.add_argument("--requests", type=int, default=4000, help="OLP requests per seed")
    ap.add_argument("--duration", type=float, default=300.0,
                    help="seconds of P/D arrivals per seed")
    args = ap.parse_args()
    begin(args, ap)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if args.quick:
        seeds, args.requests, args.duration = seeds[:1], 800, 60.0
    t0 = time.perf_counter()
    results = run((*ROWS, *ABLATIONS) if args.ablations else ROWS, seeds, args.requests,
                  args.duration)
    s = summary(results, seeds, args.requests, args.duration)
    print(render(s))
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_results(args.json, s, seeds)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
