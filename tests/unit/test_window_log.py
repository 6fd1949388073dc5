"""``build_window`` and ``check`` on a WindowLog built by hand: which requests a window
keeps, its grid, initial occupancy and max delay, and the check's per-resource counts
(no simulation, so these run whatever state the policies are in)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from olproute.config.loader import RewardConfig
from olproute.pricing.reward import RESOURCES
from solvers.certificate import PriceUpdate
from solvers.check import check, format_check
from solvers.record import WindowLog, build_window

H = 10


def tick_free(level: float) -> np.ndarray:
    """(2, H, 3) free capacity with a distinct value per (instance, slot, resource)."""
    g, k, r = np.meshgrid(np.arange(2), np.arange(H), np.arange(3), indexing="ij")
    out: np.ndarray = level - 0.01 * k - 0.1 * r - 0.05 * g
    return out


def hand_log() -> WindowLog:
    """Two instances, five requests; request 3 was never decided, request 4 never served."""
    n = 5
    prompt = np.array([500.0, 900.0, 300.0, 400.0, 1200.0])
    return WindowLog(
        slot_s=0.05, horizon=H, reward=RewardConfig(), batch_cap=np.array([2.0, 2.0]),
        kv_cap=np.array([3000.0, 3000.0]), compute_cap=np.array([600.0, 400.0]),
        arrival_s=np.array([0.0, 0.02, 0.11, 0.3, 0.5]), prompt_tokens=prompt,
        ttft_target_s=np.ones(n), first_seen_s=np.array([0.0, 0.02, 0.11, np.nan, 0.5]),
        ttft_hat_s=np.full((n, 2), 0.1), tpot_s=np.full((n, 2), 0.02),
        decode_tokens=np.full((n, 2), 50.0), utility=np.full((n, 2), 0.7),
        exec_ttft_s=np.repeat(prompt[:, None] / 20_000.0, 2, axis=1),
        instance=np.array([0, 1, 0, -1, -1]),
        first_token_s=np.array([0.1, 0.2, 0.3, np.nan, np.inf]),
        finish_s=np.array([1.1, 1.2, 1.3, np.nan, np.inf]),
        updates=(PriceUpdate(0.0, 0.0, np.full((2, H, 3), 0.1)),),
        free=((0.0, tick_free(0.9)), (0.25, tick_free(0.8))))


def test_whole_run_window() -> None:
    log = hand_log()
    prob, ids = build_window(log)
    assert ids.tolist() == [0, 1, 2, 4]           # request 3 was never decided
    # largest realised wait 0.19 s -> 4 slots; grid [0, 0.55) = 11 slots + 4 of tail
    assert prob.max_delay == 4 and prob.num_slots == 15
    np.testing.assert_array_equal(prob.free[:, :H], tick_free(0.9))
    assert (prob.free[:, H:] == 1.0).all()          # past the tick's horizon
    np.testing.assert_array_equal(prob.compute_cap, log.compute_cap)
    np.testing.assert_array_equal(prob.prompt_tokens, log.prompt_tokens[ids])


def test_window_from_a_later_tick_moves_its_free_capacity() -> None:
    prob, ids = build_window(hand_log(), t0_s=0.35, t1_s=0.6, max_delay=2, tail_slots=20)
    assert ids.tolist() == [4]
    assert prob.num_slots == 5 + 20
    # 0.35 - 0.25 is two slots (a rounding error short of it in floating point)
    np.testing.assert_array_equal(prob.free[:, :H - 2], tick_free(0.8)[:, 2:])
    assert (prob.free[:, H - 2:] == 1.0).all()


def test_an_empty_window_is_an_error() -> None:
    with pytest.raises(ValueError, match="no request"):
        build_window(hand_log(), t0_s=0.31, t1_s=0.45)


@pytest.mark.parametrize("with_updates", [True, False])
def test_check_counts_rows_per_resource(with_updates: bool) -> None:
    log = hand_log() if with_updates else dataclasses.replace(hand_log(), updates=())
    prob, ids = build_window(log)
    res, sol, p_online = check(log, ids, prob)
    assert res.lp_status == "Optimal"
    assert res.rows == prob.num_instances * prob.num_slots * 3
    assert tuple(res.binding_by_resource) == RESOURCES
    assert sum(res.binding_by_resource.values()) == res.lp_binding
    assert p_online.shape == sol.p.shape == (2, prob.num_slots, 3)
    assert bool(p_online.any()) == with_updates
    assert res.d_online >= res.lp_value * (1 - 1e-9)
    assert res.online_served == 3
    assert "compute" in format_check(res)
