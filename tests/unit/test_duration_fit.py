"""How right the model was about time (solvers.check.DurationFit) and the LP on the
durations that held (solvers.check.realised_problem)."""

from __future__ import annotations

import numpy as np
import pytest

from solvers.check import duration_fit, realised_problem
from solvers.lp import solve
from solvers.problem import random_instance


def _served(n: int, g: int, seed: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    instance = rng.integers(-1, g, n)            # -1: not served
    first = np.where(instance >= 0, rng.uniform(0.0, 5.0, n), np.inf)
    return instance, first


def test_the_fit_is_the_ratio_of_realised_to_predicted_decode() -> None:
    prob = random_instance(40, 3, 60, seed=1)
    instance, first = _served(40, 3, 2)
    j = np.nonzero(instance >= 0)[0]
    predicted = prob.decode_tokens[j, instance[j]] * prob.tpot_s[j, instance[j]]
    finish = first.copy()
    finish[j] = first[j] + 1.5 * predicted       # every decode 1.5x its prediction
    fit = duration_fit(prob, instance, first, finish)
    assert fit.served == j.size
    assert fit.duration_ratio == pytest.approx(1.5) and fit.occupancy_ratio == pytest.approx(1.5)
    span = prob.num_slots * prob.slot_s * prob.num_instances
    assert fit.running_predicted == pytest.approx(predicted.sum() / span)
    assert fit.running_realised == pytest.approx(1.5 * predicted.sum() / span)
    # one decode twice as long: the per-request mean and the sums weigh it differently
    finish[j[0]] = first[j[0]] + 3.0 * predicted[0]
    fit = duration_fit(prob, instance, first, finish)
    assert fit.duration_ratio == pytest.approx(1.5 + 1.5 / j.size)
    assert fit.occupancy_ratio == pytest.approx(1.5 + 1.5 * predicted[0] / predicted.sum())


def test_the_realised_lp_holds_what_held() -> None:
    """Served requests on their instance: their realised TPOT; the rest: the prediction
    scaled by the instance's realised / predicted; an LP on longer durations can only
    be worth less (every column uses as much or more of every row)."""
    prob = random_instance(40, 3, 60, seed=3, load=1.5)
    instance, first = _served(40, 3, 4)
    instance[instance == 2] = 0                  # instance 2 serves nothing
    j = np.nonzero(instance >= 0)[0]
    g = instance[j]
    predicted = prob.decode_tokens[j, g] * prob.tpot_s[j, g]
    rng = np.random.default_rng(5)
    realised = predicted * rng.uniform(1.1, 1.6, j.size)
    finish = first.copy()
    finish[j] = first[j] + realised
    real = realised_problem(prob, instance, first, finish)
    np.testing.assert_allclose(real.tpot_s[j, g], realised / prob.decode_tokens[j, g])
    scale0 = realised[g == 0].sum() / predicted[g == 0].sum()
    others = np.setdiff1d(np.arange(40), j[g == 0])
    np.testing.assert_allclose(real.tpot_s[others, 0], prob.tpot_s[others, 0] * scale0)
    np.testing.assert_array_equal(real.tpot_s[:, 2], prob.tpot_s[:, 2])
    assert (real.duration >= prob.duration).all()
    assert solve(real).objective <= solve(prob).objective + 1e-6
