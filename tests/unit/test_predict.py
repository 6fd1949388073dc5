"""Predictors: deterministic features, held-out accuracy on synthetic data, save/load,
the batched request-path call, training-file errors, CLI, and a simulation that uses it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from olproute import predict
from olproute.cli.main import main
from olproute.config.loader import ConfigError, load_config, load_profiles
from olproute.predict import (
    NUM_HASH_DIMS,
    STAT_NAMES,
    Evaluation,
    Featurizer,
    Predictor,
    PredictorError,
    TrainConfig,
    apply_predictor,
    prompt_stats,
    read_training_file,
    spearman,
    tokenize,
    train_and_evaluate,
)
from olproute.sim.prompts import generate_prompts, synthetic_requests, training_data
from olproute.sim.scenario import build_requests, simulate
from olproute.types import Request
from tests.conftest import PROFILES, make_config

QWEN = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
TRAITS = {n: (m.num_params, m.max_context_tokens)
          for n, m in load_profiles(PROFILES).models.items()}
# one LightGBM thread: two OpenMP threads spin against each other on a busy 2-core machine
# (training the fixture took 5x the wall time and CPU of one thread at a load of 7)
FAST = TrainConfig(num_threads=1, seed=0)


@pytest.fixture(scope="module")
def trained() -> tuple[Predictor, Evaluation]:
    data = training_data(generate_prompts(1500, QWEN, np.random.default_rng(21)))
    return train_and_evaluate(data, TRAITS, holdout=0.25, config=FAST)


@pytest.fixture(scope="module")
def saved(trained: tuple[Predictor, Evaluation], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("predictor")
    trained[0].save(out)
    return out


# -- features --------------------------------------------------------------------------------
def test_tokenizer_splits_words_and_punctuation() -> None:
    assert tokenize("Hello, World! It's 3.5x") == ["hello", ",", "world", "!", "it", "'", "s",
                                                   "3", ".", "5x"]
    assert tokenize("") == []


def _stats(text: str) -> dict[str, float]:
    from collections import Counter

    tokens = tokenize(text)
    return dict(zip(STAT_NAMES, prompt_stats(text, tokens, Counter(tokens)), strict=True))


# prompt -> features that must be set (log1p of a requested length, or 1.0 for an indicator)
STAT_CASES = [
    ("Explain photosynthesis in 3 sentences.", {"log_requested_sentences": np.log1p(3),
                                                "is_explain": 1.0, "has_length_constraint": 1.0}),
    ("List five tips for baking bread.", {"log_requested_items": np.log1p(5), "is_list": 1.0}),
    ("Write a 250-word story about a fox.", {"log_requested_words": np.log1p(250),
                                             "is_creative": 1.0}),
    ("Summarize the report below in about 300 words.\n\nReport: ...",
     {"log_requested_words": np.log1p(300), "is_summarize": 1.0, "is_document": 1.0}),
    ("Compare cats and dogs. Be brief.", {"is_compare": 1.0, "is_brevity": 1.0}),
    ("Answer the question using the passages below. Explain step by step.",
     {"is_document": 1.0, "is_detail": 1.0, "is_explain": 1.0}),
    ("[WP] The moon is a hotel.", {"is_creative": 1.0, "has_length_constraint": 0.0}),
]


@pytest.mark.parametrize(("text", "expected"), STAT_CASES)
def test_prompt_stats_read_constraints_and_task_words(text: str,
                                                      expected: dict[str, float]) -> None:
    stats = _stats(text)
    for name, value in expected.items():
        assert stats[name] == pytest.approx(value), name
    assert stats["log_tokens"] == pytest.approx(np.log1p(len(tokenize(text))))


def test_indicators_ignore_the_middle_of_a_long_document() -> None:
    # indicators are read in the first and last 80 tokens, where instructions are
    pad = " ".join(["the cat sat on the mat"] * 20)
    middle = " ".join(["the report says list and compare the story"] * 200)
    stats = _stats(f"Translate this text.\n{pad} {middle} {pad}\nThanks.")
    assert stats["is_rewrite"] == 1.0
    assert stats["is_list"] == stats["is_compare"] == stats["is_creative"] == 0.0


@pytest.mark.parametrize("text", ["", "hi", "Summarize: " + "word " * 5000])
def test_features_are_shape_stable_and_finite(trained: tuple[Predictor, Evaluation],
                                              text: str) -> None:
    predictor = trained[0]
    f = predictor.prompt_features(text)
    assert f.shape == (predictor.spec.num_prompt_features,)
    assert np.all(np.isfinite(f))
    assert np.array_equal(f, predictor.prompt_features(text))


def test_hashing_is_the_same_in_another_process() -> None:
    # Python's hash() is salted per process; the features must not be
    text = "Explain quantum error correction to a beginner, with one example."
    here = Featurizer().stats_and_hashed(text)[1]
    code = ("import sys, json; from olproute.predict import Featurizer; "
            f"print(json.dumps(Featurizer().stats_and_hashed({text!r})[1].tolist()))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert np.array_equal(np.array(json.loads(out)), here)
    assert here.shape == (NUM_HASH_DIMS,)
    assert np.abs(here).sum() == pytest.approx(1.0)  # signed counts over the token count


# -- accuracy ---------------------------------------------------------------------------------
def test_decode_predictor_beats_the_per_task_mean(trained: tuple[Predictor, Evaluation]) -> None:
    ev = trained[1]
    mae, mape, r2 = ev.decode["predictor"]
    assert mae < 0.75 * ev.decode["per-task mean"][0]
    assert mae < ev.decode["per-task-and-model mean"][0]
    assert mape < ev.decode["per-task mean"][1]
    assert r2 > 0.6


def test_quality_ranking_spearman_above_half(trained: tuple[Predictor, Evaluation]) -> None:
    ev = trained[1]
    assert ev.quality_spearman > 0.5
    assert ev.quality_spearman_within > 0.3  # within one task and model: difficulty alone
    assert ev.p90_coverage is not None and 0.75 < ev.p90_coverage < 0.97


def test_spearman_handles_ties_and_constants() -> None:
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])) == pytest.approx(1)
    assert spearman(np.array([1.0, 1.0, 2.0]), np.array([2.0, 2.0, 1.0])) == pytest.approx(-1)
    assert np.isnan(spearman(np.array([1.0, 1.0]), np.array([1.0, 2.0])))


def test_training_is_reproducible() -> None:
    data = training_data(generate_prompts(200, QWEN, np.random.default_rng(1)))
    small = replace(FAST, decode_rounds=20, quality_rounds=20)
    a, _ = train_and_evaluate(data, TRAITS, 0.2, small)
    b, _ = train_and_evaluate(data, TRAITS, 0.2, small)
    for text in data.prompts[:5]:
        assert a.predict(text, QWEN, p90=True) == b.predict(text, QWEN, p90=True)


# -- save / load and the request path -------------------------------------------------------
def test_save_load_gives_identical_predictions(trained: tuple[Predictor, Evaluation],
                                               saved: Path) -> None:
    loaded = Predictor.load(saved)
    assert loaded.spec == trained[0].spec
    spec = json.loads((saved / "feature_spec.json").read_text())
    assert spec["version"] == 1 and spec["heads"] == ["decode", "quality", "p90"]
    for p in generate_prompts(20, QWEN, np.random.default_rng(99)):
        assert loaded.predict(p.text, QWEN, p90=True) == trained[0].predict(p.text, QWEN,
                                                                            p90=True)


def test_one_row_per_distinct_model_in_instance_order(
        trained: tuple[Predictor, Evaluation]) -> None:
    predictor = trained[0]
    text = "Write a short story of about 500 words. A lighthouse keeper finds a map."
    instances = ("qwen3-32b", "qwen3-0.6b", "qwen3-32b", "qwen3-8b", "qwen3-0.6b")
    pred = predictor.predict(text, instances, p90=True)
    assert pred.models == instances
    x = predictor.rows(predictor.prompt_features(text), predictor.model_ids(instances))
    decode, quality, upper = predictor.predict_matrix(x, p90=True)
    assert pred.decode_tokens == tuple(decode.tolist())
    assert pred.quality == tuple(quality.tolist())
    assert pred.decode_tokens_p90 == tuple(upper.tolist()) if upper is not None else False
    assert pred.decode_tokens[0] == pred.decode_tokens[2]
    assert all(0.0 <= q <= 1.0 for q in pred.quality)
    assert all(o >= 1.0 for o in pred.decode_tokens)
    assert predictor.predict(text, instances).decode_tokens_p90 is None


def test_predict_takes_a_request(trained: tuple[Predictor, Evaluation]) -> None:
    predictor = trained[0]
    req = Request(request_id=4, arrival_s=0.0, prompt_tokens=9, decode_tokens=10,
                  predicted_decode_tokens=10, ttft_target_s=0.2,
                  text="Explain how vaccines work in two sentences.")
    assert predictor.predict(req, QWEN) == predictor.predict(str(req.text), QWEN)
    with pytest.raises(PredictorError, match="request 4 has no prompt text"):
        predictor.predict(replace(req, text=None), QWEN)
    with pytest.raises(PredictorError, match="'gpt-9'"):
        predictor.predict(req, ("qwen3-8b", "gpt-9"))


def test_apply_predictor_sets_only_the_predictions_of_every_model(
        trained: tuple[Predictor, Evaluation]) -> None:
    predictor = trained[0]
    reqs = synthetic_requests(15, np.arange(15.0), QWEN, np.random.default_rng(4))
    models = ["qwen3-8b", "qwen3-0.6b"]
    out = apply_predictor(reqs, predictor, models)
    for before, after in zip(reqs, out, strict=True):
        expected = predictor.predict(before, models)
        assert after.predicted_decode_tokens == max(1, round(expected.decode_tokens[0]))
        assert after.predicted_decode_by_model == {
            m: max(1, round(o)) for m, o in zip(models, expected.decode_tokens, strict=True)}
        assert after.predicted_quality_by_model == pytest.approx(
            dict(zip(models, expected.quality, strict=True)))
        assert replace(after, predicted_decode_tokens=before.predicted_decode_tokens,
                       predicted_decode_by_model=None,
                       predicted_quality_by_model=None) == before


@pytest.mark.parametrize(("change", "match"), [
    (lambda spec: spec | {"version": 99}, "version 99"),
    (lambda spec: spec | {"tokenizer": "bpe"}, "retrain"),
])
def test_load_refuses_another_feature_spec(saved: Path, tmp_path: Path, change: object,
                                           match: str) -> None:
    import shutil

    copy = tmp_path / "p"
    shutil.copytree(saved, copy)
    spec = json.loads((copy / "feature_spec.json").read_text())
    (copy / "feature_spec.json").write_text(json.dumps(change(spec)))  # type: ignore[operator]
    with pytest.raises(PredictorError, match=match):
        Predictor.load(copy)
    with pytest.raises(PredictorError, match="not a saved predictor"):
        Predictor.load(tmp_path / "missing")


# -- training files ---------------------------------------------------------------------------
HEADER = "prompt,model,output_tokens,quality\n"
BAD_FILES = [
    ("a.csv", HEADER + "hi,qwen3-8b,12,0.5\nyo,qwen3-8b,abc,0.5\n", "line 3: output_tokens"),
    ("b.csv", HEADER + '"multi\nline",qwen3-8b,12,0.5\nhi,qwen3-8b,12,1.5\n', "line 4: quality"),
    ("c.csv", "prompt,model,output_tokens\nhi,m,3\n", "line 1: header lacks column"),
    ("d.csv", HEADER + "hi,qwen3-8b,12\n", "line 2: expected 4 fields"),
    ("e.csv", HEADER + ",qwen3-8b,12,0.5\n", "line 2: prompt"),
    ("f.csv", HEADER + "hi,qwen3-8b,0,0.5\n", "line 2: output_tokens"),
    ("g.csv", HEADER, "no training rows"),
    ("h.jsonl", '{"prompt": "a", "model": "m", "output_tokens": 3, "quality": 0.1}\n\n{bad\n',
     "line 3: column 2: invalid JSON"),
    ("i.jsonl", '{"prompt": "a", "model": "m", "output_tokens": 3.5, "quality": 0.1}\n',
     "line 1: output_tokens"),
    ("j.jsonl", '[1, 2]\n', "line 1: expected a JSON object"),
    ("k.jsonl", '{"prompt": "a", "output_tokens": 3, "quality": 0.1}\n', "line 1: model"),
]


@pytest.mark.parametrize(("name", "content", "match"), BAD_FILES)
def test_malformed_training_file_names_the_line(tmp_path: Path, name: str, content: str,
                                                match: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PredictorError, match=match) as info:
        read_training_file(path)
    assert str(path) in str(info.value)


def test_cli_reports_a_malformed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "hi,qwen3-8b,12,0.5\nyo,qwen3-8b,12,high\n")
    assert main(["train-predictors", "--data", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 3: quality" in err


def test_cli_trains_on_synthetic_data(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the command's TrainConfig with one thread (see FAST); the rest is as the CLI makes it
    monkeypatch.setattr(predict, "TrainConfig", functools.partial(TrainConfig, num_threads=1))
    out = tmp_path / "models"
    rows = tmp_path / "rows.jsonl"
    code = main(["train-predictors", "--data", "synthetic", "--num-prompts", "300",
                 "--models", "qwen3-0.6b,qwen3-32b", "--out", str(out), "--no-progress",
                 "--save-data", str(rows)])
    assert code == 0
    text = capsys.readouterr().out
    assert "per-task mean" in text and "Spearman" in text
    for name in ("decode_mean.txt", "quality.txt", "decode_p90.txt", "pca.npz",
                 "feature_spec.json", "eval.json", "eval.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "eval.json").read_text())["quality"]["spearman"] > 0.3
    assert Predictor.load(out).models == ("qwen3-0.6b", "qwen3-32b")
    # the saved rows train again from the file
    assert main(["train-predictors", "--data", str(rows), "--out", str(tmp_path / "again"),
                 "--no-progress"]) == 0


# -- simulator -------------------------------------------------------------------------------
POOL = [{"name": "small", "model": "qwen3-0.6b", "gpu": "a100-80gb"},
        {"name": "mid", "model": "qwen3-8b", "gpu": "a100-80gb"},
        {"name": "big", "model": "qwen3-32b", "gpu": "h100", "tensor_parallel": 2}]


def test_synthetic_simulation_with_the_predictor_runs(trained: tuple[Predictor, Evaluation],
                                                      saved: Path) -> None:
    loaded = make_config(instances=POOL,
                         workload={"kind": "synthetic", "rate_per_s": 4.0, "num_requests": 40},
                         prediction={"mode": "predictor", "model_dir": str(saved)})
    res = simulate(loaded, "round_robin")
    assert not res.shed.any() and np.all(np.isfinite(res.finish_s))
    for r, g in zip(res.requests, res.instance.tolist(), strict=True):
        assert r.text is not None and r.decode_tokens_by_model is not None
        expected = trained[0].predict(r, ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
        assert r.predicted_decode_tokens == max(1, round(expected.decode_tokens[0]))
        assert r.predicted_decode_by_model is not None
        assert r.predicted_decode_by_model["qwen3-32b"] == max(
            1, round(expected.decode_tokens[2]))
        # each instance generates its own model's true length
        assert res.decode_tokens[r.request_id] == r.decode_tokens_by_model[POOL[g]["model"]]
    oracle = build_requests(make_config(
        instances=POOL, workload={"kind": "synthetic", "rate_per_s": 4.0, "num_requests": 40},
        prediction={"mode": "oracle"}))
    assert [r.text for r in oracle] == [r.text for r in res.requests]
    assert all(r.predicted_decode_tokens == r.decode_tokens for r in oracle)


def _write(tmp_path: Path, **sections: object) -> Path:
    data = {"profiles": str(PROFILES), "instances": POOL,
            "workload": {"kind": "synthetic", "rate_per_s": 2.0, "num_requests": 5}}
    data.update(sections)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_predictor_mode_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"prediction\.model_dir: required"):
        load_config(_write(tmp_path, prediction={"mode": "predictor"}))
    trace = {"kind": "poisson", "rate_per_s": 1.0, "num_requests": 3, "prompt_tokens": 10,
             "decode_tokens": 10}
    with pytest.raises(ConfigError, match=r"prediction\.mode: 'predictor' needs prompt text"):
        load_config(_write(tmp_path, workload=trace,
                           prediction={"mode": "predictor", "model_dir": "m"}))
    with pytest.raises(ConfigError, match=r"workload\.rate_per_s: required"):
        load_config(_write(tmp_path, workload={"kind": "synthetic", "num_requests": 3}))


def test_model_dir_is_relative_to_the_config_file(saved: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(saved, tmp_path / "models")
    loaded = load_config(_write(tmp_path, prediction={"mode": "predictor",
                                                      "model_dir": "models"}))
    reqs = build_requests(loaded)
    assert len(reqs) == 5 and all(r.text for r in reqs)
