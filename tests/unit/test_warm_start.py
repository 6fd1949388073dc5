"""PriceBook.warm_start: an exact LP's duals become the book's prices."""

from __future__ import annotations

import numpy as np
import pytest

from olproute.config.schema import PriceConfig
from olproute.pricing.book import PriceBook
from olproute.pricing.reward import Columns, SampleExtent, column_price
from olproute.types import InstanceSpec
from solvers.lp import solve
from solvers.problem import price_cumsums, random_instance

SPEC = InstanceSpec(name="a", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=64, max_num_batched_tokens=8192, block_size=16,
                    num_kv_blocks=4000)
SLOT, H = 0.05, 120


def book(g: int) -> PriceBook:
    cfg = PriceConfig(window=64, minibatch=16, steps_per_period=3)
    return PriceBook((SPEC,) * g, SLOT, H, cfg, np.random.default_rng(0), backend="numpy")


@pytest.fixture(scope="module")
def duals() -> tuple[float, np.ndarray]:
    prob = random_instance(60, 2, 100, seed=3, max_delay=20, slot_s=SLOT, horizon=H)
    sol = solve(prob)
    assert sol.p.max() > 0   # an overloaded window: some capacity is priced
    return prob.t0_s, sol.p


def lp_column_prices(p: np.ndarray, cols: Columns) -> np.ndarray:
    """The LP's a . p on its own absolute grid (``solvers.problem``'s cumulative sums)."""
    p0, p1 = price_cumsums(p)
    return column_price(cols, p0, p1)


def shifted(cols: Columns, m: int) -> Columns:
    return Columns(cols.start - m, cols.end - m, cols.batch_a, cols.kv_a, cols.kv_b,
                   cols.pre_start - m, cols.pre_end - m, cols.compute_a)


def test_a_warm_start_prices_columns_as_the_lp_duals_do(
        duals: tuple[float, np.ndarray]) -> None:
    t0, p = duals
    b = book(2)
    b.advance(t0 + 30 * SLOT)            # the book's slot 0 is LP slot 30
    b.warm_start(t0, p)
    assert b.origin_s == pytest.approx(t0 + 30 * SLOT)
    np.testing.assert_array_equal(b.p[:, :70], p[:, 30:])
    np.testing.assert_array_equal(b.p[:, 70:], 0.0)   # past the LP's grid
    np.testing.assert_array_equal(b._iterate, b.p)
    rng = np.random.default_rng(1)
    s = rng.integers(30, 90, size=(50, 1)) * np.ones((1, 2), dtype=np.int64)
    e = s + rng.integers(1, 10, size=(50, 1))
    cols = Columns(s, e, np.full((50, 2), 0.02), rng.uniform(0, 0.01, (50, 2)),
                   rng.uniform(0, 1e-3, (50, 2)), s - 1, s, rng.uniform(0, 0.5, (50, 2)))
    want = lp_column_prices(p, cols)
    assert want.max() > 0
    got = b.price(shifted(cols, 30), t0 + 30 * SLOT)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    packed, shift = b.cumsums(t0 + 30 * SLOT)
    assert shift == 0
    p0, _ = price_cumsums(p[:, 30:])
    np.testing.assert_allclose(packed[:, :71, :3], p0, rtol=1e-12, atol=1e-12)


def test_a_cold_book_takes_the_slot_of_now_as_its_origin(
        duals: tuple[float, np.ndarray]) -> None:
    t0, p = duals
    b = book(2)
    assert b.origin_s is None
    b.warm_start(t0, p, now_s=t0 + 12.4 * SLOT)
    assert b.origin_s == pytest.approx(t0 + 12 * SLOT)
    np.testing.assert_array_equal(b.p[:, :88], p[:, 12:])


@pytest.mark.parametrize(("bad", "word"), [(np.nan, "NaN"), (np.inf, "infinite"),
                                           (-1.0, "negative")])
def test_bad_duals_are_refused_by_name(bad: float, word: str) -> None:
    p = np.ones((1, 10, 3))
    p[0, 4, 1] = bad
    b = book(1)
    with pytest.raises(ValueError, match=word):
        b.warm_start(0.0, p)
    assert b.origin_s is None and not b.p.any()


def test_a_later_update_moves_on_from_the_duals(duals: tuple[float, np.ndarray]) -> None:
    t0, p = duals
    b = book(2)
    b.advance(t0)
    b.warm_start(t0, p)
    seeded = b.p.copy()
    rng = np.random.default_rng(2)
    for _ in range(40):
        s = rng.integers(0, 20, size=2)
        cols = Columns(s, s + 30, np.full(2, 0.3), np.full(2, 0.2), np.full(2, 0.0),
                       s, s + 1, np.full(2, 0.5))
        b.add_sample(np.full(2, 50.0), cols, SampleExtent.of_columns(cols))
    b.update(t0)
    assert b.num_updates == 1
    assert np.all(b.p >= 0) and np.all(np.isfinite(b.p))
    assert not np.allclose(b.p, seeded)
    # the average starts at the duals: it moved by a fraction of the step
    assert np.abs(b.p - seeded).max() < np.abs(b._iterate - seeded).max() + 1e-12


def test_book_slots_before_the_lps_window_take_its_first_slot(
        duals: tuple[float, np.ndarray]) -> None:
    # the solve's window began late in the book's slot 0, or the book last rolled two
    # slots before it: those slots are now, priced as the LP's first, never 0
    t0, p = duals
    b = book(2)
    b.advance(t0 - 2 * SLOT)
    b.warm_start(t0, p)
    np.testing.assert_array_equal(b.p[:, :3], np.repeat(p[:, :1], 3, axis=1))
    k = p.shape[1]
    np.testing.assert_array_equal(b.p[:, 3:k + 2], p[:, 1:])
    np.testing.assert_array_equal(b.p[:, k + 2:], 0.0)   # past the LP's grid
