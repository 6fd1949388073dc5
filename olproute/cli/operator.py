"""The operator commands of the ``olproute`` command line: ``tune`` (sweep weights, pick
a profile) and ``plots`` (shadow-price heatmaps, bottlenecks, latency CDFs)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from olproute.cli.args import add_executor_options, executor_of, int_at_least
from olproute.config.loader import ConfigError, LoadedConfig

AddOptions = Callable[[argparse.ArgumentParser], None]
LoadFn = Callable[[argparse.Namespace], LoadedConfig]


_jobs = int_at_least(1)


def _constraint(text: str) -> Any:
    from olproute.operator.tune_grid import parse_constraint

    try:
        return parse_constraint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metric(text: str) -> str:
    from olproute.operator.tune_grid import METRICS

    if text not in METRICS:
        raise argparse.ArgumentTypeError(f"unknown metric {text!r} (known: "
                                         f"{', '.join(METRICS)})")
    return text


def add_operator_commands(sub: Any, add_run_options: AddOptions, loaded_of: LoadFn) -> None:
    """Register ``tune`` and ``plots`` on the ``olproute`` subparsers."""
    p = sub.add_parser(
        "tune", help="sweep reward weights in the simulator and pick a profile",
        description="Run the simulator once per point of a weight grid (or N random "
                    "draws), in worker processes or as Ray tasks; write tune.csv, "
                    "pareto.png and the selected point as a weight profile, selected.yaml. "
                    "Grid file format and selection rule: olproute/operator/tune_grid.py and "
                    "docs/guides/operating.md.")
    add_run_options(p)
    p.add_argument("--grid", required=True, metavar="YAML", help="the search space")
    p.add_argument("--random", type=_jobs, metavar="N",
                   help="N random draws from the grid's lists and ranges instead of the grid")
    p.add_argument("--jobs", type=_jobs, default=2, metavar="J",
                   help="worker processes (default: %(default)s; 1: in this process), "
                        "or the CPUs of the local Ray with --executor ray")
    add_executor_options(p)
    p.add_argument("--policy", default="bid_price",
                   help="policy the weights are tuned for (default: %(default)s)")
    p.add_argument("--select", type=_metric, metavar="METRIC",
                   help="metric to optimise (default: the grid's select.metric, else "
                        "slo_attainment)")
    p.add_argument("--constraint", type=_constraint, action="append", default=[],
                   metavar="'METRIC<=X'", help="a bound the selected point must meet "
                   "(repeatable; replaces the grid's select.constraints)")
    p.set_defaults(handler=lambda args: _cmd_tune(args, loaded_of))

    p = sub.add_parser(
        "plots", help="operator plots: price heatmaps, bottlenecks, latency CDFs",
        description="From a simulation: the shadow prices of --price-policy after every "
                    "price update (prices.png: instance x slot over time, one column per "
                    "resource: batch, KV, compute), the bottleneck resource per instance "
                    "(bottleneck.png), and TTFT/EEL CDFs of "
                    "--policies (cdf.png). With --from-server URL: poll a live router's "
                    "GET /prices instead and draw prices.png and bottleneck.png.")
    add_run_options(p)
    p.add_argument("--policies", default="round_robin,least_outstanding,bid_price",
                   help="policies of the CDF plot (default: %(default)s)")
    p.add_argument("--price-policy", default="bid_price",
                   help="policy whose prices are drawn (default: %(default)s)")
    p.add_argument("--from-server", metavar="URL",
                   help="a running router (http://host:port) to poll instead of simulating")
    p.add_argument("--poll-s", type=float, default=30.0, metavar="S",
                   help="with --from-server: poll for S seconds (default: %(default)s)")
    p.add_argument("--period-s", type=float, default=1.0, metavar="S",
                   help="with --from-server: seconds between polls (default: %(default)s)")
    p.set_defaults(handler=lambda args: _cmd_plots(args, loaded_of))


def _cmd_tune(args: argparse.Namespace, loaded_of: LoadFn) -> int:
    from dataclasses import replace

    from olproute.operator.plots import pareto_plot
    from olproute.operator.tune import (
        analyse,
        run_sweep,
        selected_profile,
        summary_lines,
        write_csv,
    )
    from olproute.operator.tune_grid import load_grid

    if not args.out:
        print("olproute tune: error: --out DIR is required", file=sys.stderr)
        return 2
    executor = executor_of(args, args.jobs)  # ExecutorError before any work
    grid = load_grid(args.grid)
    loaded = loaded_of(args)
    selection = grid.selection
    if args.select:
        selection = replace(selection, metric=args.select)
    if args.constraint:
        selection = replace(selection, constraints=tuple(args.constraint))
    points = grid.points(args.random, seed=loaded.config.sim.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    where = (f"Ray at {args.ray_address}" if args.ray_address else
             f"{args.jobs} job(s)" + (" on a local Ray" if args.executor == "ray" else ""))
    t0 = time.perf_counter()
    with executor.session():   # Ray connected or started before the calibration
        print(f"tune: {len(points)} points of {args.grid} with {args.policy}, {where}; "
              "calibrating first ...", file=sys.stderr)
        results = run_sweep(loaded, points, args.policy, args.jobs, not args.no_progress,
                            executor=executor.kind, ray_address=executor.ray_address)
    tune = analyse(results, selection)
    write_csv(tune, out / "tune.csv")
    source = f"{'random search, ' + str(args.random) + ' draws' if args.random else 'grid'}"
    pareto_plot(tune, out / "pareto.png",
                title=f"olproute tune: {len(points)} points ({source}), {args.policy}, "
                      f"{results[0].summary.num_requests} requests, seed "
                      f"{loaded.config.sim.seed}")
    (out / "selected.yaml").write_text(selected_profile(loaded, tune, grid, source))
    print("\n".join(summary_lines(tune)))
    if not tune.feasible:
        print("tune: warning: no point met the constraints; selected.yaml is the closest",
              file=sys.stderr)
    print(f"wrote {out}/tune.csv, {out}/pareto.png, {out}/selected.yaml "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


def poll_prices(url: str, duration_s: float, period_s: float) -> list[tuple[float, Any]]:
    """(seconds since the first poll, ``GET /prices`` JSON) every ``period_s``."""
    polls: list[tuple[float, Any]] = []
    t0 = time.monotonic()
    while True:
        t = time.monotonic() - t0
        with urllib.request.urlopen(url.rstrip("/") + "/prices", timeout=10) as r:
            polls.append((t, json.loads(r.read())))
        if t + period_s > duration_s:
            return polls
        time.sleep(max(period_s - (time.monotonic() - t0 - t), 0.0))


def _cmd_plots(args: argparse.Namespace, loaded_of: LoadFn) -> int:
    from olproute.operator.plots import PriceTrace, bottleneck_plot, price_heatmap, record_prices

    if not args.out:
        print("olproute plots: error: --out DIR is required", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_server:
        polls = poll_prices(args.from_server, args.poll_s, args.period_s)
        try:
            trace = PriceTrace.from_polls(polls)
        except ValueError as exc:
            raise ConfigError(args.from_server, [("", str(exc))]) from exc
        where = f"{args.from_server}, {len(polls)} polls"
        price_heatmap(trace, out / "prices.png", title=f"shadow prices: {where}")
        bottleneck_plot(trace, out / "bottleneck.png")
        print(f"wrote {out}/prices.png, {out}/bottleneck.png")
        return 0

    from olproute.sim.metrics import summarize
    from olproute.sim.plots import latency_cdfs
    from olproute.sim.runner import summary_table
    from olproute.sim.scenario import CalibrationSource, build_requests, simulate

    loaded = loaded_of(args)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    reqs = build_requests(loaded)
    cal = CalibrationSource(loaded)
    res, trace = record_prices(loaded, args.price_policy, reqs, cal)
    runs = {args.price_policy: res}
    for name in names:
        if name not in runs:
            runs[name] = simulate(loaded, name, reqs, calibration=cal)
    what = f"{loaded.path.name}, {len(reqs)} requests, seed {loaded.config.sim.seed}"
    price_heatmap(trace, out / "prices.png", title=f"{args.price_policy} shadow prices: {what}")
    bottleneck_plot(trace, out / "bottleneck.png")
    latency_cdfs([(n, runs[n]) for n in names], out / "cdf.png", title=what)
    cost_lambda = loaded.config.reward.cost_lambda
    print(summary_table([(n, summarize(runs[n], loaded.profiles, cost_lambda))
                         for n in names]))
    print(f"wrote {out}/prices.png, {out}/bottleneck.png, {out}/cdf.png")
    return 0
