"""The explanation on the request path: built only when an answer carries it. ``/route``
always does; the proxy only when the client sends ``x-olproute-explain: 1``, and then in
``x-olproute-explanation`` (the policy's per-instance figures and the request's
``prediction``: tests/integration/test_server_predictor.py). A recording explanation counts
every read of it. And the loop-lag endpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from olproute.config.loader import load_config
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from olproute.types import Decision
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config, request

BODY = {"prompt": "one two three", "max_tokens": 2}


class Recording(Mapping[str, tuple[float, ...]]):
    """An explanation that counts how often anything read it."""

    def __init__(self, inner: Mapping[str, tuple[float, ...]], reads: list[str]) -> None:
        self._inner = inner
        self._reads = reads

    def __getitem__(self, key: str) -> tuple[float, ...]:
        self._reads.append(key)
        return self._inner[key]

    def __iter__(self) -> Iterator[str]:
        self._reads.append("iter")
        return iter(self._inner)

    def __len__(self) -> int:
        self._reads.append("len")
        return len(self._inner)


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[Stack, list[str]]]:
    """A stack (no live certificate) whose decisions carry a recording explanation."""
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    reads: list[str] = []
    router = s.app[STATE].router
    decide = router.decide

    def recording(*args: Any, **kwargs: Any) -> Decision:
        d = decide(*args, **kwargs)
        return replace(d, explanation=Recording(d.explanation, reads))

    s.call(lambda: setattr(router, "decide", recording))
    try:
        yield s, reads
    finally:
        s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_reads_no_explanation_unless_asked(recorded: tuple[Stack, list[str]],
                                                 stream: bool) -> None:
    stack, reads = recorded
    status, headers, _ = request(stack.url, "POST", "/v1/completions",
                                 {**BODY, "stream": stream})
    assert status == 200 and "x-olproute-instance" in headers
    assert "x-olproute-explanation" not in headers
    assert reads == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_proxy_returns_the_explanation_when_asked(recorded: tuple[Stack, list[str]],
                                                  path: str) -> None:
    stack, reads = recorded
    body = (BODY if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    status, headers, _ = request(stack.url, "POST", path, body,
                                 headers={"x-olproute-explain": "1"})
    assert status == 200
    doc = json.loads(headers["x-olproute-explanation"])
    assert doc.pop("prediction")["source"] == "predictor"
    assert doc and all(len(v) == 3 and all(isinstance(x, float) for x in v)
                       for v in doc.values())
    assert "score" in doc and reads


def test_route_answers_with_the_explanation(recorded: tuple[Stack, list[str]]) -> None:
    stack, reads = recorded
    status, _, raw = request(stack.url, "POST", "/route", {"prompt": "a b c"})
    doc = json.loads(raw)
    assert status == 200 and doc["instances"] == ["q-0", "q-1", "q-2"]
    assert "score" in doc["explanation"] and len(doc["explanation"]["score"]) == 3
    assert reads


def test_loop_lag_endpoint(recorded: tuple[Stack, list[str]]) -> None:
    stack, _ = recorded

    def lag() -> dict[str, Any]:
        status, _, raw = request(stack.url, "GET", "/debug/loop-lag?seconds=60")
        assert status == 200
        return dict(json.loads(raw))

    assert wait_until(lambda: lag()["samples"] > 0)
    doc = lag()
    assert doc["period_ms"] == 10 and doc["window_s"] == 60
    assert 0 <= doc["p50_ms"] <= doc["p99_ms"] <= doc["max_ms"]
    for bad in ("0", "-1", "61", "x", "nan"):
        status, _, raw = request(stack.url, "GET", f"/debug/loop-lag?seconds={bad}")
        assert status == 400 and json.loads(raw)["error"]["param"] == "seconds"
