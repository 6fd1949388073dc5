"""What router replicas exchange on Redis (``olproute.server.shared``), without Redis: a
replica's ledger, parsed and merged into another's tracker, counts in its loads,
snapshots and inbound rows at the right local times; demand and price states survive
their encoding and parsing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from olproute.server.shared import (
    encode_demand,
    encode_ledger,
    encode_prices,
    limits_of,
    merge_ledgers,
)
from olproute.server.shared_parse import (
    BookShape,
    Bounds,
    parse_demand,
    parse_ledger,
    parse_prices,
)
from olproute.server.tracker import Tracker
from olproute.types import Request
from tests.unit.test_bid_price import SPEC
from tests.unit.test_price_share import _add, _book


def _request(rid: int, prompt: int, decode: int) -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt_tokens=prompt, decode_tokens=decode,
                   ttft_target_s=1.0,
                   predicted_decode_tokens=decode)


WALL_S = 120.0   # the wall-clock time the ledgers are published and read at


def _merge(mine: Tracker, theirs: Tracker, their_offset_s: float, my_offset_s: float
           ) -> None:
    """Their ledger, published and read now, parsed and merged into mine."""
    raw = encode_ledger(theirs, "them", their_offset_s, WALL_S)
    ledger, drops = parse_ledger(raw, "them", limits_of(mine), WALL_S, ttl_s=1.0)
    assert ledger is not None and drops == {}
    assert merge_ledgers(mine, [ledger], my_offset_s) == {}


def _trackers() -> tuple[Tracker, Tracker]:
    specs = [SPEC, replace(SPEC, name="b")]   # the ledger names backends
    return Tracker(specs, ["http://a", "http://b"]), Tracker(specs, ["http://a", "http://b"])


def test_a_merged_ledger_counts_in_loads_and_snapshots_at_local_times() -> None:
    mine, theirs = _trackers()
    mine.dispatched(0, _request(1, 100, 10), now_s=5.0)
    theirs.dispatched(0, _request(1, 300, 30), now_s=2.0)     # the same id: no clash
    theirs.dispatched(0, _request(2, 200, 20), now_s=3.0)
    theirs.token(0, 2, now_s=3.5)                              # running, one token
    # their clock reads 100 s more than wall-clock minus ours: offsets 10 and 110
    _merge(mine, theirs, 110.0, 10.0)
    load = mine.loads(6.0)[0]
    # the one with a token runs; the engine has room for the other two: in prefill
    assert (load.num_outstanding, load.num_running, load.num_waiting) == (3, 3, 0)
    assert mine.loads(6.0)[1].num_outstanding == 0
    snap = mine.snapshot(0, 6.0)
    # in dispatch order, local times: theirs at 102 and 103, mine at 5
    assert snap.num_running == 3
    assert snap.table[:, 0].tolist() == [100, 300, 200]
    assert snap.request_ids.tolist() == [1, -1, -2]
    assert mine.backends[0].remote.dispatch_s == (102.0, 103.0)
    # their requests end: the next merge drops them
    theirs.finished(0, 1)
    theirs.finished(0, 2)
    _merge(mine, theirs, 110.0, 10.0)
    assert mine.loads(6.0)[0].num_outstanding == 1
    assert mine.snapshot(0, 6.0).table[:, 0].tolist() == [100]


def test_the_own_ledger_leaves_out_the_others_requests() -> None:
    mine, theirs = _trackers()
    theirs.dispatched(1, _request(7, 50, 5), now_s=1.0)
    _merge(mine, theirs, 100.0, 100.0)
    assert mine.loads(2.0)[1].num_outstanding == 1
    assert mine.ledger(1) == ([], [])


def test_inbound_rows_merge_in_dispatch_order() -> None:
    mine, theirs = _trackers()
    mine.dispatched_pair(0, 1, _request(1, 100, 10), now_s=4.0)
    theirs.dispatched_pair(0, 1, _request(9, 400, 40), now_s=1.0)
    _merge(mine, theirs, 100.0, 100.0)
    rows = mine.inbound_rows()[1]
    assert rows is not None
    assert rows[:, 2].tolist() == [1.0, 4.0]
    assert mine.loads(5.0)[1].num_outstanding == 2
    assert mine.loads(5.0)[0].num_outstanding == 2   # both prefills


def test_demand_and_prices_survive_their_encoding() -> None:
    book = _book()
    book.share_demand()
    for i in range(30):
        _add(book, i * 0.1, 1000.0 + i)
    book.update(3.0)
    demand = book.drain_demand()
    assert demand is not None
    raw = encode_demand([demand, None], offset_s=50.0)
    assert raw is not None
    shapes = [BookShape.of(book)] * 2
    bounds = Bounds(reward=1e3, price=1e6, wall_s=60.0)
    back, drops = parse_demand(raw, shapes, bounds, offset_s=20.0)
    assert back is not None and drops == {}
    assert back[1] is None and back[0] is not None
    np.testing.assert_allclose(back[0].arrivals_s, demand.arrivals_s + 30.0)
    for a, b in zip(back[0].rows, demand.rows, strict=True):
        np.testing.assert_array_equal(a, b)
    assert encode_demand([None, None], 0.0) is None
    state = book.state()
    states, why = parse_prices(encode_prices([state], offset_s=50.0), shapes[:1], bounds,
                               offset_s=20.0)
    assert states is not None and why is None
    again = states[0]
    np.testing.assert_array_equal(again.p, state.p)
    np.testing.assert_array_equal(again.acc, state.acc)
    assert state.origin_s is not None
    assert again.origin_s == pytest.approx(state.origin_s + 30.0)
    assert (again.num_updates, again.num_steps) == (state.num_updates, state.num_steps)
