"""The predictor the package ships (``olproute/predict/shipped``): it loads, knows every
model with synthetic truth, was trained on today's features (a change of the features or
of a model's traits fails here: retrain with the command in its README), and is package
data."""

from __future__ import annotations

import fnmatch
import json
import tomllib

import pytest

from olproute.config.loader import load_profiles
from olproute.predict import (
    FEATURE_VERSION,
    NUM_HASH_DIMS,
    NUM_PCA,
    SHIPPED_DIR,
    STAT_NAMES,
    TOKEN_HASH,
    TOKENIZER,
    Predictor,
)
from olproute.sim.prompts import MODELS
from tests.conftest import PROFILES, REPO


@pytest.fixture(scope="module")
def shipped() -> Predictor:
    return Predictor.load(SHIPPED_DIR)


def test_it_knows_every_synthetic_model(shipped: Predictor) -> None:
    assert set(MODELS) <= set(shipped.models)
    pred = shipped.predict("Write a 250-word story about a lighthouse keeper.", list(MODELS))
    assert all(d >= 1 for d in pred.decode_tokens)
    assert all(0 <= q <= 1 for q in pred.quality)


def test_it_was_trained_on_todays_features(shipped: Predictor) -> None:
    spec = json.loads((SHIPPED_DIR / "feature_spec.json").read_text())
    assert spec["version"] == FEATURE_VERSION
    assert (spec["tokenizer"], spec["token_hash"]) == (TOKENIZER, TOKEN_HASH)
    assert tuple(spec["stat_names"]) == STAT_NAMES
    assert (spec["num_hash_dims"], spec["num_pca"]) == (NUM_HASH_DIMS, NUM_PCA)
    # each model's traits are features too: a profile changed since training moves them
    profiles = load_profiles(PROFILES).models
    for m in shipped.spec.models:
        assert (m.num_params, m.max_context_tokens) == (
            profiles[m.name].num_params, profiles[m.name].max_context_tokens), m.name


def test_its_held_out_figures_are_kept() -> None:
    evaluation = json.loads((SHIPPED_DIR / "eval.json").read_text())
    predictor = evaluation["decode"]["predictor"]
    assert predictor["mape"] < evaluation["decode"]["per-task mean"]["mape"]
    readme = (SHIPPED_DIR / "README.md").read_text()
    assert "olproute train-predictors --data synthetic --num-prompts 5000 --seed 100" in readme


def test_it_is_package_data() -> None:
    """Every file of the folder matches a ``package-data`` pattern of pyproject.toml (a
    wheel or an install without it would serve without a predictor)."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["olproute"]
    files = [p.relative_to(SHIPPED_DIR.parent.parent).as_posix()
             for p in SHIPPED_DIR.iterdir() if p.name != "eval.png"]
    assert files
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f
