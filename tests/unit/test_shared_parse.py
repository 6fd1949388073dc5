"""What a replica reads from Redis is parsed into bounded shapes
(``olproute.server.shared_parse``), without Redis: each kind of bad ledger row, demand
message and price state is dropped with its reason, never raised; what fits passes
whole; the merged view holds no more than a backend can."""

from __future__ import annotations

import io
import zipfile
from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pytest

from olproute.config.schema import RewardConfig
from olproute.server.shared import encode_demand, encode_prices
from olproute.server.shared_parse import (
    PRICE_HEADROOM,
    BackendLimits,
    BookShape,
    Bounds,
    Ledger,
    ledger_cap,
    merged_rows,
    parse_demand,
    parse_ledger,
    parse_prices,
    price_bound,
    reward_bound,
)
from olproute.types import Demand, PriceState
from tests.unit.test_bid_price import SPEC
from tests.unit.test_price_share import _add, _book

WALL_S = 1_000_000.0
LIMITS = (BackendLimits.of(SPEC), BackendLimits.of(replace(SPEC, name="b")))   # 4 seqs
KV = SPEC.kv_capacity_tokens


def _ledger(rows: list[list[Any]], inbound: list[list[Any]] | None = None,
            **doc: Any) -> bytes:
    body = {"r": "them", "t": WALL_S, "b": {"a": {"f": rows, "i": inbound or []}}}
    body.update(doc)
    return orjson.dumps(body)


def _row(**kw: Any) -> list[Any]:
    row = {"prompt": 100, "decode": 10, "tokens": 0, "computed": 0, "running": False,
           "dispatch": WALL_S - 1.0}
    row.update(kw)
    return list(row.values())


def _parse(raw: bytes) -> tuple[Ledger | None, dict[str, int]]:
    return parse_ledger(raw, "them", LIMITS, WALL_S, ttl_s=1.0)


def test_a_ledger_that_fits_passes_whole() -> None:
    ledger, drops = _parse(_ledger([_row(), _row(tokens=3, running=True)],
                                   [[50, 5, WALL_S - 0.5]]))
    assert drops == {} and ledger is not None
    assert ledger.flights["a"].shape == (2, 6) and ledger.inbound["a"].shape == (1, 3)


@pytest.mark.parametrize(("row", "reason"), [
    (_row(prompt=10 ** 9), "count"),            # beyond the KV capacity
    (_row(prompt=0), "count"),
    (_row(tokens=-1), "count"),                 # a negative count
    (_row(decode=2 ** 64 - 1), "count"),        # past int64
    (_row(prompt=KV, tokens=1), "count"),       # its context past the KV capacity
    (_row(computed=101), "count"),              # more computed than its prompt
    (_row(prompt=10.5), "count"),               # not a whole number
    (_row(running=2), "count"),                 # running is 0 or 1
    (_row(dispatch=WALL_S + 5.0), "time"),      # in the future
    (_row(dispatch=WALL_S - 3600.0), "time"),   # an hour ago
    (_row(dispatch=1e300), "time"),
])
def test_a_bad_ledger_row_is_dropped_with_its_reason(row: list[Any], reason: str) -> None:
    ledger, drops = _parse(_ledger([row, _row()]))
    assert drops == {reason: 1}
    assert ledger is not None and len(ledger.flights["a"]) == 1   # the good row stays


@pytest.mark.parametrize(("raw", "reason"), [
    (b"not json", "format"),
    (b'{"r": "them", "t": 1e400, "b": {}}', "format"),     # an infinite time
    (b'{"r": "them", "t": 1000000, "b": {"a": {"f": [[NaN]]}}}', "format"),
    (_ledger([["abc", 10, 0, 0, False, WALL_S]]), "format"),   # no number
    (_ledger([[100, 10, 0]]), "format"),                        # a short row
    (_ledger([], r="someone else"), "replica"),
    (_ledger([], t=WALL_S - 5.0), "stale"),                     # nobody republished it
    (_ledger([], t=WALL_S + 5.0), "time"),
    (_ledger([], t=None), "format"),                            # no publish time
    (_ledger([], t=float(2 ** 80)), "time"),
    (orjson.dumps({"r": "them", "t": WALL_S, "b": {"a": {"f": [_row()] * 50_000}}}),
     "too_large"),
])
def test_a_bad_ledger_is_dropped_with_its_reason(raw: bytes, reason: str) -> None:
    ledger, drops = _parse(raw)
    assert drops == {reason: 1}
    assert ledger is None or not ledger.flights   # all of it, or its one backend


@pytest.mark.parametrize(("rows", "reason"), [
    ([_row()] * (LIMITS[0].max_entries + 1), "entries"),
    ([_row(running=True)] * (SPEC.max_num_seqs + 1), "running"),
])
def test_a_backend_entry_holding_more_than_the_backend_is_dropped(
        rows: list[list[Any]], reason: str) -> None:
    raw = orjson.dumps({"r": "them", "t": WALL_S,
                        "b": {"a": {"f": rows}, "b": {"f": [_row()]}, "zz": {"f": []}}})
    assert len(raw) <= ledger_cap(LIMITS)
    ledger, drops = _parse(raw)
    assert drops == {reason: 1, "backend": 1}   # and "zz" is no backend of this config
    assert ledger is not None and "a" not in ledger.flights and len(ledger.flights["b"]) == 1


def test_the_merged_view_holds_at_most_what_the_backend_can() -> None:
    one = np.array([_row(running=True, dispatch=WALL_S - 4 + i / 10) for i in range(4)],
                   dtype=np.float64)
    ledgers = [Ledger(f"r{i}", {"a": one.copy()}, {}) for i in range(5)]
    drops: dict[str, int] = {}
    merged = merged_rows(ledgers, LIMITS[0], drops)
    assert merged is not None
    flights, _ = merged
    assert int(flights[:, 4].sum()) == SPEC.max_num_seqs   # the earliest four run
    assert drops == {"running": 16}
    assert np.all(np.diff(flights[:, 5]) >= 0)


# -- demand and prices ---------------------------------------------------------------------
def _demand_and_shapes() -> tuple[Demand, list[BookShape]]:
    book = _book()
    book.share_demand()
    for i in range(10):
        _add(book, i * 0.1, 1000.0 + i)
    demand = book.drain_demand()
    assert demand is not None
    return demand, [BookShape.of(book)]


BOUNDS = Bounds(reward=1e3, price=1e6, wall_s=WALL_S)


def _npz(arrays: dict[str, Any], compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def _demand_arrays(demand: Demand) -> dict[str, Any]:
    out: dict[str, Any] = {"num_books": np.array([1]), "b0_a": demand.arrivals_s + WALL_S}
    out.update({f"b0_r{k}": a for k, a in enumerate(demand.rows)})
    return out


def test_demand_that_fits_passes_at_local_times() -> None:
    demand, shapes = _demand_and_shapes()
    raw = encode_demand([demand], offset_s=WALL_S)
    assert raw is not None
    back, drops = parse_demand(raw, shapes, BOUNDS, offset_s=WALL_S)
    assert drops == {} and back is not None and back[0] is not None
    np.testing.assert_allclose(back[0].arrivals_s, demand.arrivals_s)


@pytest.mark.parametrize(("change", "reason"), [
    ({"num_books": np.array([10 ** 15])}, "books"),       # a huge number of books
    ({"num_books": np.array([1.0])}, "books"),
    ({"b0_r0": "nan"}, "reward"),
    ({"b0_r0": "huge"}, "reward"),
    ({"b0_r1": "float"}, "shape"),                        # start slots as floats
    ({"b0_r3": "negative"}, "value"),
    ({"b0_r3": "short"}, "shape"),                        # K differs between the arrays
    ({"b0_a": np.array([np.inf])}, "time"),
    ({"b0_a": np.zeros((2, 2))}, "shape"),
    ({"b1_a": np.zeros(1)}, "format"),                    # a member no writer names
])
def test_a_bad_demand_message_is_dropped_with_its_reason(change: dict[str, Any],
                                                         reason: str) -> None:
    demand, shapes = _demand_and_shapes()
    arrays = _demand_arrays(demand)
    for key, value in change.items():
        if not isinstance(value, str):
            pass
        elif value == "nan":
            value = arrays[key].copy()
            value[0, 0, 0] = np.nan
        elif value == "huge":
            value = arrays[key] * 0 - 1e300
        elif value == "float":
            value = arrays[key].astype(np.float64)
        elif value == "negative":
            value = arrays[key] - 1.0
        elif value == "short":
            value = arrays[key][:-1]
        arrays[key] = value
    back, drops = parse_demand(_npz(arrays), shapes, BOUNDS, offset_s=WALL_S)
    assert drops == {reason: 1}
    assert back is None or back == [None]


@pytest.mark.parametrize(("raw", "reason"), [
    (b"garbage", "format"),
    (b"PK\x03\x04" + b"\0" * 100, "format"),
    (b"x" * 10_000_000, "too_large"),
])
def test_a_demand_message_that_is_no_archive_of_ours_is_dropped(raw: bytes,
                                                                reason: str) -> None:
    _, shapes = _demand_and_shapes()
    assert parse_demand(raw, shapes, BOUNDS, 0.0) == (None, {reason: 1})


def test_a_compressed_demand_message_is_dropped_unread() -> None:
    demand, shapes = _demand_and_shapes()
    raw = _npz(_demand_arrays(demand), compressed=True)
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        assert zf.infolist()[0].compress_type == zipfile.ZIP_DEFLATED
    assert parse_demand(raw, shapes, BOUNDS, 0.0) == (None, {"format": 1})


def _state() -> tuple[PriceState, list[BookShape]]:
    book = _book()
    for i in range(30):
        _add(book, i * 0.1, 1000.0 + i)
    book.update(3.0)
    return book.state(), [BookShape.of(book)]


@pytest.mark.parametrize(("p", "reason"), [
    (np.nan, "nonfinite"),
    (np.inf, "nonfinite"),
    (-1.0, "negative"),
    (1e300, "bound"),
    (None, "shape"),
])
def test_a_bad_price_state_is_dropped_with_its_reason(p: float | None, reason: str) -> None:
    state, shapes = _state()
    prices = state.p.copy()
    if p is None:
        prices = prices[:, :-1]         # one slot short
    else:
        prices[0, 0, 0] = p
    raw = encode_prices([replace(state, p=prices, origin_s=None)], 0.0)
    assert parse_prices(raw, shapes, BOUNDS, 0.0) == (None, reason)


def test_a_price_state_for_another_number_of_books_is_dropped() -> None:
    state, shapes = _state()
    raw = encode_prices([state], WALL_S)
    assert parse_prices(raw, shapes * 2, BOUNDS, WALL_S) == (None, "books")
    states, why = parse_prices(encode_prices([state], WALL_S - 10), shapes, BOUNDS, 0.0)
    assert why is None and states is not None
    np.testing.assert_array_equal(states[0].p, state.p)


def test_the_price_bound_is_a_hundred_times_what_the_largest_reward_pays() -> None:
    w = RewardConfig()
    r = reward_bound(w, 600, LIMITS)
    assert r == pytest.approx(1.0 + 0.02 * 600)
    assert price_bound(r, [SPEC]) == pytest.approx(PRICE_HEADROOM * r * KV)


def test_a_member_whose_header_claims_more_than_it_holds_is_dropped_unread() -> None:
    _, shapes = _demand_and_shapes()
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        member, {"descr": "<i8", "fortran_order": False, "shape": (10 ** 12,)})
    member.write(np.array([1]).tobytes())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("num_books.npy", member.getvalue())
    assert parse_demand(buf.getvalue(), shapes, BOUNDS, 0.0) == (None, {"format": 1})
