"""``olproute tune``: sweep reward weights (and admission / price keys) in the simulator,
in worker processes or as Ray tasks (``olproute.operator.executors``), and pick a weight profile.

Every point runs the same requests on the same seed with the same calibration (profiled
once, in the parent), so points differ only by their weights. The selection is made on
that one seed: a figure reported for the selected profile belongs on other seeds
(``bench/tune_check.py`` runs it on the report seeds). Outputs in the folder:

- ``tune.csv``: one row per point: the swept and fixed keys (``reward.zeta2``, ...), every
  Summary metric, the wall time, whether the point is on each Pareto front, and whether
  it was selected;
- ``pareto.png``: P99 TTFT vs token throughput (over the arrival window, as
  ``Summary.throughput_tokens_per_s``), and mean TTFT vs OnTimeUtility (mean EEL when the
  requests carry no per-model quality), fronts drawn, front points and the selected one
  labelled;
- ``selected.yaml``: the selected point as a weight profile (``--weights`` of
  ``simulate``, ``compare``, ``serve``; the body of ``POST /admin/reload``).

The grid file and the selection rule: ``olproute.operator.tune_grid``.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olproute.config.loader import LoadedConfig
from olproute.config.profiles import SECTIONS, merge_profile, profile_yaml
from olproute.estimate.calibration import InstanceCalibration
from olproute.operator.executors import Executor
from olproute.operator.tune_grid import Grid, Selection, pareto_mask, select
from olproute.sim.metrics import Summary, summarize
from olproute.sim.scenario import CalibrationSource, build_requests, simulate
from olproute.types import Request

Point = dict[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class PointResult:
    index: int
    point: Point
    summary: Summary
    wall_s: float

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"point": self.index}
        for section, body in self.point.items():
            for key, value in body.items():
                out[f"{section}.{key}"] = value
        out.update(self.summary.as_dict())
        out["wall_s"] = round(self.wall_s, 3)
        return out


@dataclass(frozen=True, slots=True)
class TuneResult:
    results: tuple[PointResult, ...]
    front_throughput: tuple[bool, ...]   # P99 TTFT (min) vs tokens/s over arrivals (max)
    front_second: tuple[bool, ...]       # mean TTFT (min) vs utility (max) or mean EEL (min)
    second_metric: str                   # "on_time_utility" or "eel_mean_s"
    selected: int                        # position in results
    feasible: bool                       # the selected point meets every constraint
    selection: Selection


def apply_point(loaded: LoadedConfig, point: Mapping[str, Mapping[str, Any]],
                where: str | Path = "grid") -> LoadedConfig:
    """``loaded`` with the point's keys merged over its sections."""
    config = merge_profile(loaded.config, point, where)
    return loaded.with_updates(**{s: getattr(config, s) for s in point})


def run_point(loaded: LoadedConfig, requests: Sequence[Request],
              calibration: Sequence[InstanceCalibration], policy: str, index: int,
              point: Point) -> PointResult:
    """One simulation (top-level, so worker processes can run it)."""
    t0 = time.perf_counter()
    run = apply_point(loaded, point)
    res = simulate(run, policy, requests,
                   calibration=CalibrationSource(run, known=calibration))
    summary = summarize(res, run.profiles, run.config.reward.cost_lambda)
    return PointResult(index, point, summary, time.perf_counter() - t0)


def run_sweep(loaded: LoadedConfig, points: Sequence[Point], policy: str = "bid_price",
              jobs: int = 2, progress: bool = True,
              calibration: CalibrationSource | None = None, executor: str = "process",
              ray_address: str | None = None) -> list[PointResult]:
    """Every point on the config's requests and seed, with a progress bar on stderr, run
    by ``executor``: ``process``, ``jobs`` at a time in worker processes (``jobs == 1``:
    in this process); ``ray``, as Ray tasks on a local Ray of ``jobs`` CPUs or on the
    cluster at ``ray_address``. Results come back in point order whatever order they
    finish in, and are the same whichever executor ran them; a point that raises stops
    the sweep with ``executors.CallFailed`` naming it."""
    runner = Executor(executor, jobs, ray_address)
    runner.check()   # before the calibration: a missing Ray or a bad address at once
    for point in points:  # every point is checked before any runs
        apply_point(loaded, point)
    requests = build_requests(loaded)
    cal = tuple((calibration or CalibrationSource(loaded))())
    from tqdm import tqdm

    calls = [(loaded, requests, cal, policy, i, point) for i, point in enumerate(points)]
    with runner.session(), tqdm(total=len(points), desc="tune", unit="point",
                                file=sys.stderr, disable=not progress, leave=True) as bar:
        # the bar starts once a local Ray is up (a few seconds)
        return runner.run(run_point, calls, on_done=lambda i, r: bar.update(1),
                          describe=lambda i: f"point {i} {points[i]}")


def analyse(results: Sequence[PointResult], selection: Selection) -> TuneResult:
    """Pareto fronts and the selected point."""
    rows = [r.summary.as_dict() for r in results]

    def col(name: str, sign: float = 1.0) -> list[float]:
        return [sign * float(r[name]) for r in rows]

    front1 = pareto_mask([col("ttft_p99_s"), col("throughput_tokens_per_s", -1.0)])
    has_utility = all(math.isfinite(float(r["on_time_utility"])) for r in rows)
    second = "on_time_utility" if has_utility else "eel_mean_s"
    front2 = pareto_mask([col("ttft_mean_s"), col(second, -1.0 if has_utility else 1.0)])
    chosen, feasible = select(rows, selection)
    return TuneResult(tuple(results), tuple(bool(x) for x in front1),
                      tuple(bool(x) for x in front2), second, chosen, feasible, selection)


def write_csv(tune: TuneResult, path: Path) -> None:
    rows = [r.row() for r in tune.results]
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([*cols, "pareto_throughput", f"pareto_{tune.second_metric}", "selected"])
        for i, r in enumerate(rows):
            w.writerow([_cell(r.get(c)) for c in cols]
                       + [int(tune.front_throughput[i]), int(tune.front_second[i]),
                          int(i == tune.selected)])


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def varied_keys(results: Sequence[PointResult]) -> list[str]:
    """``section.key`` names whose value differs between points."""
    seen: dict[str, set[str]] = {}
    for r in results:
        for section, body in r.point.items():
            for key, value in body.items():
                seen.setdefault(f"{section}.{key}", set()).add(repr(value))
    return [k for k, vals in seen.items() if len(vals) > 1]


def identical_groups(results: Sequence[PointResult]) -> dict[int, list[int]]:
    """Points whose runs came out identical (every metric equal: their weights made the
    same decisions), as {first position: [positions]}."""
    first: dict[str, int] = {}
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(results):
        key = repr(sorted(r.summary.as_dict().items()))
        j = first.setdefault(key, i)
        groups.setdefault(j, []).append(i)
    return groups


def point_label(point: Point, keys: Sequence[str]) -> str:
    parts = []
    for name in keys:
        section, key = name.split(".", 1)
        v = point.get(section, {}).get(key)
        parts.append(f"{key}={v:g}" if isinstance(v, float) else f"{key}={v}")
    return " ".join(parts)


def selected_profile(loaded: LoadedConfig, tune: TuneResult, grid: Grid,
                     source: str) -> str:
    """The selected point as profile YAML: the whole reward section as merged (so the
    profile does not depend on the config it is applied to) and each other section the
    grid touched, with a header saying where it came from."""
    best = tune.results[tune.selected]
    run = apply_point(loaded, best.point)
    sections: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        if name == "reward" or name in best.point:
            sections[name] = getattr(run.config, name).model_dump()
    s = best.summary
    header = [
        f"olproute tune: point {best.index} of {len(tune.results)} ({source})",
        f"grid {grid.path}, config {loaded.path}, seed {loaded.config.sim.seed}, "
        f"{s.num_requests} requests",
        f"rule: {tune.selection.describe()}" + ("" if tune.feasible else
                                                 "  -- NO point met the constraints: "
                                                 "this is the closest one"),
        f"its metrics: TTFT attainment {s.slo_attainment:.4f}, TTFT mean "
        f"{s.ttft_mean_s * 1e3:.1f} ms, P99 {s.ttft_p99_s * 1e3:.1f} ms, EEL mean "
        f"{s.eel_mean_s:.2f} s, {s.throughput_tokens_per_s:.0f} tokens/s over the arrival "
        f"window, {s.num_shed} shed (served {s.served_fraction:.3f}), P99 TTFT over all "
        f"requests {_ms(s.ttft_p99_all_s)} (a refused one infinitely late); on seed "
        f"{loaded.config.sim.seed} only",
        "apply with: olproute serve --weights THIS_FILE (or simulate / compare), or",
        "POST /admin/reload with {\"weights\": \"THIS_FILE\"}",
        "",
    ]
    return profile_yaml(sections, header)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if math.isfinite(seconds) else "inf"


def summary_lines(tune: TuneResult) -> list[str]:
    """A table of the front points and the selected one, for the terminal.
    TTFT mean / p99 and EEL mean are over the served requests, beside the served
    fraction and the P99 TTFT over all requests (a refused one infinitely late); tok/s
    is over the arrival window."""
    keys = varied_keys(tune.results)
    utility = tune.second_metric == "on_time_utility"
    head = (f"{'point':>5}  {'front':<5}  {'TTFT att.':>9}  {'TTFT mean ms':>12}  "
            f"{'TTFT p99 ms':>11}  {'p99 all ms':>10}  {'EEL mean s':>10}  {'tok/s':>7}  "
            f"{'shed':>5}  {'served':>6}  " + (f"{'OnTimeU':>7}  " if utility else "")
            + "weights")
    lines = [head, "-" * len(head)]
    groups = identical_groups(tune.results)
    for i, members in groups.items():
        on1, on2 = tune.front_throughput[i], tune.front_second[i]
        chosen = tune.selected in members
        if not (on1 or on2 or chosen):
            continue
        r = tune.results[tune.selected if chosen else i]
        s = r.summary
        mark = ("T" if on1 else "-") + ("U" if on2 else "-") + ("*" if chosen else " ")
        same = f" (+{len(members) - 1} identical)" if len(members) > 1 else ""
        p99_all = (f"{s.ttft_p99_all_s * 1e3:.1f}" if math.isfinite(s.ttft_p99_all_s)
                   else "inf")
        lines.append(f"{r.index:>5}  {mark:<5}  {s.slo_attainment:>9.4f}  "
                     f"{s.ttft_mean_s * 1e3:>12.1f}  {s.ttft_p99_s * 1e3:>11.1f}  "
                     f"{p99_all:>10}  {s.eel_mean_s:>10.2f}  "
                     f"{s.throughput_tokens_per_s:>7.0f}  {s.num_shed:>5}  "
                     f"{s.served_fraction:>6.3f}  "
                     + (f"{s.on_time_utility:>7.3f}  " if utility else "")
                     + f"{point_label(r.point, keys)}{same}")
    lines.append(f"front: T = P99 TTFT vs tokens/s, U = mean TTFT vs "
                 f"{tune.second_metric}; * = selected ({tune.selection.describe()}); "
                 "identical: other points with the same metrics (all in tune.csv); TTFT and "
                 "EEL over the served requests, p99 all: over every request (refused = "
                 "infinitely late); tok/s over the arrival window")
    return lines
