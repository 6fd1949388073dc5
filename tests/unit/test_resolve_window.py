"""The re-solve's window (``olproute.server.capture.pack_recent``): the requests of the
last ``prices.resolve_window_s`` on the latest tick's free capacity, and the real
``solvers.resolve.resolve_live`` solving it in this process."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest

from olproute.config.schema import PriceConfig, RewardConfig
from olproute.routing.live_window import LiveWindow
from olproute.server.capture import LiveCapture, pack_recent
from olproute.types import Decision, Request
from solvers.resolve import OK, max_delay_slots, resolve_live
from tests.unit.test_live_capture import View

G, H, R = 2, 40, 3
SLOT = 0.05
CFG = PriceConfig(resolve_period_s=1.0, resolve_window_s=1.0, sample_delays_slots=(0, 2, 6))


def _req(rid: int, arrival: float) -> Request:
    return Request(request_id=rid, arrival_s=arrival, prompt_tokens=400 + 100 * rid,
                   decode_tokens=20, predicted_decode_tokens=20, ttft_target_s=1.0)


def _decision(rid: int, prompt: float) -> Decision:
    """bid_price's explanation of a request: its per-instance LP inputs."""
    expl = {"ttft_s": (0.1, 0.15), "tpot_s": (0.02, 0.02), "decode_tokens": (20.0, 20.0),
            "utility": (0.7, 0.6), "exec_ttft_s": (prompt / 20_000, prompt / 15_000)}
    return Decision(rid, "dispatch", 0, "test", {**expl, "score": (0.0,) * G})


def _view(t: float, free: float) -> View:
    return View(origin_s=t, num_updates=1, prices=np.full((G, H, R), 0.1),
                free=np.full((G, H, R), free), compute_budget=np.array([600.0, 400.0]))


def _filled() -> LiveCapture:
    """Ticks every 0.5 s up to 3.0 (free capacity falling), a request every 0.25 s from
    0.1 on, each decided 10 ms after its arrival."""
    cap = LiveCapture(G, capacity=64)
    for k in range(7):
        cap.ticked(0.5 * k, _view(0.5 * k, 1.0 - 0.05 * k), keep_s=100.0)  # type: ignore[arg-type]
    for rid in range(13):
        req = _req(rid, 0.1 + 0.25 * rid)
        cap.decided(req, _decision(rid, req.prompt_tokens), now_s=req.arrival_s + 0.01)
    return cap


def _pack(cap: LiveCapture, now: float, cfg: PriceConfig = CFG) -> LiveWindow | None:
    return pack_recent(cap, now, cfg, RewardConfig(), SLOT, H, np.array([2.0, 2.0]),
                       np.array([3000.0, 3000.0]))


def test_pack_recent_takes_the_last_window_on_the_latest_tick() -> None:
    cap = _filled()
    w = _pack(cap, 3.2)
    assert w is not None
    assert (w.t0_s, w.t1_s) == pytest.approx((2.2, 3.2))
    assert w.arrival_s.tolist() == pytest.approx([2.35, 2.6, 2.85, 3.1])
    assert w.first_seen_s.tolist() == pytest.approx([2.36, 2.61, 2.86, 3.11])
    assert w.prompt_tokens.tolist() == [1300.0, 1400.0, 1500.0, 1600.0]
    assert w.free_s == 3.0 and w.free is cap.ticks[-1].free   # the latest tick's, shared
    assert w.compute_cap.tolist() == [600.0, 400.0]
    assert w.max_delay_slots == max_delay_slots(CFG) == 6
    assert w.time_limit_s == CFG.resolve_time_limit_s
    assert w.prices == () and w.update_s.size == 0   # a re-solve needs no price history
    w.arrival_s[0] = -1.0   # a copy: the ring is not written
    assert cap.scalars[cap.order(), 0].min() == pytest.approx(0.1)
    assert pickle.loads(pickle.dumps(w)).num_requests == 4


def test_pack_recent_is_none_without_a_tick_or_a_request() -> None:
    assert _pack(LiveCapture(G, capacity=4), 1.0) is None   # nothing at all
    cap = LiveCapture(G, capacity=4)
    cap.decided(_req(0, 0.1), _decision(0, 400.0), now_s=0.1)
    assert _pack(cap, 0.5) is None                           # no tick yet
    assert _pack(_filled(), 10.0) is None                    # none in the last window


def test_pack_recent_starts_after_an_evicted_request() -> None:
    cap = LiveCapture(G, capacity=2)
    for rid in range(4):
        cap.ticked(0.25 * rid, _view(0.25 * rid, 1.0), keep_s=100.0)  # type: ignore[arg-type]
        cap.decided(_req(rid, 0.1 + 0.25 * rid), _decision(rid, 400.0), now_s=0.1 + 0.25 * rid)
    w = _pack(cap, 1.0)
    assert w is not None and w.t0_s > 0.35 and w.arrival_s.tolist() == pytest.approx([0.6, 0.85])


def test_resolve_live_solves_the_packed_window() -> None:
    w = _pack(_filled(), 3.2)
    assert w is not None
    res = resolve_live(w)
    assert res.outcome == OK and res.error is None, res.error
    assert res.t0_s == w.free_s and res.requests == 4 and res.lp_value > 0
    assert res.p is not None and res.p.shape[0] == G and res.p.shape[2] == R
    # the window's slots and the tail a request may start late in
    assert res.p.shape[1] == round((w.t1_s - w.t0_s) / SLOT) + max_delay_slots(CFG)
    assert np.all(np.isfinite(res.p)) and np.all(res.p >= 0)


def test_resolve_live_needs_the_max_delay() -> None:
    w = _pack(_filled(), 3.2)
    assert w is not None
    with pytest.raises(ValueError, match="max_delay_slots"):
        resolve_live(replace(w, max_delay_slots=None))
