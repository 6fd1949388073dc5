"""The heads on the request path (``RowHeads``: LightGBM's single-row fast path called
from the compiled kernel ``olproute.predict._rowheads``) give exactly ``Booster.predict``'s
values."""

from __future__ import annotations

import numpy as np
import pytest

from olproute.predict import Predictor, TrainConfig, train_and_evaluate
from olproute.sim.prompts import generate_prompts, training_data

MODELS = ("qwen3-0.6b", "qwen3-8b")


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    data = training_data(generate_prompts(240, MODELS, np.random.default_rng(7)))
    config = TrainConfig(num_threads=1, seed=0)
    return train_and_evaluate(data, {"qwen3-8b": (8e9, 32768)}, 0.25, config)[0]


def test_row_heads_equal_booster_predict_bitwise(predictor: Predictor) -> None:
    rng = np.random.default_rng(8)
    texts = [p.text for p in generate_prompts(30, MODELS, rng)]
    x = predictor.rows(np.array([predictor.prompt_features(t) for t in texts]),
                       predictor.model_ids([MODELS[i % 2] for i in range(len(texts))]))
    noise = x + rng.normal(0.0, 3.0, x.shape)
    noise[::4, -2:] = np.nan  # unknown model traits
    heads = predictor._row_heads
    for rows in (x, noise, x[:1]):
        rows = np.ascontiguousarray(rows)
        for head, booster in enumerate((predictor._decode, predictor._quality, predictor._p90)):
            assert booster is not None
            expected = booster.predict(rows, num_threads=1)
            assert np.array(heads.predict(head, rows)).tobytes() == expected.tobytes()


def test_row_heads_refuse_rows_of_another_width_or_layout(predictor: Predictor) -> None:
    x = predictor.rows(predictor.prompt_features("hello"), predictor.model_ids(MODELS))
    with pytest.raises(ValueError, match="features"):
        predictor._row_heads.predict(0, np.ascontiguousarray(x[:, :-1]))
    with pytest.raises(ValueError):
        predictor._row_heads.predict(0, np.asfortranarray(x))
    assert predictor._row_heads.predict(0, x[:0]) == []
