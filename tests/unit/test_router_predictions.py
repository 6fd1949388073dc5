"""The router's predictions on the request path (``Router.new_request`` with the served
predictor): the same Request fields ``apply_predictor`` gives a simulated request with the
same text, capped at ``max_tokens``; ``max_tokens`` without text or for a model the
predictor does not know; ``predicted_tokens`` as the caller's override; and the
explanation's account of where they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.config.loader import ConfigError, LoadedConfig, load_config
from olproute.predict import SHIPPED_DIR, PoolPredictor, Predictor, apply_predictor
from olproute.routing.assembly import served_predictor
from olproute.routing.router import Router, prediction_source
from olproute.server.schema import prediction_doc
from olproute.sim.prompts import MODELS, generate_prompts
from olproute.types import Request
from tests.conftest import PROFILES, make_config

POOL = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
BIG = 1_000_000   # a max_tokens no prediction reaches


@pytest.fixture(scope="module")
def shipped() -> Predictor:
    return Predictor.load(SHIPPED_DIR)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p.text for p in generate_prompts(24, POOL, np.random.default_rng(7))]


def _pool(*models: str) -> LoadedConfig:
    return make_config(instances=[{"name": f"i{k}", "model": m, "gpu": "h100"}
                                  for k, m in enumerate(models)],
                       router={"policy": "round_robin"})


def _router(predictor: Predictor | None, *models: str) -> Router:
    return Router(_pool(*models), predictor=predictor)


def _fields(r: Request) -> tuple[Any, ...]:
    return (r.predicted_decode_tokens, r.predicted_decode_by_model,
            r.predicted_quality_by_model)


@pytest.mark.parametrize("models", [POOL, ("llama-2-7b",) * 4, ("qwen3-8b", "qwen3-0.6b",
                                                                  "qwen3-8b")])
def test_live_predictions_are_the_offline_ones(shipped: Predictor, texts: list[str],
                                               models: tuple[str, ...]) -> None:
    """A request predicted as it arrives carries exactly the fields a simulated request
    with the same text gets from ``apply_predictor`` (batch path, Booster.predict)."""
    router = _router(shipped, *models)
    live = [router.new_request(0.0, 10, BIG, 1.0, text=t) for t in texts]
    offline = apply_predictor(
        [Request(k, 0.0, 10, 1, 1, 1.0, text=t) for k, t in enumerate(texts)], shipped,
        list(dict.fromkeys(models)))
    assert [_fields(r) for r in live] == [_fields(r) for r in offline]
    assert all(prediction_source(r, given=False) == "predictor" for r in live)


def test_lengths_are_capped_at_max_tokens(shipped: Predictor, texts: list[str]) -> None:
    router = _router(shipped, *POOL)
    for text in texts:
        free = router.new_request(0.0, 10, BIG, 1.0, text=text)
        assert free.predicted_decode_by_model is not None
        for limit in (1, 17, 200):
            capped = router.new_request(0.0, 10, limit, 1.0, text=text)
            assert capped.predicted_decode_by_model == {
                m: min(n, limit) for m, n in free.predicted_decode_by_model.items()}
            assert capped.predicted_decode_tokens == min(free.predicted_decode_tokens, limit)
            assert capped.predicted_quality_by_model == free.predicted_quality_by_model


def test_one_featurisation_for_the_pool_matches_the_predictor(shipped: Predictor,
                                                              texts: list[str]) -> None:
    """What the router fills is ``Predictor.predict`` rounded: first model's length as the
    request's single length (what any model without an entry reads)."""
    router = _router(shipped, *POOL)
    for text in texts:
        r = router.new_request(0.0, 10, BIG, 1.0, text=text)
        p = shipped.predict(text, POOL)
        assert r.predicted_decode_by_model == {
            m: max(1, round(d)) for m, d in zip(POOL, p.decode_tokens, strict=True)}
        assert r.predicted_quality_by_model == dict(zip(POOL, p.quality, strict=True))
        assert r.predicted_decode_tokens == r.predicted_decode_by_model[POOL[0]]


def test_without_text_or_predictor_the_prediction_is_max_tokens(shipped: Predictor) -> None:
    for router, text in ((_router(shipped, *POOL), None),
                         (_router(None, *POOL), "Write a 300-word essay on tides.")):
        r = router.new_request(0.0, 10, 123, 1.0, text=text)
        assert _fields(r) == (123, None, None)
        assert prediction_source(r, given=False) == "max_tokens"
        assert all(r.predicted_decode_tokens_for(m) == 123 for m in POOL)


def test_predicted_tokens_override_the_length_not_the_quality(shipped: Predictor) -> None:
    router = _router(shipped, *POOL)
    text = "List five tips for sleeping well."
    r = router.new_request(0.0, 10, 500, 1.0, text=text, predicted_tokens=42)
    assert r.predicted_decode_tokens == 42 and r.predicted_decode_by_model is None
    assert all(r.predicted_decode_tokens_for(m) == 42 for m in POOL)
    assert r.predicted_quality_by_model == router.new_request(
        0.0, 10, 500, 1.0, text=text).predicted_quality_by_model
    assert prediction_source(r, given=True) == "request"
    doc = prediction_doc(r, router.models, 500, "request")
    assert doc["decode_tokens"] == dict.fromkeys(POOL, 42) and set(doc["quality"]) == set(POOL)


def test_a_model_the_predictor_does_not_know_reads_max_tokens(shipped: Predictor) -> None:
    pool = PoolPredictor(shipped, ["qwen3-8b", "mystery-7b", "qwen3-8b"])
    assert (pool.known, pool.unknown) == (("qwen3-8b",), ("mystery-7b",))
    found = pool.predict("Summarize the following report in three sentences.", 64)
    assert found is not None
    assert set(found.decode_by_model) == {"qwen3-8b"} == set(found.quality_by_model)
    assert found.decode_tokens == 64   # what mystery-7b reads
    assert PoolPredictor(shipped, ["mystery-7b"]).predict("hello", 64) is None


def test_the_explanations_prediction(shipped: Predictor) -> None:
    router = _router(shipped, *POOL)
    r = router.new_request(0.0, 10, 300, 1.0, text="Explain how a heat pump works.")
    doc = prediction_doc(r, router.models, 300, prediction_source(r, given=False))
    assert doc["source"] == "predictor" and doc["max_tokens"] == 300
    assert doc["decode_tokens"] == r.predicted_decode_by_model
    assert doc["quality"] == r.predicted_quality_by_model
    bare = router.new_request(0.0, 10, 300, 1.0)
    assert prediction_doc(bare, router.models, 300, "max_tokens") == {
        "source": "max_tokens", "max_tokens": 300, "decode_tokens": dict.fromkeys(POOL, 300)}


# -- which predictor serve runs --------------------------------------------------------------
def _write(tmp_path: Path, prediction: dict[str, Any]) -> Path:
    data = {"profiles": str(PROFILES),
            "instances": [{"name": "q", "model": "qwen3-8b", "gpu": "h100", "replicas": 2}],
            "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                         "prompt_tokens": 10, "decode_tokens": 10},
            "prediction": prediction}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_serve_runs_the_shipped_predictor_by_default(tmp_path: Path) -> None:
    predictor = served_predictor(load_config(_write(tmp_path, {})))
    assert predictor is not None and predictor.directory == SHIPPED_DIR
    assert set(MODELS) <= set(predictor.models)
    assert served_predictor(load_config(_write(tmp_path, {"serve": "max_tokens"}))) is None


def test_serve_runs_the_predictor_model_dir_names(tmp_path: Path, shipped: Predictor) -> None:
    shipped.save(tmp_path / "mine")
    predictor = served_predictor(load_config(_write(tmp_path, {"model_dir": "mine"})))
    assert predictor is not None and predictor.directory == tmp_path / "mine"


def test_a_model_dir_that_does_not_load_names_the_key_and_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for folder in ("missing", "empty"):
        loaded = load_config(_write(tmp_path, {"model_dir": folder}))
        with pytest.raises(ConfigError) as err:
            served_predictor(loaded)
        assert "prediction.model_dir" in str(err.value)
        assert str(tmp_path / folder) in str(err.value)
    # a config that serves max_tokens never reads the folder
    loaded = load_config(_write(tmp_path, {"model_dir": "missing", "serve": "max_tokens"}))
    assert served_predictor(loaded) is None
    with pytest.raises(ConfigError, match=r"prediction\.serve"):
        load_config(_write(tmp_path, {"serve": "oracle"}))


def test_snapshots_report_each_backends_models_prediction(shipped: Predictor) -> None:
    """The tracker's snapshots (what BEA replays) carry a request's predicted output on
    the model of the backend it runs on, as the simulator's engines do
    (``predicted_decode_tokens_for``), not the first model's."""
    from olproute.server.tracker import Tracker
    from olproute.types import SNAP_PREDICTED

    router = _router(shipped, *POOL)
    r = router.new_request(0.0, 10, BIG, 1.0, text="Compare cats and dogs as pets.")
    assert r.predicted_decode_by_model is not None
    assert len(set(r.predicted_decode_by_model.values())) > 1   # the models differ
    tracker = Tracker(router.specs, ["http://x"] * len(POOL))
    for g in range(len(POOL)):
        tracker.dispatched(g, r, 0.0)
    snaps = tracker.snapshots(0.0)
    assert [int(s.table[0, SNAP_PREDICTED]) for s in snaps] == [
        r.predicted_decode_by_model[m] for m in POOL]
