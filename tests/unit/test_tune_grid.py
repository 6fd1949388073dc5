"""The grid file of ``olproute tune``: points, random draws, errors naming the file and
key; the Pareto front and the selection rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.config.loader import ConfigError
from olproute.operator.tune_grid import (
    Constraint,
    Selection,
    load_grid,
    pareto_mask,
    parse_constraint,
    select,
)


def _grid(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_grid_points_are_the_product_with_fixed_keys(tmp_path: Path) -> None:
    grid = load_grid(_grid(tmp_path, {
        "reward": {"zeta2": [0, 5], "gamma": {"min": 0.001, "max": 0.1, "num": 3, "log": True},
                   "ttft_threshold_s": 0.3},
        "admission": {"mode": ["defer", "shed"], "max_waiting": {"min": 0, "max": 4, "num": 3}},
    }))
    points = grid.points()
    assert len(points) == 2 * 3 * 2 * 3
    assert points[0] == {"reward": {"ttft_threshold_s": 0.3, "zeta2": 0, "gamma": 0.001},
                         "admission": {"mode": "defer", "max_waiting": 0}}
    assert sorted({p["reward"]["gamma"] for p in points}) == [0.001, 0.01, 0.1]
    assert sorted({p["admission"]["max_waiting"] for p in points}) == [0, 2, 4]
    assert all(isinstance(p["admission"]["max_waiting"], int) for p in points)
    assert grid.selection == Selection()


def test_random_draws_are_seeded_and_stay_in_range(tmp_path: Path) -> None:
    grid = load_grid(_grid(tmp_path, {
        "reward": {"zeta2": {"min": 0.1, "max": 100.0, "log": True}, "delta": [0.5, 1, 2]},
        "admission": {"max_waiting": {"min": 0, "max": 3}}}))
    a, b = grid.points(random=50, seed=7), grid.points(random=50, seed=7)
    assert a == b and a != grid.points(random=50, seed=8)
    z = np.array([p["reward"]["zeta2"] for p in a])
    assert z.min() >= 0.1 and z.max() <= 100.0 and (z < 1).any() and (z > 10).any()
    assert {p["reward"]["delta"] for p in a} <= {0.5, 1, 2}
    assert {p["admission"]["max_waiting"] for p in a} <= {0, 1, 2, 3}


def test_select_section_is_read(tmp_path: Path) -> None:
    grid = load_grid(_grid(tmp_path, {
        "reward": {"zeta2": [0, 1]},
        "select": {"metric": "ttft_p99_s", "constraints": ["num_shed <= 0",
                                                           "throughput_tokens_per_s>=100"]}}))
    assert grid.selection == Selection("ttft_p99_s", (
        Constraint("num_shed", "<=", 0.0), Constraint("throughput_tokens_per_s", ">=", 100.0)))


@pytest.mark.parametrize(("content", "key", "message"), [
    ({"reward": {"zeta2": [0, -1]}}, "reward.zeta2[1]", "must be >= 0"),
    ({"reward": {"zeta2": []}}, "reward.zeta2", "empty list"),
    ({"reward": {"zeta9": [1]}}, "reward.zeta9", "unknown key"),
    ({"reward": {"zeta2": {"min": 1}}}, "reward.zeta2.max", "required key is missing"),
    ({"reward": {"zeta2": {"min": 5, "max": 1}}}, "reward.zeta2", "min 5 > max 1"),
    ({"reward": {"zeta2": {"min": 0, "max": 1, "log": True}}}, "reward.zeta2.min", "> 0"),
    ({"reward": {"zeta2": {"min": 0, "max": 1, "num": 0}}}, "reward.zeta2.num", ">= 1"),
    ({"reward": {"zeta2": {"min": 0, "max": 1, "step": 2}}}, "reward.zeta2.step",
     "unknown key"),
    ({"reward": {"zeta2": {"min": "a", "max": 1}}}, "reward.zeta2.min", "must be a number"),
    ({"admission": {"mode": ["defer", "drop"]}}, "admission.mode[1]", "must be one of"),
    ({"router": {"policy": ["x"]}}, "router", "unknown section"),
    ({"reward": {"zeta2": 1.0}}, "", "nothing to sweep"),
    ({"reward": {"zeta2": [1]}, "select": {"metric": "speed"}}, "select.metric",
     "unknown metric"),
    ({"reward": {"zeta2": [1]}, "select": {"constraints": ["p99 < 3"]}},
     "select.constraints[0]", "unknown metric"),
    ({"reward": {"zeta2": [1]}, "select": {"constraints": ["ttft_p99_s ~ 3"]}},
     "select.constraints[0]", "expected 'metric <= number'"),
    ({"reward": {"zeta2": [1]}, "select": {"goal": "x"}}, "select.goal", "unknown key"),
    ("[1, 2]\n", "", "top level must be a mapping"),
])
def test_bad_grid_files_name_the_file_and_key(tmp_path: Path, content: Any, key: str,
                                              message: str) -> None:
    path = _grid(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    text = str(info.value)
    assert text.startswith(f"{path}: "), text
    if key:
        assert f": {key}: " in text, text
    assert message in text, text


def test_huge_grids_ask_for_random_search(tmp_path: Path) -> None:
    keys = ("sigma", "alpha", "beta", "gamma", "zeta1", "zeta2", "omega", "delta")
    grid = load_grid(_grid(tmp_path, {"reward": {k: list(range(5)) for k in keys}}))
    with pytest.raises(ConfigError, match="use --random N"):
        grid.points()
    assert len(grid.points(random=3)) == 3


def test_parse_constraint() -> None:
    assert parse_constraint("ttft_p99_s<=0.5") == Constraint("ttft_p99_s", "<=", 0.5)
    assert parse_constraint(" goodput > 0.9 ") == Constraint("goodput", ">", 0.9)
    with pytest.raises(ValueError, match="unknown metric"):
        parse_constraint("num_requests <= 3")
    c = Constraint("ttft_p99_s", "<=", 1.0)
    assert c.holds(1.0) and not c.holds(1.5) and not c.holds(float("nan"))
    assert c.violation(1.0) == 0.0 and c.violation(1.5) == pytest.approx(0.5)


def test_pareto_mask() -> None:
    # minimise both: (1, 3), (2, 2), (3, 1) are the front; (3, 3) is dominated,
    # (2, 2) twice: duplicates do not dominate each other; NaN is never on the front
    a = [1, 2, 3, 3, 2, np.nan]
    b = [3, 2, 1, 3, 2, 0]
    assert pareto_mask([a, b]).tolist() == [True, True, True, False, True, False]


def _row(**kw: float) -> dict[str, float]:
    base = {"slo_attainment": 0.5, "ttft_p99_s": 1.0, "num_shed": 0.0}
    return {**base, **kw}


def test_select_best_feasible_with_ties_by_p99_then_order() -> None:
    rows = [_row(slo_attainment=0.9, ttft_p99_s=2.0), _row(slo_attainment=0.9, ttft_p99_s=1.0),
            _row(slo_attainment=0.95, num_shed=5), _row(slo_attainment=0.9, ttft_p99_s=1.0)]
    assert select(rows, Selection("slo_attainment")) == (2, True)
    no_shed = Selection("slo_attainment", (Constraint("num_shed", "<=", 0.0),))
    assert select(rows, no_shed) == (1, True)  # tie at 0.9: lower P99, then first
    assert select(rows, Selection("ttft_p99_s")) == (1, True)  # lower is better


def test_select_closest_when_nothing_is_feasible() -> None:
    rows = [_row(ttft_p99_s=3.0), _row(ttft_p99_s=1.5), _row(ttft_p99_s=float("nan"))]
    sel = Selection("slo_attainment", (Constraint("ttft_p99_s", "<=", 1.0),))
    assert select(rows, sel) == (1, False)
