"""A price book adopts another book's state only when it fits (``PriceBook.adopt``): a
state holding a NaN, a negative value or an array of another shape is refused, and the
book keeps its own prices."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.unit.test_price_share import _add, _book


@pytest.mark.parametrize("bad", ["nan", "shape", "acc"])
def test_a_book_refuses_a_state_with_a_nan_or_of_another_shape(bad: str) -> None:
    learned = _book()
    for i in range(30):
        _add(learned, i * 0.1, 1000.0 + i)
    learned.update(3.0)
    state = learned.state()
    book = _book()
    before = book.state()
    p = state.p.copy()
    if bad == "nan":
        state = replace(state, p=np.full_like(p, np.nan))
    elif bad == "shape":
        state = replace(state, iterate=p[:1])
    else:
        state = replace(state, acc=-np.ones_like(p))
    with pytest.raises(ValueError):
        book.adopt(state)
    np.testing.assert_array_equal(book.p, before.p)
    assert not np.isnan(book.p).any()
