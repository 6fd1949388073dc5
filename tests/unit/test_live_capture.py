"""The live certificate's capture (``olproute.server.capture``): a bounded ring of
requests recorded at their first decision and joined with their outcomes, the ticks of
the last windows, and the window ``pack`` hands to the certifier."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest

from olproute.config.schema import PriceConfig, RewardConfig
from olproute.server.capture import EXPLAINED, LiveCapture, pack, window_bounds
from olproute.types import Decision, Outcome, Request

G, H, R = 2, 8, 3
SLOT = 0.05
NO = -np.inf   # no request evicted


@dataclass(frozen=True)
class View:
    """The fields of ``olproute.types.PriceView`` the capture reads."""

    origin_s: float | None
    num_updates: int
    prices: np.ndarray
    free: np.ndarray
    compute_budget: np.ndarray


def _req(rid: int, arrival: float) -> Request:
    return Request(request_id=rid, arrival_s=arrival, prompt_tokens=10 + rid,
                   decode_tokens=5, predicted_decode_tokens=5, ttft_target_s=0.5)


def _decision(rid: int, scale: float = 1.0, missing: str | None = None) -> Decision:
    expl = {k: tuple(scale * (i + 1) * (rid + 1) for i in range(G)) for k in EXPLAINED
            if k != missing}
    return Decision(rid, "dispatch", 0, "test", {**expl, "score": (0.0,) * G})


def _outcome(rid: int, arrival: float, g: int | None, first: float | None,
             finish: float | None) -> Outcome:
    return Outcome(request_id=rid, instance=g, arrival_s=arrival, dispatch_s=arrival,
                   first_token_s=first, finish_s=finish, prompt_tokens=10, decode_tokens=5,
                   predicted_decode_tokens=5)


def _view(t: float, updates: int = 1) -> View:
    return View(origin_s=t if updates else None, num_updates=updates,
                prices=np.full((G, H, R), t), free=np.full((G, H, R), 1.0 - t / 100),
                compute_budget=np.array([100.0, 200.0]))


def _pack(cap: LiveCapture, now: float, **cfg: float) -> object:
    return pack(cap, now, PriceConfig(**cfg), RewardConfig(), SLOT, H,  # type: ignore[arg-type]
                np.array([4.0, 8.0]), np.array([1e4, 2e4]))


def test_ring_keeps_the_most_recent_requests_at_their_first_decision() -> None:
    cap = LiveCapture(G, capacity=4)
    for rid in range(6):
        assert cap.decided(_req(rid, 0.1 * rid), _decision(rid), now_s=0.1 * rid + 0.01)
    # a later decision of a held request changes nothing
    assert cap.decided(_req(5, 0.5), _decision(5, scale=-1.0), now_s=9.0)
    assert cap.num_requests == 4
    order = cap.order()
    assert cap.request_id[order].tolist() == [2, 3, 4, 5]
    assert cap.per_instance[0, order[-1]].tolist() == [6.0, 12.0]   # the first decision's
    assert cap.scalars[order[-1]].tolist() == pytest.approx([0.5, 15, 0.5, 0.51])
    # the overwritten requests' outcomes are no longer joined, and windows start after them
    cap.finished(_outcome(0, 0.0, 1, 0.2, 0.4))
    assert not cap.done[order].any()
    assert cap.evicted_s == pytest.approx(0.1)


def test_outcomes_are_joined_and_a_dropped_request_is_not_served() -> None:
    cap = LiveCapture(G, capacity=8)
    for rid in range(3):
        cap.decided(_req(rid, 0.1 * rid), _decision(rid), now_s=0.1 * rid)
    cap.finished(_outcome(0, 0.0, 1, 0.2, 0.9))       # served
    cap.finished(_outcome(1, 0.1, None, None, None))  # shed
    cap.dropped(2)                                    # its client left while held
    cap.finished(_outcome(7, 0.0, 0, 0.1, 0.2))       # never recorded: ignored
    i = [cap._slot[r] for r in range(3)]
    assert cap.instance[i].tolist() == [1, -1, -1]
    assert cap.times[i[0]].tolist() == [0.2, 0.9]
    assert np.isnan(cap.times[i[1:]]).all() and cap.done[i].all()


def test_an_explanation_without_the_lp_inputs_is_not_recorded() -> None:
    cap = LiveCapture(G, capacity=4)
    assert not cap.decided(_req(0, 0.0), _decision(0, missing="exec_ttft_s"), 0.0)
    assert cap.num_requests == 0 and cap.num_unexplained == 1
    assert cap.last_problem is not None and "exec_ttft_s" in cap.last_problem


def test_ticks_are_kept_for_keep_s_from_the_last_at_or_before() -> None:
    cap = LiveCapture(G, capacity=4)
    for k in range(10):
        cap.ticked(float(k), _view(float(k)), keep_s=3.0)  # type: ignore[arg-type]
    assert [t.time_s for t in cap.ticks] == [6.0, 7.0, 8.0, 9.0]
    cap.ticked(10.0, _view(10.0, updates=0), keep_s=3.0)  # type: ignore[arg-type]
    assert np.isnan(cap.ticks[-1].origin_s)


# (id, arrivals, done, ticks, now, window, max requests, dropped, (t0, t1))
BOUNDS = [
    ("all-done", [1.0, 2.0, 3.0], [1, 1, 1], [0.0, 2.5], 4.0, 10.0, 10, NO, (0.0, 4.0)),
    ("snap-to-tick", [1.0, 2.0, 3.0], [1, 1, 1], [0.5, 2.5], 4.0, 3.5, 10, NO, (0.5, 4.0)),
    ("running-ends-it", [1.0, 2.0, 3.0], [1, 0, 1], [0.0], 4.0, 10.0, 10, NO, (0.0, 2.0)),
    ("old-running-ignored", [1.0, 5.0, 9.0], [0, 1, 1], [4.0], 10.0, 6.0, 10, NO, (4.0, 10.0)),
    ("max-requests", [1.0, 2.0, 3.0, 3.5], [1, 1, 1, 1], [0.0, 3.2], 4.0, 10.0, 2, NO,
     (3.2, 4.0)),
    ("max-requests-no-tick", [1.0, 2.0, 3.0, 3.5], [1, 1, 1, 1], [0.0], 4.0, 10.0, 2, NO,
     (3.0, 4.0)),
    ("after-an-evicted-request", [2.2, 3.0], [1, 1], [0.0, 2.0, 2.5], 4.0, 10.0, 10, 2.0,
     (2.5, 4.0)),
    ("from-the-start", [0.05, 0.3], [1, 1], [0.5, 1.0], 2.0, 10.0, 10, NO, (0.0, 2.0)),
]


@pytest.mark.parametrize(("arrival", "done", "ticks", "now", "window", "max_req", "dropped",
                          "want"), [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_window_bounds(arrival: list[float], done: list[int], ticks: list[float], now: float,
                       window: float, max_req: int, dropped: float,
                       want: tuple[float, float]) -> None:
    got = window_bounds(np.array(arrival), np.array(done, dtype=bool), np.array(ticks), now,
                        window, max_req, dropped)
    assert got == pytest.approx(want)


def test_pack_copies_the_window_and_its_ticks() -> None:
    cap = LiveCapture(G, capacity=16)
    for k in range(6):
        cap.ticked(float(k), _view(float(k)), keep_s=100.0)  # type: ignore[arg-type]
    for rid in range(8):
        t = 0.6 * rid + 0.1
        cap.decided(_req(rid, t), _decision(rid), now_s=t)
        if rid != 6:
            cap.finished(_outcome(rid, t, rid % G, t + 0.1, t + 0.3))
    window = _pack(cap, 5.5, certify_window_s=4.0, certify_max_requests=16)
    # request 6 (arrived 3.7) is still running: the window ends there
    assert window.t1_s == pytest.approx(3.7)  # type: ignore[attr-defined]
    assert window.t0_s == 0.0  # type: ignore[attr-defined]
    w = window  # type: ignore[assignment]
    assert w.num_requests == 6 and w.num_instances == G  # type: ignore[attr-defined]
    assert w.arrival_s.tolist() == pytest.approx([0.1, 0.7, 1.3, 1.9, 2.5, 3.1])
    assert w.instance.tolist() == [0, 1, 0, 1, 0, 1]
    # the ticks from the last at or before t0 on: its free capacity, every update since
    assert w.free_s == 0.0 and w.free.tolist() == cap.ticks[0].free.tolist()
    assert w.update_s.tolist() == w.origin_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [p[0, 0, 0] for p in w.prices] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert w.ttft_hat_s.shape == w.exec_ttft_s.shape == (6, G)
    assert w.compute_cap.tolist() == [100.0, 200.0]
    before = w.ttft_hat_s.copy()
    cap.per_instance[:] = -1.0
    assert (w.ttft_hat_s == before).all()   # the requests' rows are copies
    assert pickle.loads(pickle.dumps(w)).arrival_s.tolist() == w.arrival_s.tolist()


def test_pack_starts_at_a_tick_and_leaves_out_ticks_without_update() -> None:
    cap = LiveCapture(G, capacity=16)
    for k, updates in enumerate([0, 0, 1, 2]):
        cap.ticked(float(k), _view(float(k), updates), keep_s=100.0)  # type: ignore[arg-type]
    for rid in range(4):
        cap.decided(_req(rid, 1.5 + 0.5 * rid), _decision(rid), now_s=1.5 + 0.5 * rid)
        cap.finished(_outcome(rid, 1.5 + 0.5 * rid, 0, 2.0 + rid, 2.5 + rid))
    w = _pack(cap, 4.0, certify_window_s=2.8)
    assert (w.t0_s, w.t1_s) == (2.0, 4.0)  # type: ignore[attr-defined]
    assert w.free_s == 2.0 and w.update_s.tolist() == [2.0, 3.0]  # type: ignore[attr-defined]
    assert w.arrival_s.tolist() == [2.0, 2.5, 3.0]  # type: ignore[attr-defined]


def test_pack_without_ticks_or_requests_is_none() -> None:
    cap = LiveCapture(G, capacity=4)
    cap.decided(_req(0, 0.1), _decision(0), 0.1)
    assert _pack(cap, 1.0) is None          # no tick yet
    cap = LiveCapture(G, capacity=4)
    cap.ticked(0.0, _view(0.0), keep_s=100.0)  # type: ignore[arg-type]
    assert _pack(cap, 1.0) is None          # no request


def test_resize_keeps_the_most_recent() -> None:
    cap = LiveCapture(G, capacity=8)
    for rid in range(6):
        cap.decided(_req(rid, float(rid)), _decision(rid), float(rid))
    cap.finished(_outcome(5, 5.0, 1, 5.1, 5.2))
    cap.resize(3)
    assert cap.evicted_s == 2.0
    assert cap.capacity == 3 and cap.request_id[cap.order()].tolist() == [3, 4, 5]
    cap.finished(_outcome(4, 4.0, 0, 4.1, 4.2))
    assert cap.instance[cap.order()].tolist() == [-1, 0, 1]
    cap.decided(_req(6, 6.0), _decision(6), 6.0)
    assert cap.request_id[cap.order()].tolist() == [4, 5, 6]
