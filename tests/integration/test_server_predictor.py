"""The served predictor end to end: a real router on 127.0.0.1 in front of fake backends.
By default it runs the shipped predictor on each request's prompt text, and the
explanation (``/route``'s answer, the proxy's ``x-olproute-explanation``) says where the
prediction came from: ``predictor``, ``request`` (``/route``'s ``predicted_tokens``) or
``max_tokens`` (token ids, ``prompt_tokens`` alone, ``prediction.serve: max_tokens``, a
model the predictor does not know)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from olproute.cli.main import main
from olproute.config.loader import load_config
from olproute.predict import SHIPPED_DIR, Predictor
from olproute.sim.scenario import CalibrationSource
from tests.conftest import PROFILES
from tests.integration.server_harness import Stack
from tests.integration.test_server import CAL, TOKEN, _config, request

MODEL = "qwen3-0.6b"   # the pool of test_server's config: 3 instances of it
TEXT = "Write a 250-word story about a lighthouse keeper who finds a message in a bottle."
EXPLAIN = {"x-olproute-explain": "1"}


@pytest.fixture(scope="module")
def shipped() -> Predictor:
    return Predictor.load(SHIPPED_DIR)


def _stack(path: Path, num_fakes: int = 3) -> Stack:
    loaded = load_config(path)
    return Stack(loaded, num_fakes=num_fakes,
                 calibration=CalibrationSource(loaded, known=[CAL] * num_fakes))


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = _stack(_config(tmp_path))
    try:
        yield s
    finally:
        s.close()


def _expected(shipped: Predictor, text: str, models: list[str], max_tokens: int
              ) -> tuple[dict[str, int], dict[str, float]]:
    p = shipped.predict(text, models)
    return ({m: min(max(1, round(d)), max_tokens) for m, d in zip(models, p.decode_tokens,
                                                                   strict=True)},
            dict(zip(models, p.quality, strict=True)))


def _route(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = request(stack.url, "POST", "/route", body)
    assert status == 200, raw
    return dict(json.loads(raw)["explanation"])


def _explained(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, headers, _ = request(stack.url, "POST", path, body, headers=EXPLAIN)
    assert status == 200
    return dict(json.loads(headers["x-olproute-explanation"]))


def test_route_predicts_from_the_prompt_with_the_shipped_predictor(stack: Stack,
                                                                   shipped: Predictor) -> None:
    for max_tokens in (1000, 5):   # the second caps the prediction
        decode, quality = _expected(shipped, TEXT, [MODEL], max_tokens)
        expl = _route(stack, {"prompt": TEXT, "max_tokens": max_tokens})
        assert expl["prediction"] == {"source": "predictor", "max_tokens": max_tokens,
                                      "decode_tokens": decode, "quality": quality}
        # the policy decided with it: bid_price's own per-instance figure
        assert expl["decode_tokens"] == [float(decode[MODEL])] * 3
    assert decode[MODEL] == 5 < round(shipped.predict(TEXT, [MODEL]).decode_tokens[0])


def test_route_predicted_tokens_and_token_counts(stack: Stack, shipped: Predictor) -> None:
    expl = _route(stack, {"prompt": TEXT, "max_tokens": 1000, "predicted_tokens": 77})
    _, quality = _expected(shipped, TEXT, [MODEL], 1000)
    assert expl["prediction"] == {"source": "request", "max_tokens": 1000,
                                  "decode_tokens": {MODEL: 77}, "quality": quality}
    assert expl["decode_tokens"] == [77.0] * 3
    expl = _route(stack, {"prompt_tokens": 300, "max_tokens": 90})
    assert expl["prediction"] == {"source": "max_tokens", "max_tokens": 90,
                                  "decode_tokens": {MODEL: 90}}
    assert expl["decode_tokens"] == [90.0] * 3


def test_the_proxy_explains_its_prediction(stack: Stack, shipped: Predictor) -> None:
    doc = _explained(stack, "/v1/completions", {"prompt": TEXT, "max_tokens": 6})
    decode, quality = _expected(shipped, TEXT, [MODEL], 6)
    assert doc["prediction"] == {"source": "predictor", "max_tokens": 6,
                                 "decode_tokens": decode, "quality": quality}
    assert doc["prediction"] == _route(stack, {"prompt": TEXT, "max_tokens": 6})["prediction"]
    # a chat's text is its messages' contents, one per line
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    doc = _explained(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    decode, quality = _expected(shipped, "Be brief.\n" + TEXT, [MODEL], 4)
    assert doc["prediction"]["source"] == "predictor"
    assert (doc["prediction"]["decode_tokens"], doc["prediction"]["quality"]) == (
        decode, quality)
    # token ids: no text to predict from
    doc = _explained(stack, "/v1/completions", {"prompt": [101, 102, 103], "max_tokens": 3})
    assert doc["prediction"] == {"source": "max_tokens", "max_tokens": 3,
                                 "decode_tokens": {MODEL: 3}}
    status, headers, _ = request(stack.url, "POST", "/v1/completions",
                                 {"prompt": TEXT, "max_tokens": 2})
    assert status == 200 and "x-olproute-explanation" not in headers


def test_a_lone_surrogate_in_a_chat_part_is_predicted(stack: Stack) -> None:
    """JSON may carry a lone surrogate, which has no UTF-8 form: a string field refuses it
    (400), but a chat's content parts reach the predictor as they are; it reads one as
    U+FFFD rather than failing the request."""
    raw = (b'{"messages": [{"role": "user", "content": [{"type": "text", '
           b'"text": "Write a poem \\ud800 about rain."}]}], "max_tokens": 3}')
    status, headers, body = request(stack.url, "POST", "/v1/chat/completions", raw=raw,
                                    headers=EXPLAIN)
    assert status == 200, body
    doc = json.loads(headers["x-olproute-explanation"])
    assert doc["prediction"]["source"] == "predictor"


def test_instances_say_what_is_predicted(stack: Stack) -> None:
    status, _, raw = request(stack.url, "GET", "/instances")
    assert status == 200
    assert json.loads(raw)["prediction"] == {"serve": "predictor", "predictor": "shipped",
                                             "models": [MODEL], "max_tokens_for": []}


def test_serve_max_tokens_runs_no_predictor(tmp_path: Path) -> None:
    s = _stack(_config(tmp_path, prediction={"serve": "max_tokens"}))
    try:
        assert _route(s, {"prompt": TEXT, "max_tokens": 40})["prediction"] == {
            "source": "max_tokens", "max_tokens": 40, "decode_tokens": {MODEL: 40}}
        doc = _explained(s, "/v1/completions", {"prompt": TEXT, "max_tokens": 3})
        assert doc["prediction"]["source"] == "max_tokens"
        assert _route(s, {"prompt": TEXT, "max_tokens": 40, "predicted_tokens": 9}
                      )["prediction"]["source"] == "request"
        raw = request(s.url, "GET", "/instances")[2]
        assert json.loads(raw)["prediction"] == {"serve": "max_tokens", "predictor": None,
                                                 "models": [],
                                                 "max_tokens_for": [MODEL]}
    finally:
        s.close()


def test_a_model_the_predictor_does_not_know(tmp_path: Path, shipped: Predictor,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A pool model without synthetic truth (a profile copied under another name): said
    at start-up and in /instances, and its requests are predicted max_tokens."""
    profiles = yaml.safe_load(PROFILES.read_text())
    profiles["models"]["mystery-7b"] = profiles["models"]["llama-2-7b"]
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    path = _config(tmp_path, profiles=str(tmp_path / "profiles.yaml"), instances=[
        {"name": "q", "model": MODEL, "gpu": "h100", "replicas": 2},
        {"name": "m", "model": "mystery-7b", "gpu": "a100-80gb"}])
    with caplog.at_level(logging.WARNING, logger="olproute.server"):
        s = _stack(path)
    try:
        said = [r.getMessage() for r in caplog.records if "mystery-7b" in r.getMessage()]
        assert len(said) == 1 and "predicted max_tokens" in said[0]
        raw = request(s.url, "GET", "/instances")[2]
        assert json.loads(raw)["prediction"]["max_tokens_for"] == ["mystery-7b"]
        decode, quality = _expected(shipped, TEXT, [MODEL], 1000)
        expl = _route(s, {"prompt": TEXT, "max_tokens": 1000})
        assert expl["prediction"] == {"source": "predictor", "max_tokens": 1000,
                                      "decode_tokens": {**decode, "mystery-7b": 1000},
                                      "quality": quality}
    finally:
        s.close()


def test_serve_refuses_a_model_dir_that_does_not_load(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    path = _config(tmp_path, prediction={"model_dir": "no-such-predictor"})
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "prediction.model_dir" in err and str(tmp_path / "no-such-predictor") in err


def test_reload_switches_the_predictor_or_refuses_by_key(tmp_path: Path) -> None:
    path = _config(tmp_path)
    s = _stack(path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        _config(tmp_path, prediction={"model_dir": "missing"})   # rewrites the file
        status, _, raw = request(s.url, "POST", "/admin/reload", headers=auth)
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "prediction.model_dir"
        assert _route(s, {"prompt": TEXT})["prediction"]["source"] == "predictor"
        _config(tmp_path, prediction={"serve": "max_tokens"})
        assert request(s.url, "POST", "/admin/reload", headers=auth)[0] == 200
        assert _route(s, {"prompt": TEXT})["prediction"]["source"] == "max_tokens"
    finally:
        s.close()
