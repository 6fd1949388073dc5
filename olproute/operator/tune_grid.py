"""The search space of ``olproute tune``: a grid file, its points, and the selection rule.

Grid file format (YAML). Top-level sections are those a weight profile may set
(``reward``, ``admission``, ``prices``; keys as in ``olproute/config/schema.py``) plus an
optional ``select``. Each key's value is one of:

- a scalar: fixed in every point (``ttft_threshold_s: 0.3``);
- a list: the values to try (``zeta2: [0, 5, 20]``); random search draws from it;
- a range ``{min: 0.001, max: 0.1, num: 3, log: true}``: ``num`` evenly spaced values
  (geometric with ``log``) in a grid, uniform (log-uniform) draws in random search;
  integer bounds give integers.

``select`` says which point becomes ``selected.yaml`` (the command line's ``--select``
and ``--constraint`` override it)::

    select:
      metric: slo_attainment              # any Summary field (olproute/sim/metrics.py)
      constraints: ["ttft_p99_s <= 1.0"]  # metric <=, >=, <, > number

The rule: among the points that meet every constraint, the best value of ``metric``
(higher is better for attainment, goodput, throughput, served and on-time utility; lower
for every other metric), ties broken by lower P99 TTFT, then by lower point number. If no
point meets the constraints, the point with the smallest sum of relative violations
(``|value - bound| / max(|bound|, 1e-9)``) is chosen, and the output says so.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from olproute.config.profiles import SECTIONS, _section_problems
from olproute.config.read import ConfigError, read_yaml
from olproute.sim.metrics import Summary

MAX_GRID_POINTS = 100_000
DEFAULT_METRIC = "slo_attainment"
HIGHER_IS_BETTER = frozenset({"num_served", "throughput_tokens_per_s",
                              "throughput_requests_per_s", "slo_attainment", "goodput",
                              "on_time_utility"})
METRICS = tuple(f.name for f in fields(Summary) if f.name != "num_requests")
Op = Literal["<=", ">=", "<", ">"]
_CONSTRAINT = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+|inf|nan)\s*$")
_RANGE_KEYS = frozenset({"min", "max", "num", "log"})


@dataclass(frozen=True, slots=True)
class Param:
    """One swept key: its grid values, or a range for random draws (and grid points)."""

    section: str
    key: str
    values: tuple[Any, ...] = ()        # a list in the grid file
    low: float = 0.0                    # a range
    high: float = 0.0
    num: int = 3
    log: bool = False
    integer: bool = False

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    def grid_values(self) -> list[Any]:
        if self.values:
            return list(self.values)
        if self.log:
            xs = np.geomspace(self.low, self.high, self.num)
        else:
            xs = np.linspace(self.low, self.high, self.num)
        if self.integer:
            return sorted({round(float(x)) for x in xs})
        return [float(f"{x:.6g}") for x in xs]

    def draw(self, rng: np.random.Generator) -> Any:
        if self.values:
            return self.values[int(rng.integers(len(self.values)))]
        if self.integer:
            return int(rng.integers(int(self.low), int(self.high) + 1))
        if self.log:
            x = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            x = rng.uniform(self.low, self.high)
        return float(f"{x:.6g}")


@dataclass(frozen=True, slots=True)
class Constraint:
    metric: str
    op: Op
    bound: float

    def holds(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return {"<=": value <= self.bound, ">=": value >= self.bound,
                "<": value < self.bound, ">": value > self.bound}[self.op]

    def violation(self, value: float) -> float:
        """0 when met, else the relative distance to the bound (inf for NaN)."""
        if self.holds(value):
            return 0.0
        if math.isnan(value):
            return math.inf
        return abs(value - self.bound) / max(abs(self.bound), 1e-9)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.bound:g}"


@dataclass(frozen=True, slots=True)
class Selection:
    metric: str = DEFAULT_METRIC
    constraints: tuple[Constraint, ...] = ()

    def describe(self) -> str:
        way = "max" if self.metric in HIGHER_IS_BETTER else "min"
        text = f"{way} {self.metric}"
        if self.constraints:
            text += " subject to " + ", ".join(str(c) for c in self.constraints)
        return text


@dataclass(frozen=True, slots=True)
class Grid:
    path: Path
    fixed: Mapping[str, Mapping[str, Any]]
    params: tuple[Param, ...]
    selection: Selection

    def points(self, random: int | None = None, seed: int = 0) -> list[dict[str, dict[str, Any]]]:
        """Every grid point (the product of the swept keys' values), or ``random`` draws;
        each point is a weight profile: {section: {key: value}} with the fixed keys."""
        if random is not None:
            rng = np.random.default_rng(seed)
            combos = [tuple(p.draw(rng) for p in self.params) for _ in range(random)]
        else:
            size = math.prod(len(p.grid_values()) for p in self.params)
            if size > MAX_GRID_POINTS:
                raise ConfigError(self.path, [("", f"the grid has {size} points (more than "
                                                   f"{MAX_GRID_POINTS}): use --random N")])
            combos = list(itertools.product(*(p.grid_values() for p in self.params)))
        out = []
        for combo in combos:
            point: dict[str, dict[str, Any]] = {s: dict(b) for s, b in self.fixed.items()}
            for p, v in zip(self.params, combo, strict=True):
                point.setdefault(p.section, {})[p.key] = v
            out.append(point)
        return out


def parse_constraint(text: str) -> Constraint:
    """``"ttft_p99_s <= 1.0"`` -> Constraint; ValueError naming what is wrong."""
    m = _CONSTRAINT.match(text)
    if m is None:
        raise ValueError(f"expected 'metric <= number' (or >=, <, >), got {text!r}")
    metric, op, bound = m.group(1), m.group(2), m.group(3)
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
    try:
        value = float(bound)
    except ValueError:
        raise ValueError(f"not a number: {bound!r}") from None
    return Constraint(metric, op, value)  # type: ignore[arg-type]


def selection_problems(data: Any) -> tuple[Selection, list[tuple[str, str]]]:
    if not isinstance(data, Mapping):
        return Selection(), [("select", "must be a mapping with metric and constraints")]
    problems = [(f"select.{k}", "unknown key (known: metric, constraints)")
                for k in data if k not in ("metric", "constraints")]
    metric = data.get("metric", DEFAULT_METRIC)
    if metric not in METRICS:
        problems.append(("select.metric", f"unknown metric {metric!r} "
                                          f"(known: {', '.join(METRICS)})"))
    raw = data.get("constraints", [])
    if isinstance(raw, str):
        raw = [raw]
    constraints = []
    if not isinstance(raw, list):
        problems.append(("select.constraints", "must be a list of 'metric <= number'"))
        raw = []
    for i, text in enumerate(raw):
        try:
            constraints.append(parse_constraint(str(text)))
        except ValueError as exc:
            problems.append((f"select.constraints[{i}]", str(exc)))
    return Selection(str(metric), tuple(constraints)), problems


def _param(section: str, key: str, spec: Any, default: Mapping[str, Any],
           model: Any) -> tuple[Param | None, Any, list[tuple[str, str]]]:
    """(swept param or None, fixed value or None, problems) of one grid key."""
    where = f"{section}.{key}"
    if key not in default:
        return None, None, [(where, f"unknown key (the {section} section has: "
                                    f"{', '.join(default)})")]

    def check(value: Any, suffix: str) -> list[tuple[str, str]]:
        return [(where + suffix, msg) for _k, msg in
                _section_problems(section, model, default, {key: value})]

    if isinstance(spec, list):
        if not spec:
            return None, None, [(where, "an empty list: give at least one value")]
        problems = [p for i, v in enumerate(spec) for p in check(v, f"[{i}]")]
        return Param(section, key, values=tuple(spec)), None, problems
    if isinstance(spec, Mapping):
        problems = [(f"{where}.{k}", "unknown key (a range has: min, max, num, log)")
                    for k in spec if k not in _RANGE_KEYS]
        for k in ("min", "max"):
            if k not in spec:
                problems.append((f"{where}.{k}", "required key is missing"))
            elif isinstance(spec[k], bool) or not isinstance(spec[k], int | float):
                problems.append((f"{where}.{k}", f"must be a number, got {spec[k]!r}"))
            else:
                problems += check(spec[k], f".{k}")
        num, log = spec.get("num", 3), spec.get("log", False)
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            problems.append((f"{where}.num", f"must be an integer >= 1, got {num!r}"))
        if not isinstance(log, bool):
            problems.append((f"{where}.log", f"must be true or false, got {log!r}"))
        if problems:
            return None, None, problems
        low, high = spec["min"], spec["max"]
        if low > high:
            return None, None, [(where, f"min {low} > max {high}")]
        if log and low <= 0:
            return None, None, [(f"{where}.min", "must be > 0 with log: true")]
        integer = isinstance(low, int) and isinstance(high, int) and not log
        return Param(section, key, low=float(low), high=float(high), num=num, log=log,
                     integer=integer), None, []
    return None, spec, check(spec, "")


def load_grid(path: str | os.PathLike[str]) -> Grid:
    """Read and check a grid file; errors name the file and the key."""
    p = Path(path)
    data = read_yaml(p)
    if not isinstance(data, Mapping):
        raise ConfigError(p, [("", "top level must be a mapping of sections "
                                   f"({', '.join(SECTIONS)}, select)")])
    problems: list[tuple[str, str]] = []
    fixed: dict[str, dict[str, Any]] = {}
    params: list[Param] = []
    selection = Selection()
    for name, body in data.items():
        if name == "select":
            selection, found = selection_problems(body)
            problems += found
            continue
        model = SECTIONS.get(str(name))
        if model is None:
            problems.append((str(name), "unknown section (known: "
                                        f"{', '.join(SECTIONS)}, select)"))
            continue
        if not isinstance(body, Mapping):
            problems.append((str(name), "must be a mapping of keys"))
            continue
        default = model().model_dump()
        for key, spec in body.items():
            param, value, found = _param(str(name), str(key), spec, default, model)
            problems += found
            if param is not None:
                params.append(param)
            elif not found:
                fixed.setdefault(str(name), {})[str(key)] = value
    if not params and not problems:
        problems.append(("", "nothing to sweep: give at least one key a list or a range"))
    if problems:
        raise ConfigError(p, problems)
    return Grid(p, fixed, tuple(params), selection)


# -- choosing points ---------------------------------------------------------------------------
def pareto_mask(minimize: Sequence[Sequence[float]]) -> np.ndarray:
    """Points no other point dominates, every objective minimised (negate to maximise);
    a point with a NaN objective is never on the front."""
    x = np.asarray(minimize, dtype=np.float64).T  # (points, objectives)
    ok = ~np.isnan(x).any(axis=1)
    mask = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        others = x[ok]
        dominated = np.any(np.all(others <= x[i], axis=1) & np.any(others < x[i], axis=1))
        mask[i] = not dominated
    return mask


def select(rows: Sequence[Mapping[str, float]], selection: Selection) -> tuple[int, bool]:
    """(index of the selected row, whether it meets every constraint), by the rule in
    the module docstring."""
    if not rows:
        raise ValueError("no points to select from")
    sign = -1.0 if selection.metric in HIGHER_IS_BETTER else 1.0

    def key(i: int) -> tuple[float, float, int]:
        v = float(rows[i][selection.metric])
        p99 = float(rows[i]["ttft_p99_s"])
        return (math.inf if math.isnan(v) else sign * v,
                math.inf if math.isnan(p99) else p99, i)

    feasible = [i for i, r in enumerate(rows)
                if all(c.holds(float(r[c.metric])) for c in selection.constraints)]
    if feasible:
        return min(feasible, key=key), True

    def violation(i: int) -> tuple[float, tuple[float, float, int]]:
        return (sum(c.violation(float(rows[i][c.metric])) for c in selection.constraints),
                key(i))

    return min(range(len(rows)), key=violation), False
