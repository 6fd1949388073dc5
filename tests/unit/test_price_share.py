"""Price books shared by router replicas: demand drained from one book and added to
another reproduces one book fed everything; a follower learns nothing and prices with the
leader's state once adopted (``olproute.pricing.book``; ``Demand``, ``PriceState`` in
``olproute.types``)."""

from __future__ import annotations

import numpy as np
import pytest

from olproute.pricing.book import ARRIVALS_KEPT, PriceBook
from olproute.pricing.reward import sample_extent, usage_columns
from tests.unit.test_bid_price import SLOT, SPEC, H, _book


def _add(book: PriceBook, t: float, prompt: float) -> None:
    """One arrival at ``t`` with a sample of ``prompt`` tokens and 200 output tokens."""
    cols = usage_columns(prompt, np.full(2, 200.0), np.full(2, 0.1), np.full(2, 0.025),
                         np.full(2, 4.0), np.full(2, 10_000.0), np.full(2, 1e4), SLOT, H)
    book.observe_arrival(t)
    book.add_sample(np.full(2, 10.0 + prompt / 1000), cols, sample_extent(
        cols, prompt, np.full(2, 200.0), np.full(2, 0.025), np.full(2, 1e4), SLOT))


def test_shared_demand_builds_the_window_one_book_fed_everything_has() -> None:
    alone, leader, follower = _book(), _book(), _book()
    follower.share_demand()
    follower.leading = False
    for i in range(60):
        t, prompt = i * 0.05, 500.0 + 37.0 * i
        _add(alone, t, prompt)
        _add(leader if i % 2 == 0 else follower, t, prompt)
        if i % 5 == 4:   # a sync: the follower's demand so far reaches the leader
            demand = follower.drain_demand()
            assert demand is not None
            leader.add_demand(demand)
    assert follower.drain_demand() is None   # drained at the last sync
    assert leader.num_samples == alone.num_samples == 60
    # the same rows, each sample once (the order within a sync differs)
    for mine, theirs in zip(leader.samples.arrays, alone.samples.arrays, strict=True):
        order_l = np.lexsort(leader.samples.prefill_work[:60].T)
        order_a = np.lexsort(alone.samples.prefill_work[:60].T)
        np.testing.assert_array_equal(mine[:60][order_l], theirs[:60][order_a])
    # arrivals learned late count as they would have on time
    assert leader.arrival_rate_per_s(3.0) == pytest.approx(alone.arrival_rate_per_s(3.0),
                                                           rel=1e-12)


def test_a_follower_learns_nothing_and_prices_with_the_adopted_state() -> None:
    leader, follower = _book(), _book()
    follower.leading = False
    for i in range(400):
        for book in (leader, follower):
            _add(book, i * 0.05, 2000.0)
        if i % 10 == 9:
            leader.update(i * 0.05)
            follower.update(i * 0.05)
    assert leader.p.sum() > 0 and leader.num_updates > 0
    assert follower.p.sum() == 0 and follower.num_updates == 0
    # the follower's clock runs 100 s ahead of the leader's
    follower.adopt(leader.state(), shift_s=100.0)
    np.testing.assert_array_equal(follower.p, leader.p)
    assert follower.num_updates == leader.num_updates
    assert leader.origin_s is not None and follower.origin_s == leader.origin_s + 100.0
    cols = usage_columns(900, np.full(2, 100.0), np.full(2, 0.1), np.full(2, 0.025),
                         np.full(2, 4.0), np.full(2, 10_000.0), np.full(2, 1e4), SLOT, H)
    np.testing.assert_array_equal(follower.price(cols, 120.6), leader.price(cols, 20.6))
    # a follower made leader learns on from there
    follower.leading = True
    before = follower.p.copy()
    follower.update(121.0)
    assert follower.num_updates == leader.num_updates + 1
    assert not np.array_equal(follower.p, before)


def test_demand_that_does_not_fit_the_window_is_refused() -> None:
    small, big = _book(), PriceBook([SPEC, SPEC, SPEC], SLOT, H, _book().cfg,
                                    np.random.default_rng(0), backend="numpy")
    big.share_demand()
    cols = usage_columns(500, np.full(3, 200.0), np.full(3, 0.1), np.full(3, 0.025),
                         np.full(3, 4.0), np.full(3, 10_000.0), np.full(3, 1e4), SLOT, H)
    big.add_sample(np.full(3, 5.0), cols, sample_extent(
        cols, 500, np.full(3, 200.0), np.full(3, 0.025), np.full(3, 1e4), SLOT))
    demand = big.drain_demand()
    assert demand is not None and demand.num_samples == 1
    with pytest.raises(ValueError, match="do not fit"):
        small.add_demand(demand)
    with pytest.raises(ValueError, match="prices of shape"):
        small.adopt(big.state())


def test_the_outbox_keeps_at_most_a_window() -> None:
    book = _book()
    book.share_demand()
    for i in range(3 * book.cfg.window):
        _add(book, i * 0.01, 1000.0)
    demand = book.drain_demand()
    assert demand is not None
    assert demand.num_samples == book.cfg.window
    assert len(demand.arrivals_s) == 3 * book.cfg.window
    for i in range(ARRIVALS_KEPT + 10):
        book.observe_arrival(100.0 + i * 1e-4)
    demand = book.drain_demand()
    assert demand is not None and demand.num_samples == 0
    assert len(demand.arrivals_s) == ARRIVALS_KEPT
    assert demand.arrivals_s[-1] == 100.0 + (ARRIVALS_KEPT + 9) * 1e-4
