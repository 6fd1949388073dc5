"""The router's rebuilt snapshot (olproute.routing.tracked): the simulator's router view of an
exact engine state is the snapshot the live tracker builds from the same traffic, and it
drops what a router cannot see (the batch in flight, prefill progress)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.config.loader import Config, LoadedConfig, load_profiles
from olproute.core_ref import FINISHED
from olproute.routing.tracked import router_view
from olproute.server.tracker import Tracker
from olproute.sim.engine import SimEngine
from olproute.sim.scenario import make_cluster, make_policy
from olproute.sim.snapshots import SnapshotFeed
from olproute.sim.timing import LinearTiming
from olproute.types import SNAP_COMPUTED, SNAP_OUTPUT, InstanceSpec, Request


def _spec(seqs: int, blocks: int, budget: int) -> InstanceSpec:
    return InstanceSpec(name="i", model="m", gpu="g", tensor_parallel=1, max_num_seqs=seqs,
                        max_num_batched_tokens=budget, block_size=16, num_kv_blocks=blocks)


def _engine_mid_run(spec: InstanceSpec, prompts: list[int], decodes: list[int],
                    batches: int, seed: int) -> tuple[SimEngine, dict[int, float]]:
    """An engine with the requests admitted in a shuffled dispatch order, ``batches``
    batches run and the next one in flight."""
    rng = np.random.default_rng(seed)
    timer = LinearTiming((3e-3, 5e-5, 1e-8, 1e-9), 0.0, rng)
    eng = SimEngine(0, spec, timer)
    dispatch: dict[int, float] = {}
    ids = rng.permutation(len(prompts)).tolist()  # ids not in dispatch order
    for k, (p, d) in enumerate(zip(prompts, decodes, strict=True)):
        eng.admit(ids[k], p, d, d + 7)
        dispatch[ids[k]] = 0.01 * k
    t = 1.0
    for _ in range(batches):
        dur = eng.start_batch(t)
        if dur is None:
            break
        t += dur
        for rid, flags, _ in eng.finish_batch():
            if flags & FINISHED:
                dispatch.pop(rid, None)
    eng.start_batch(t)  # a batch in flight
    return eng, dispatch


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 40)), min_size=1,
                max_size=24),
       st.integers(0, 12), st.integers(2, 8), st.integers(0, 10**6), st.booleans())
def test_router_view_is_the_live_trackers_snapshot(rows: list[tuple[int, int]], batches: int,
                                                   seqs: int, seed: int,
                                                   hits: bool) -> None:
    """With ``hits``, the router expected part of some prompts cached (its prefix
    index): both views count it computed while the request waits."""
    spec = _spec(seqs, 400, 256)
    prompts, decodes = [p for p, _ in rows], [d for _, d in rows]
    eng, dispatch = _engine_mid_run(spec, prompts, decodes, batches, seed)
    exact = eng.snapshot(5.0)
    rng = np.random.default_rng(seed)
    cached = ({rid: int(rng.integers(0, p)) for rid, p in zip(
        exact.request_ids.tolist(), exact.table[:, 0].tolist(), strict=True)} if hits
              else {})
    view = router_view(exact, dispatch, spec, cached)
    # the tracker, fed the same traffic: dispatches in order, the tokens streamed so far
    tracker = Tracker([spec], ["http://x"])
    out = dict(zip(exact.request_ids.tolist(), exact.table[:, SNAP_OUTPUT].tolist(),
                   strict=True))
    pred = dict(zip(exact.request_ids.tolist(), exact.table[:, 2].tolist(), strict=True))
    prompt = dict(zip(exact.request_ids.tolist(), exact.table[:, 0].tolist(), strict=True))
    for rid in sorted(out, key=dispatch.__getitem__):
        req = Request(request_id=rid, arrival_s=0.0, prompt_tokens=prompt[rid],
                      decode_tokens=1, predicted_decode_tokens=pred[rid], ttft_target_s=1.0)
        tracker.dispatched(0, req, dispatch[rid], cached_tokens=cached.get(rid, 0))
        if out[rid]:
            tracker.token(0, rid, 1.0, out[rid])
    live = tracker.snapshot(0, 5.0)
    assert np.array_equal(view.table, live.table)
    assert np.array_equal(view.request_ids, live.request_ids)
    assert view.num_running == live.num_running
    assert view.num_free_blocks == live.num_free_blocks
    # what the router cannot see is gone: no batch in flight, no queued prefill progress
    assert view.inflight.shape == (0, 2) and view.inflight_start_s == view.time_s
    waiting = view.table[view.num_running:]
    assert not waiting[:, SNAP_OUTPUT].any()
    assert waiting[:, SNAP_COMPUTED].tolist() == [
        cached.get(i, 0) for i in view.request_ids[view.num_running:].tolist()]


def test_router_view_loses_prefill_progress_and_the_batch_in_flight() -> None:
    """A long prompt part-way through a chunked prefill: the engine knows how much is
    computed and that a batch runs; the router's view has it waiting with nothing
    computed, and no batch. It does know the engine took the request in (a free slot,
    blocks for the prompt): it runs in prefill there, holding its prompt's blocks."""
    spec = _spec(8, 400, 128)
    eng, dispatch = _engine_mid_run(spec, [1000], [5], 3, 0)
    exact = eng.snapshot(5.0)
    assert exact.table[0, SNAP_COMPUTED] == 3 * 128 and exact.inflight.shape[0] > 0
    view = router_view(exact, dispatch, spec)
    assert view.num_running == 1 and view.table[0, SNAP_COMPUTED] == 0
    assert view.table[0, SNAP_OUTPUT] == 0 and view.table[0, 4] == 63
    assert view.inflight.shape[0] == 0
    assert view.num_free_blocks == spec.num_kv_blocks - 63


def _tracker_with(spec: InstanceSpec, prompts: list[int], decoding: int) -> Tracker:
    """A tracker with requests of ``prompts`` dispatched in order, the first
    ``decoding`` of them having streamed a token."""
    tracker = Tracker([spec], ["http://x"])
    for rid, prompt in enumerate(prompts):
        req = Request(request_id=rid, arrival_s=0.0, prompt_tokens=prompt, decode_tokens=1,
                      predicted_decode_tokens=8, ttft_target_s=1.0)
        tracker.dispatched(0, req, 0.01 * rid)
    for rid in range(decoding):
        tracker.token(0, rid, 0.1)
    return tracker


def test_a_request_in_prefill_runs_and_the_queue_starts_where_room_ends() -> None:
    """Requests without a token yet behind two decoders (3 + 11 of 40 KV blocks): the
    200-token prompt (13 blocks) runs in prefill, the 300-token one (19 blocks, 13
    left) waits, and so does the short one behind it (the scheduler does not skip
    ahead). With no batch slot left a short prompt waits too."""
    tracker = _tracker_with(_spec(4, 40, 4096), [32, 160, 200, 300, 16], 2)
    snap = tracker.snapshot(0, 0.2)
    assert snap.request_ids[: snap.num_running].tolist() == [0, 1, 2]
    assert snap.request_ids[snap.num_running:].tolist() == [3, 4]
    assert snap.num_free_blocks == 40 - 3 - 11 - 13
    assert snap.table[2].tolist() == [200, 0, 8, 0, 13]
    load = tracker.loads(0.2)[0]
    assert (load.num_running, load.num_waiting) == (3, 2)
    assert load.num_kv_blocks_used == 3 + 11 + 13
    full = _tracker_with(_spec(2, 40, 4096), [32, 160, 16], 2)
    assert full.snapshot(0, 0.2).num_running == 2
    assert full.loads(0.2)[0].num_waiting == 1


def test_the_next_steps_token_budget_ends_what_the_scheduler_takes_in() -> None:
    """A budget of 256 tokens, two decoders taking one each: the 200-token prompt and,
    with 54 tokens left, the first chunk of the 300-token one enter; the budget is spent
    before the short one behind them."""
    tracker = _tracker_with(_spec(8, 1000, 256), [32, 160, 200, 300, 16], 2)
    snap = tracker.snapshot(0, 0.2)
    assert snap.request_ids[: snap.num_running].tolist() == [0, 1, 2, 3]
    assert snap.request_ids[snap.num_running:].tolist() == [4]
    assert tracker.loads(0.2)[0].num_waiting == 1


def test_the_feed_gives_the_router_view_with_dispatch_order() -> None:
    spec = _spec(4, 400, 128)
    eng, dispatch = _engine_mid_run(spec, [300, 40, 900, 20, 70], [9, 3, 4, 30, 2], 4, 3)
    feed = SnapshotFeed([eng], 0.0, "router")
    for rid, t in sorted(dispatch.items(), key=lambda kv: kv[1]):
        feed.dispatched(0, t, rid, 0, 0)
    (snap,), pending = feed.view(5.0)
    assert pending is None
    expected = router_view(eng.snapshot(5.0), dispatch, spec)
    assert np.array_equal(snap.table, expected.table)
    assert np.array_equal(snap.request_ids, expected.request_ids)
    engine_feed = SnapshotFeed([eng], 0.0)
    assert engine_feed.view(5.0)[0][0].inflight.shape[0] > 0  # the engine view keeps it


def test_config_snapshot_view_reaches_the_cluster() -> None:
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    data = {"instances": [{"name": "a", "model": "llama-2-7b", "gpu": "a100-80gb"}],
            "workload": {"kind": "poisson", "rate_per_s": 5, "num_requests": 10,
                         "lengths_path": str(repo / "data" / "traces" / "splitwise_conv.csv")},
            "sim": {"snapshot_view": "router"}}
    loaded = LoadedConfig(repo / "configs" / "default.yaml", Config.model_validate(data),
                          load_profiles(repo / "configs" / "profiles.yaml"))
    cluster = make_cluster(loaded, make_policy(loaded, "round_robin"))
    assert cluster.feed.view_of == "router"
