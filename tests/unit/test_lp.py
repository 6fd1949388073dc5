"""The exact LP: HiGHS against the cvxpy twin, KKT conditions, weak and strong duality
through D(p), cases solved by hand (one where KV binds, one where only compute binds),
the dense and difference forms and column generation against each other, and the
rolling-to-absolute price mapping. The random instances have all three resources
(batch, KV, compute) and the tests check that compute is priced in them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.config.loader import RewardConfig
from olproute.pricing.reward import BATCH, COMPUTE, KV, reward_terms
from olproute.routing.outlook import Outlook
from solvers.certificate import PriceUpdate, absolute_prices, dual_value, online_reward
from solvers.cvx import enumerate_columns, solve_cvx, usage_matrix
from solvers.lp import LpSolution, solve
from solvers.problem import (
    LpProblem,
    block_price,
    column_block,
    price_cumsums,
    random_instance,
)

SMALL = dict(num_requests=14, num_instances=2, num_slots=30, max_delay=5)


def small(seed: int, **kw: object) -> LpProblem:
    args: dict[str, object] = {**SMALL, "seed": seed, **kw}
    return random_instance(**args)  # type: ignore[arg-type]


# -- KKT helpers (as in cvxpy's solver tests: primal feasibility, dual domain,
# complementary slackness), on the dense rows written out by the cvxpy twin --------------
def _dense_rows(prob: LpProblem, sol: LpSolution) -> tuple[np.ndarray, np.ndarray]:
    use = usage_matrix(prob, sol.cols).reshape(-1, len(sol.cols))
    assign = np.zeros((prob.num_requests, len(sol.cols)))
    assign[sol.cols.request, np.arange(len(sol.cols))] = 1.0
    return use, assign


def check_primal_feasible(prob: LpProblem, sol: LpSolution, tol: float) -> None:
    use, assign = _dense_rows(prob, sol)
    assert sol.x.min() >= -tol
    assert (assign @ sol.x - 1.0).max() <= tol
    assert (use @ sol.x - prob.capacity.ravel()).max() <= tol


def check_dual_feasible(prob: LpProblem, sol: LpSolution, tol: float) -> None:
    use, assign = _dense_rows(prob, sol)
    assert sol.p.min() >= 0.0 and sol.y.min() >= 0.0
    reduced = sol.cols.reward - use.T @ sol.p.ravel() - assign.T @ sol.y
    assert reduced.max() <= tol


def check_complementarity(prob: LpProblem, sol: LpSolution, tol: float) -> None:
    use, assign = _dense_rows(prob, sol)
    reduced = sol.cols.reward - use.T @ sol.p.ravel() - assign.T @ sol.y
    assert np.abs(sol.x * reduced).max() <= tol
    assert np.abs(sol.p.ravel() * (prob.capacity.ravel() - use @ sol.x)).max() <= tol
    assert np.abs(sol.y * (1.0 - assign @ sol.x)).max() <= tol


# -- the reward of every start slot is the policy's reward ---------------------------------
def test_reward_grid_matches_reward_terms() -> None:
    w = RewardConfig(alpha=0.5, zeta1=2.0, eel_threshold_s=4.0, zeta2=1.5, omega=0.7)
    prob = random_instance(12, 3, 40, seed=4, max_delay=30, reward=w, horizon=50)
    blk = column_block(prob, np.arange(prob.num_requests))
    for j in range(prob.num_requests):
        for d in (0, 1, 7, 30):
            ttft = prob.exec_ttft_s[j] + d * prob.slot_s
            look = Outlook(decode_tokens=prob.decode_tokens[j], quality=prob.utility[j],
                           cost_musd=np.zeros(prob.num_instances))
            terms = reward_terms(int(prob.prompt_tokens[j]), float(prob.ttft_target_s[j]),
                                 look, ttft, prob.tpot_s[j], w, prob.slot_s, prob.horizon)
            # a column cut by the grid's end counts the share of its decode inside it
            s, e = blk.start[j, :, d], blk.end[j, :, d]
            inside = np.clip((e - s) / prob.duration[j], 0.0, 1.0)
            np.testing.assert_allclose(blk.reward[j, :, d], terms.total * inside, rtol=1e-12)


def test_columns_match_the_plain_enumeration() -> None:
    prob = small(0)
    blk = column_block(prob, np.arange(prob.num_requests))
    plain = enumerate_columns(prob)
    assert len(plain) == int(blk.valid.sum())
    np.testing.assert_array_equal(plain.start, blk.start[plain.request, plain.instance,
                                                         plain.delay])
    np.testing.assert_array_equal(plain.end, blk.end[plain.request, plain.instance,
                                                     plain.delay])
    np.testing.assert_allclose(plain.reward, blk.reward[plain.request, plain.instance,
                                                        plain.delay], rtol=1e-12)


# -- HiGHS against cvxpy -------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_highs_and_cvxpy_agree(seed: int) -> None:
    prob = small(seed, load=1.0 + 0.3 * seed)
    ref = solve_cvx(prob)
    assert ref.status == "optimal"
    for kw in ({"strategy": "full", "method": "simplex"},
               {"strategy": "full", "method": "ipm"},
               {"strategy": "full", "form": "dense", "method": "simplex"},
               {"strategy": "colgen"},
               {"strategy": "colgen", "method": "simplex"}):
        sol = solve(prob, **kw)  # type: ignore[arg-type]
        assert sol.status == "Optimal", kw
        assert sol.objective == pytest.approx(ref.objective, rel=1e-7), kw


@pytest.mark.parametrize("seed", [0, 5])
def test_kkt_of_the_highs_solution(seed: int) -> None:
    prob = small(seed, load=1.6)
    for kw in ({"strategy": "full", "method": "simplex"}, {"strategy": "colgen",
                                                           "method": "simplex"}):
        sol = solve(prob, **kw)  # type: ignore[arg-type]
        check_primal_feasible(prob, sol, 1e-6)
        check_dual_feasible(prob, sol, 1e-6)
        check_complementarity(prob, sol, 1e-6)


def test_the_instance_is_congested() -> None:
    """The random instances must make the LP choose: otherwise the tests above would
    check nothing about capacity."""
    prob = small(0, load=1.6)
    sol = solve(prob, strategy="full", method="simplex")
    assert sol.x.sum() < prob.num_requests - 1
    assert sol.p.max() > 0
    assert sol.p[:, :, COMPUTE].max() > 0, "compute must be priced, or nothing checks it"


# -- D(p) -----------------------------------------------------------------------------------
_PROB = small(7, load=1.5)
_LP = solve(_PROB, strategy="full", method="simplex")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(scale=st.floats(0.0, 50.0), seed=st.integers(0, 2**31 - 1),
       sparsity=st.floats(0.0, 1.0))
def test_weak_duality_for_any_prices(scale: float, seed: int, sparsity: float) -> None:
    rng = np.random.default_rng(seed)
    p = rng.exponential(scale, _PROB.free.shape) * (rng.random(_PROB.free.shape) < sparsity)
    assert dual_value(_PROB, p) >= _LP.objective * (1 - 1e-9)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(scale=st.floats(0.0, 50.0), seed=st.integers(0, 2**31 - 1))
def test_weak_duality_for_compute_prices_alone(scale: float, seed: int) -> None:
    """Prices on the compute rows only (batch and KV free): D(p) still bounds LP*."""
    rng = np.random.default_rng(seed)
    p = np.zeros(_PROB.free.shape)
    p[:, :, COMPUTE] = rng.exponential(scale, p.shape[:2])
    assert dual_value(_PROB, p) >= _LP.objective * (1 - 1e-9)


def test_the_lp_prices_compute() -> None:
    assert _LP.p[:, :, COMPUTE].max() > 0


def test_block_price_is_the_dense_usage_times_p() -> None:
    """a.p from cumulative sums (batch, KV ramp and compute interval) equals the dense
    usage of every column (built through olproute.pricing.reward.dense) times p."""
    p = np.random.default_rng(3).exponential(1.0, _PROB.free.shape)
    blk = column_block(_PROB, np.arange(_PROB.num_requests))
    p0, p1 = price_cumsums(p)
    fast = block_price(_PROB, blk, p0, p1)
    plain = enumerate_columns(_PROB)
    dense_price = usage_matrix(_PROB, plain).reshape(-1, len(plain)).T @ p.ravel()
    np.testing.assert_allclose(fast[plain.request, plain.instance, plain.delay], dense_price,
                               rtol=1e-10, atol=1e-12)


def test_strong_duality_at_the_lp_prices() -> None:
    assert dual_value(_PROB, _LP.p) == pytest.approx(_LP.objective, rel=1e-7)
    sol = solve(_PROB, strategy="colgen")
    assert sol.bound == pytest.approx(sol.objective, rel=1e-7)
    assert dual_value(_PROB, sol.p) == pytest.approx(_LP.objective, rel=1e-7)


def test_coarse_grid_is_a_valid_upper_bound() -> None:
    coarse = solve(_PROB, strategy="full", form="dense", coarsen=4, method="simplex")
    assert coarse.objective >= _LP.objective * (1 - 1e-9)
    # its prices, copied to every slot of their block, are a dual solution of the fine LP
    assert dual_value(_PROB, coarse.p) == pytest.approx(coarse.objective, rel=1e-7)


def test_negative_prices_are_rejected() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        dual_value(_PROB, -np.ones(_PROB.free.shape))


# -- by hand -----------------------------------------------------------------------------------
def hand_problem() -> LpProblem:
    """One instance, two slots, two requests arriving in slot 0 that start at once
    (no prefill time, no delay) and decode for two slots. KV: (599 + 1) / 1000 = 0.6 on
    the first slot and 0.65 on the second (50 tokens per slot); 10 batch slots, never
    binding. Rewards: sigma 1 + quality (1 and 0.5), nothing else."""
    w = RewardConfig(sigma=1.0, beta=0.0, gamma=0.0, omega=1.0, cost_lambda=0.0)
    return LpProblem(
        slot_s=0.05, num_slots=2, horizon=100, t0_s=0.0, arrival_s=np.array([0.0, 0.01]),
        prompt_tokens=np.array([599.0, 599.0]), ttft_target_s=np.array([1.0, 1.0]),
        decode_tokens=np.array([[100.0], [100.0]]), utility=np.array([[1.0], [0.5]]),
        tpot_s=np.full((2, 1), 0.001), exec_ttft_s=np.zeros((2, 1)),
        batch_cap=np.array([10.0]), kv_cap=np.array([1000.0]), compute_cap=np.array([1e9]),
        free=np.ones((1, 2, 3)), reward=w, max_delay=0)


@pytest.mark.parametrize("kw", [{"strategy": "full", "method": "simplex"},
                                {"strategy": "full", "method": "ipm"},
                                {"strategy": "colgen"}])
def test_two_requests_by_hand(kw: dict[str, str]) -> None:
    """KV in slot 1 binds: 0.65 x1 + 0.65 x2 <= 1. Request 1 (reward 2) is served whole,
    request 2 (reward 1.5) takes the rest, x2 = 0.35 / 0.65 = 7/13. Duals: the KV price of
    slot 1 makes request 2 break even, p = 1.5 / 0.65; request 1's surplus is its row's
    dual, y1 = 2 - 0.65 p = 0.5; y2 = 0 and every other price 0."""
    prob = hand_problem()
    sol = solve(prob, **kw)  # type: ignore[arg-type]
    x = np.zeros(2)
    x[sol.cols.request] = sol.x
    assert x == pytest.approx([1.0, 7 / 13], abs=1e-7)
    assert sol.objective == pytest.approx(2.0 + 1.5 * 7 / 13, rel=1e-9)
    expected_p = np.zeros((1, 2, 3))
    expected_p[0, 1, KV] = 1.5 / 0.65
    np.testing.assert_allclose(sol.p, expected_p, atol=1e-6)
    np.testing.assert_allclose(sol.y, [0.5, 0.0], atol=1e-6)
    ref = solve_cvx(prob)
    np.testing.assert_allclose(ref.p, expected_p, atol=1e-6)
    np.testing.assert_allclose(ref.y, [0.5, 0.0], atol=1e-6)


def compute_problem() -> LpProblem:
    """One instance, three slots, budget b = 1,000 prefill tokens per slot; batch (1e6
    slots) and KV (1e9 tokens) never bind. Three requests arrive in slot 0, may not wait
    (max delay 0) and decode for one slot:
    - A: 1,500 tokens, first token in slot 2 (queue-free TTFT 100 ms): P = 2 prefill slots
      before it, [0, 2), 0.75 of the budget in each; reward 1 + 1.0;
    - B:   800 tokens, first token in slot 2: P = 1, slot [1, 2), 0.8; reward 1 + 0.5;
    - C:   600 tokens, first token in slot 1: P = 1, slot [0, 1), 0.6; reward 1 + 0.5."""
    w = RewardConfig(sigma=1.0, beta=0.0, gamma=0.0, omega=1.0, cost_lambda=0.0)
    return LpProblem(
        slot_s=0.05, num_slots=3, horizon=100, t0_s=0.0, arrival_s=np.zeros(3),
        prompt_tokens=np.array([1500.0, 800.0, 600.0]), ttft_target_s=np.ones(3),
        decode_tokens=np.full((3, 1), 10.0), utility=np.array([[1.0], [0.5], [0.5]]),
        tpot_s=np.full((3, 1), 0.001), exec_ttft_s=np.array([[0.1], [0.1], [0.05]]),
        batch_cap=np.array([1e6]), kv_cap=np.array([1e9]), compute_cap=np.array([1000.0]),
        free=np.ones((1, 3, 3)), reward=w, max_delay=0)


@pytest.mark.parametrize("kw", [{"strategy": "full", "method": "simplex"},
                                {"strategy": "full", "form": "dense", "method": "simplex"},
                                {"strategy": "full", "method": "ipm"},
                                {"strategy": "colgen"}])
def test_only_compute_binds_by_hand(kw: dict[str, str]) -> None:
    """Slot 0: 0.75 xA + 0.6 xC <= 1; slot 1: 0.75 xA + 0.8 xB <= 1. With xC = 1 and both
    slots full, xA = 0.4 / 0.75 = 8/15 and xB = 0.6 / 0.8 = 3/4, objective 2 (8/15) + 1.5
    (3/4) + 1.5 = 443/120 (xA = 1 gives 3.09, xA = 0 gives 3: the optimum trades A
    against B and C). The vertex is not degenerate, so the duals are unique: B breaks
    even on slot 1, p1 = 1.5 / 0.8 = 15/8; A on both, p0 = 2 / 0.75 - p1 = 19/24; C's
    surplus is its row's dual, y_C = 1.5 - 0.6 p0 = 41/40. Batch and KV prices are 0."""
    prob = compute_problem()
    sol = solve(prob, **kw)  # type: ignore[arg-type]
    x = np.zeros(3)
    np.add.at(x, sol.cols.request, sol.x)
    assert x == pytest.approx([8 / 15, 3 / 4, 1.0], abs=1e-7)
    assert sol.objective == pytest.approx(443 / 120, rel=1e-9)
    expected_p = np.zeros((1, 3, 3))
    expected_p[0, :, COMPUTE] = [19 / 24, 15 / 8, 0.0]
    np.testing.assert_allclose(sol.p, expected_p, atol=1e-6)
    assert (sol.p[0, :2, COMPUTE] > 0).all()
    assert not sol.p[:, :, [BATCH, KV]].any()
    np.testing.assert_allclose(sol.y, [0.0, 0.0, 41 / 40], atol=1e-6)
    ref = solve_cvx(prob)
    assert ref.objective == pytest.approx(443 / 120, rel=1e-7)
    np.testing.assert_allclose(ref.p, expected_p, atol=1e-6)


def test_an_unlimited_budget_prices_no_compute() -> None:
    """compute_load = 0: the same batch and KV data, compute rows that never bind."""
    prob = small(0, load=1.6, compute_load=0.0)
    base = small(0, load=1.6)
    np.testing.assert_array_equal(prob.free[:, :, :2], base.free[:, :, :2])
    sol = solve(prob, strategy="full", method="simplex")
    assert not sol.p[:, :, COMPUTE].any()
    # taking a resource away can only lower the optimum
    assert sol.objective >= solve(base, strategy="full", method="simplex").objective - 1e-9


@pytest.mark.parametrize("seed", [1, 4])
def test_dense_and_difference_forms_agree(seed: int) -> None:
    """Compute-heavy (twice the budget's worth of prefill): both forms reach the same
    LP*, and each one's prices are optimal duals of the other (D(p) = LP*)."""
    prob = small(seed, num_requests=30, num_slots=40, load=1.2, compute_load=2.0)
    dense_rows = solve(prob, strategy="full", form="dense", method="simplex")
    diff = solve(prob, strategy="full", method="simplex")
    assert diff.p[:, :, COMPUTE].max() > 0
    assert diff.objective == pytest.approx(dense_rows.objective, rel=1e-8)
    assert dual_value(prob, diff.p) == pytest.approx(dense_rows.objective, rel=1e-7)
    assert dual_value(prob, dense_rows.p) == pytest.approx(diff.objective, rel=1e-7)


def test_colgen_agrees_with_the_full_lp() -> None:
    prob = random_instance(150, 3, 80, seed=11, max_delay=25, load=1.4, compute_load=1.8)
    full = solve(prob, strategy="full", method="simplex")
    for kw in ({"strategy": "colgen"}, {"strategy": "colgen", "method": "simplex"}):
        gen = solve(prob, **kw)  # type: ignore[arg-type]
        assert gen.status == "Optimal", kw
        assert gen.objective == pytest.approx(full.objective, rel=1e-7), kw
        assert gen.bound == pytest.approx(full.objective, rel=1e-6), kw
        assert len(gen.cols) < len(full.cols), kw


# -- prices and rewards from a run ---------------------------------------------------------------
def test_absolute_prices_take_the_freshest_update() -> None:
    h = 4
    first = PriceUpdate(time_s=1.0, origin_s=1.0, p=np.arange(h, dtype=float).reshape(1, h, 1)
                        .repeat(3, axis=2))
    second = PriceUpdate(time_s=1.12, origin_s=1.1, p=np.full((1, h, 3), 10.0))
    p = absolute_prices([second, first], t0_s=1.0, slot_s=0.05, num_slots=8)
    # slots 0, 1 (t = 1.00, 1.05) from the first update; slots from t = 1.10 on from the
    # second, which covers 4 slots (to t = 1.30); the rest takes its horizon mean
    assert p.shape == (1, 8, 3)
    for r in range(3):
        assert p[0, :, r].tolist() == [0.0, 1.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    early = absolute_prices([second], t0_s=0.9, slot_s=0.05, num_slots=2)
    assert early[0, :, 1].tolist() == [10.0, 10.0]   # before the first origin: its slot 0


def test_online_reward_is_the_reward_of_realised_times() -> None:
    prob = hand_problem()
    prob = dataclasses.replace(prob, reward=RewardConfig(sigma=1.0, beta=0.01, gamma=0.02,
                                                         omega=0.0), num_slots=60,
                               free=np.ones((1, 60, 3)))
    # request 0: first token 0.12 s after arrival (slot 3), done 2 s later (100 tokens);
    # request 1: never served
    got = online_reward(prob, np.array([0, -1]), np.array([0.12, np.nan]),
                        np.array([2.12, np.nan]))
    k0, d = 3, 40
    whole = 1.0 + 0.01 * (100 - (k0 + d)) + 0.02 * (100 - k0)
    assert got[0] == pytest.approx(whole)
    assert got[1] == 0.0
    # on a grid ending 20 slots after the first token, half the decode is inside it: the
    # reward is prorated as the LP's columns are
    short = dataclasses.replace(prob, num_slots=23, free=np.ones((1, 23, 3)))
    got = online_reward(short, np.array([0, -1]), np.array([0.12, np.nan]),
                        np.array([2.12, np.nan]))
    assert got[0] == pytest.approx(whole * 20 / 40)
    # unless asked not to cut it (runs that end at different times compared)
    got = online_reward(short, np.array([0, -1]), np.array([0.12, np.nan]),
                        np.array([2.12, np.nan]), prorate=False)
    assert got[0] == pytest.approx(whole)


@pytest.mark.parametrize("coarsen", [2, 3, 7])
def test_coarse_difference_form_matches_coarse_dense_rows(coarsen: int) -> None:
    prob = small(2, load=1.5, num_slots=31)
    dense_rows = solve(prob, strategy="full", form="dense", coarsen=coarsen, method="simplex")
    diff = solve(prob, strategy="full", coarsen=coarsen, method="simplex")
    gen = solve(prob, strategy="colgen", coarsen=coarsen)
    assert diff.objective == pytest.approx(dense_rows.objective, rel=1e-7)
    assert gen.objective == pytest.approx(dense_rows.objective, rel=1e-7)
    assert gen.bound == pytest.approx(gen.objective, rel=1e-7)
    fine = solve(prob, strategy="full", method="simplex")
    assert diff.objective >= fine.objective * (1 - 1e-9)


def test_best_scale_never_loses_to_the_prices_as_given() -> None:
    from solvers.certificate import best_scale

    p = np.random.default_rng(1).exponential(3.0, _PROB.free.shape)
    lam, d = best_scale(_PROB, p)
    assert 0.0 <= lam <= 4.0
    assert d <= dual_value(_PROB, p) + 1e-9 and d >= _LP.objective * (1 - 1e-9)
    # no multiple of the LP's own prices does better than they do (D(p*) = LP*)
    _, d_star = best_scale(_PROB, _LP.p)
    assert d_star == pytest.approx(_LP.objective, rel=1e-6)


def test_lp_load_is_the_dense_usage_of_the_solution() -> None:
    from solvers.check import lp_load

    use, _ = _dense_rows(_PROB, _LP)
    np.testing.assert_allclose(lp_load(_PROB, _LP).ravel(), use @ _LP.x, atol=1e-12)
