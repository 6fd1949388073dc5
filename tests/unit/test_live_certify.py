"""``solvers.live.certify`` on a LiveWindow built by hand (no server, no simulation): the
window becomes a WindowLog as the server captured it, and the check's figures are
plain, JSON-able numbers with weak duality holding."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from olproute.config.schema import RewardConfig
from olproute.routing.live_window import LiveWindow
from solvers.certificate import certificate, gap
from solvers.live import certify, to_log
from solvers.lp import solve
from solvers.record import build_window

H, G, R = 10, 2, 3


def hand_window() -> LiveWindow:
    """Two instances, four requests (the last refused), a tick at the start and two price
    updates after it."""
    n = 4
    prompt = np.array([500.0, 900.0, 300.0, 1200.0])
    return LiveWindow(
        t0_s=0.0, t1_s=0.6, slot_s=0.05, horizon=H, reward=RewardConfig(),
        batch_cap=np.array([2.0, 2.0]), kv_cap=np.array([3000.0, 3000.0]),
        compute_cap=np.array([600.0, 400.0]),
        arrival_s=np.array([0.0, 0.02, 0.11, 0.5]), prompt_tokens=prompt,
        ttft_target_s=np.ones(n), first_seen_s=np.array([0.0, 0.02, 0.11, 0.5]),
        ttft_hat_s=np.full((n, G), 0.1), tpot_s=np.full((n, G), 0.02),
        decode_tokens=np.full((n, G), 50.0), utility=np.full((n, G), 0.7),
        exec_ttft_s=np.repeat(prompt[:, None] / 20_000.0, G, axis=1),
        instance=np.array([0, 1, 0, -1]), first_token_s=np.array([0.1, 0.2, 0.3, np.nan]),
        finish_s=np.array([1.1, 1.2, 1.3, np.nan]),
        update_s=np.array([0.25, 0.5]), origin_s=np.array([0.25, 0.5]),
        prices=(np.full((G, H, R), 0.1), np.full((G, H, R), 0.2)),
        free_s=0.0, free=np.full((G, H, R), 0.9), gap_tol=0.0, time_limit_s=30.0)


def test_the_window_becomes_a_log() -> None:
    w = hand_window()
    log = to_log(w)
    assert [(u.time_s, u.origin_s) for u in log.updates] == [(0.25, 0.25), (0.5, 0.5)]
    assert [u.p[0, 0, 0] for u in log.updates] == [0.1, 0.2]
    assert len(log.free) == 1 and log.free[0][0] == 0.0 and log.free[0][1] is w.free
    assert log.compute_cap.tolist() == [600.0, 400.0]


def test_certify_reports_weak_duality_in_plain_numbers() -> None:
    out = certify(hand_window())
    assert out["requests"] == 4 and out["instances"] == G
    assert out["lp_status"] == "Optimal"
    assert out["lp_value"] > 0
    assert out["d_online"] >= out["lp_value"] * (1 - 1e-6)
    assert out["certificate"] >= -1e-6
    assert math.isclose(out["online_over_lp"], out["online_reward"] / out["lp_value"])
    assert out["rows"] == G * out["slots"] * R
    assert 0 <= out["binding_rows"] <= out["rows"]
    assert sum(out["binding_by_resource"].values()) == out["binding_rows"]
    assert out["price_updates"] == 2 and out["solve_s"] >= 0
    json.dumps(out, allow_nan=False)   # plain numbers


def test_certify_without_price_updates_uses_zero_prices() -> None:
    w = hand_window()
    w = dataclasses.replace(w, update_s=np.zeros(0), origin_s=np.zeros(0), prices=())
    out = certify(w)
    assert out["price_updates"] == 0
    # zero prices: D(0) is the sum of the best rewards, an upper bound of LP*
    assert out["certificate"] >= -1e-6 and out["online_priced_rows"] == 0


def test_one_lp_thread_after_a_solve_with_the_default_threads() -> None:
    """HiGHS makes one thread scheduler per process at its first run: certify's one
    thread must still solve after a solve with the default count (it used to fail with
    status 'Not Set' and LP* = 0 when the tests ran in that order)."""
    w = hand_window()
    prob, _ = build_window(to_log(w), w.t0_s, w.t1_s)
    assert solve(prob).status == "Optimal"
    out = certify(w)
    assert out["lp_status"] == "Optimal" and out["lp_value"] > 0
    assert solve(prob).status == "Optimal"   # and the default count after it


def test_a_window_no_request_can_earn_in_certifies_without_dividing_by_zero() -> None:
    """A predicted TPOT of 0 (no decode fits a KV row: LP* is 0) and a prediction of no
    output token: the check still answers, with plain numbers."""
    w = hand_window()
    out = certify(dataclasses.replace(w, tpot_s=np.zeros_like(w.tpot_s)))
    assert out["lp_value"] == 0.0 and out["online_over_lp"] is None
    assert out["certificate"] == 0.0 or out["certificate"] == math.inf
    out = certify(dataclasses.replace(w, decode_tokens=np.zeros_like(w.decode_tokens)))
    assert math.isfinite(out["online_reward"]) and out["certificate"] >= -1e-6


def test_certificate_and_gap_of_a_zero_optimum() -> None:
    assert certificate(0.0, 0.0) == 0.0 and certificate(1.5, 0.0) == math.inf
    assert certificate(3.0, 2.0) == 0.5
    assert gap(0.0, 0.0) == 0.0 and gap(4.0, 1.0) == 0.75
