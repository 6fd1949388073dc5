"""Fresher engine state in the live tracker's snapshots: a request whose prompt blocks its
engine's KV events stored is running, in prefill, that far (not waiting with nothing
computed); the engine's scraped running count marks the earliest dispatched requests
running; both only when switched on. The backend here has too few KV blocks for any of
the prompts, so the router's own rule (a request without a token the scheduler has room
for runs in prefill) takes none in: what puts one in prefill is the engine's word."""

from __future__ import annotations

import numpy as np

from olproute.server.tracker import Tracker
from olproute.types import SNAP_COMPUTED, SNAP_OUTPUT, SNAP_PROMPT, InstanceSpec, Request

SPEC = InstanceSpec(name="a", model="m", gpu="g", tensor_parallel=1, max_num_seqs=8,
                    max_num_batched_tokens=64, block_size=16, num_kv_blocks=2)


def _request(rid: int, prompt: int, keys: list[int] | None) -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt_tokens=prompt, decode_tokens=10,
                   ttft_target_s=1.0, predicted_decode_tokens=10,
                   engine_block_hashes=None if keys is None
                   else (np.array(keys, dtype=np.int64),))


def _tracker(events: bool = True, scrape: bool = False) -> Tracker:
    t = Tracker([SPEC], ["http://a"])
    t.prefill_from_events = events
    t.running_from_scrape = scrape
    return t


def _rows(t: Tracker, now: float = 5.0) -> tuple[int, list[tuple[int, int, int]]]:
    """(running, [(id, output, computed) per row in the snapshot's order])."""
    snap = t.snapshot(0, now)
    return snap.num_running, [(int(i), int(r[SNAP_OUTPUT]), int(r[SNAP_COMPUTED]))
                              for i, r in zip(snap.request_ids, snap.table, strict=True)]


def test_stored_blocks_put_a_request_in_prefill_that_far() -> None:
    t = _tracker()
    t.dispatched(0, _request(1, 70, [11, 12, 13, 14]), 1.0)
    t.dispatched(0, _request(2, 40, [21, 22]), 2.0)
    assert _rows(t) == (0, [(1, 0, 0), (2, 0, 0)])        # both look waiting
    t.engine_stored(0, [11, 12])                           # the engine computed 2 blocks
    assert _rows(t) == (1, [(1, 0, 32), (2, 0, 0)])       # running, in prefill, 32 done
    t.engine_stored(0, [13, 14])
    running, rows = _rows(t)
    assert running == 1 and rows[0] == (1, 0, 64)
    # its first token: a decoder as before (prompt computed, the token to be fed)
    t.token(0, 1, 3.0)
    snap = t.snapshot(0, 5.0)
    assert snap.num_running == 1 and snap.table[0, SNAP_PROMPT] == 70
    assert (snap.table[0, SNAP_OUTPUT], snap.table[0, SNAP_COMPUTED]) == (1, 70)


def test_a_shared_block_goes_to_the_earliest_that_has_not_computed_it() -> None:
    t = _tracker()
    t.dispatched(0, _request(1, 50, [7, 8, 9]), 1.0)
    t.dispatched(0, _request(2, 50, [7, 8, 5]), 2.0)
    t.engine_stored(0, [7])
    assert _rows(t)[1] == [(1, 0, 16), (2, 0, 0)]
    t.engine_stored(0, [7])                                # a second copy: the other's
    assert _rows(t)[1] == [(1, 0, 16), (2, 0, 16)]
    # a prompt's last block never counts past its prompt less one token
    t.engine_stored(0, [8, 9])
    assert _rows(t)[1][0] == (1, 0, 48)


def test_switched_off_or_without_the_engines_names_nothing_changes() -> None:
    off = _tracker(events=False)
    off.dispatched(0, _request(1, 70, [11, 12]), 1.0)
    off.engine_stored(0, [11, 12])
    assert _rows(off) == (0, [(1, 0, 0)])
    nameless = _tracker()
    nameless.dispatched(0, _request(1, 70, None), 1.0)
    nameless.engine_stored(0, [11])
    assert _rows(nameless) == (0, [(1, 0, 0)])


def test_a_finished_flight_leaves_no_owner_behind() -> None:
    t = _tracker()
    t.dispatched(0, _request(1, 70, [11, 12]), 1.0)
    t.dispatched(0, _request(2, 70, [11, 13]), 1.5)
    assert set(t.backends[0].block_owners) == {11, 12, 13}
    t.finished(0, 1)
    assert t.backends[0].block_owners == {11: [(2, 0)], 13: [(2, 1)]}
    t.finished(0, 2)
    assert t.backends[0].block_owners == {}


def test_the_scraped_running_count_marks_the_earliest_dispatched_running() -> None:
    t = _tracker(events=False, scrape=True)
    for rid in range(4):
        t.dispatched(0, _request(rid, 40, None), 1.0 + rid)
    t.set_scraped(0, {"vllm:num_requests_running": 2.0}, 3.5)   # saw ids 0-2 dispatched
    running, rows = _rows(t)
    assert running == 2 and [r[0] for r in rows[:2]] == [0, 1]
    assert all(r[1] == 0 for r in rows)                        # no output yet: prefill
    # a request dispatched after the scrape is never counted in it
    t.set_scraped(0, {"vllm:num_requests_running": 4.0}, 2.5)  # saw ids 0-1 only
    assert _rows(t)[0] == 2
    # off: the same tracker state, nothing running
    t.running_from_scrape = False
    t.backends[0].version += 1
    assert _rows(t)[0] == 0
