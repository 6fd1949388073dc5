"""The routing server end to end: a real aiohttp router on 127.0.0.1 in front of fake
backends (scriptable failures) started inside the tests, talked to over HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.estimate.calibration import InstanceCalibration
from olproute.pricing.reward import RESOURCES
from olproute.sim.scenario import CalibrationSource
from tests.conftest import HANG_S, PROFILES
from tests.integration.server_harness import Stack, record_outcomes, wait_until

CAL = InstanceCalibration(beta=(3e-3, 1e-6, 1e-8, 1e-10), prefill_tokens_per_s=50_000,
                          tpot_s=0.004, mean_batch_seqs=8, service_rate_per_s=20)
TOKEN = "s3cret"


def _config(tmp_path: Path, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 3}],
        "router": {"policy": "bid_price", "slot_ms": 20},
        "prices": {"period_slots": 5, "window": 200, "minibatch": 32},
        "server": {"health_period_s": 0.1, "scrape_period_s": 0.2, "admin_token": TOKEN},
        "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                     "prompt_tokens": 10, "decode_tokens": 10},
    }
    data.update(extra)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        yield s
    finally:
        s.close()


def request(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG_S)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.read()
    result = resp.status, {k.lower(): v for k, v in resp.getheaders()}, out
    conn.close()
    return result


def open_stream(url: str, path: str, body: Any
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG_S)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def read_lines(resp: http.client.HTTPResponse, limit: int | None = None) -> list[bytes]:
    """The answer's non-empty lines, up to ``limit`` of them or its end."""
    lines: list[bytes] = []
    while limit is None or len(lines) < limit:
        line = resp.readline()
        if not line:
            break
        if line.strip():
            lines.append(line.strip())
    return lines


def stream(url: str, path: str, body: Any) -> tuple[int, dict[str, str], list[bytes]]:
    """POST and read the whole answer line by line."""
    conn, resp = open_stream(url, path, body)
    lines = read_lines(resp)
    headers = {k.lower(): v for k, v in resp.getheaders()}
    conn.close()
    return resp.status, headers, lines


def test_streaming_completion_arrives_chunk_by_chunk(stack: Stack) -> None:
    """Each backend holds its stream after the first chunk until the test has that chunk
    from the router: a router that buffered the stream would never pass it on (the read
    would time out)."""
    for fake in stack.fakes:
        fake.hold = asyncio.Event()
    conn, resp = open_stream(stack.url, "/v1/completions",
                             {"prompt": "hello there world", "max_tokens": 6, "stream": True})
    try:
        assert resp.status == 200
        headers = {k.lower(): v for k, v in resp.getheaders()}
        assert headers["x-olproute-instance"].startswith("q-")
        assert headers["x-olproute-reason"]
        first = read_lines(resp, limit=1)
        assert first[0].startswith(b"data: {")
        for fake in stack.fakes:
            assert fake.hold is not None
            stack.release(fake.hold)
        lines = first + read_lines(resp)
    finally:
        conn.close()
    data = [line for line in lines if line.startswith(b"data: {")]
    assert len(data) == 6 and lines[-1] == b"data: [DONE]"
    forwarded = [b for f in stack.fakes for b in f.bodies]
    assert forwarded[-1]["max_tokens"] == 6 and forwarded[-1]["stream"] is True


def test_non_streaming_and_chat(stack: Stack) -> None:
    status, _, raw = request(stack.url, "POST", "/v1/completions",
                             {"prompt": "one two", "max_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    status, _, lines = stream(stack.url, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi there"}],
                               "max_tokens": 4, "stream": True})
    assert status == 200
    deltas = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert [d["choices"][0]["delta"]["content"] for d in deltas] == ["tok "] * 4


def test_openai_client_streams_through_the_router(stack: Stack) -> None:
    import openai

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model="qwen3-0.6b", prompt="say something",
                                            max_tokens=5, stream=True))
    assert len(chunks) == 5
    assert "".join(c.choices[0].text for c in chunks) == "tok " * 5


def test_metrics_parse_and_count_decisions(stack: Stack) -> None:
    for _ in range(3):
        request(stack.url, "POST", "/v1/completions", {"prompt": "a b c", "max_tokens": 2})
    status, _, raw = request(stack.url, "GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    decisions = sum(s.value for s in families["olproute_decisions"].samples
                    if s.name == "olproute_decisions_total" and s.labels["action"] == "dispatch")
    assert decisions >= 3
    assert "olproute_decision_seconds" in families and "olproute_ttft_seconds" in families


def test_route_answers_with_its_explanation(stack: Stack) -> None:
    status, _, raw = request(stack.url, "POST", "/route",
                             {"prompt_tokens": 500, "max_tokens": 50, "ttft_target_ms": 800})
    assert status == 200
    doc = json.loads(raw)
    assert doc["action"] == "dispatch" and doc["instance"] in doc["instances"]
    for key in ("ttft_s", "reward", "price_cost", "score", "qps", "ttft_saved"):
        assert len(doc["explanation"][key]) == 3
    status, _, raw = request(stack.url, "POST", "/route", {"prompt_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt_tokens"
    status, _, raw = request(stack.url, "POST", "/route", {"max_tokens": 5})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    status, _, raw = request(stack.url, "GET", "/openapi.json")
    assert status == 200 and "/route" in json.loads(raw)["paths"]


def test_the_served_openapi_document_lists_every_route_with_its_content_type(
        stack: Stack) -> None:
    status, headers, raw = request(stack.url, "GET", "/openapi.json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    paths = json.loads(raw)["paths"]
    routes = [(r.method, r.resource.canonical) for r in stack.app.router.routes()
              if r.method != "HEAD" and r.resource is not None]
    assert [(m, p) for m, p in routes if m.lower() not in paths.get(p, {})] == []
    # what the handlers answer is what the document says they answer
    for path in ("/openapi.json", "/dashboard", "/dashboard/data"):
        status, headers, _ = request(stack.url, "GET", path)
        declared = paths[path]["get"]["responses"]["200"]
        assert status == 200
        assert headers["content-type"].split(";")[0] == next(iter(declared["content"])), path
        if "headers" in declared:
            assert headers["cache-control"] == "no-store", path


def test_prices_and_instances(stack: Stack) -> None:
    for _ in range(4):
        request(stack.url, "POST", "/v1/completions", {"prompt": "x y", "max_tokens": 2})
    assert wait_until(lambda: json.loads(request(stack.url, "GET", "/prices")[2])["updates"]
                      > 0)
    doc = json.loads(request(stack.url, "GET", "/prices")[2])
    assert [i["name"] for i in doc["instances"]] == ["q-0", "q-1", "q-2"]
    assert all(len(i[r]) == doc["horizon_slots"] for i in doc["instances"] for r in RESOURCES)
    assert {i["bottleneck"] for i in doc["instances"]} <= {"none", *RESOURCES}
    assert all(i["compute_budget_tokens_per_slot"] > 0 for i in doc["instances"])
    families = text_string_to_metric_families(request(stack.url, "GET", "/metrics")[2].decode())
    summed = {(x.labels["instance"], x.labels["resource"]) for f in families
              for x in f.samples if x.name == "olproute_price_sum"}
    assert summed == {(n, r) for n in ("q-0", "q-1", "q-2") for r in RESOURCES}
    inst = json.loads(request(stack.url, "GET", "/instances")[2])["instances"]
    assert len(inst[0]["beta"]) == 4
    # every backend is up (waited for: a probe that missed its 1 s timeout while the first
    # tick compiled on a loaded machine marks one down until the next probe)
    assert wait_until(lambda: all(
        i["healthy"] for i in json.loads(request(stack.url, "GET", "/instances")[2])
        ["instances"]))


def test_bad_input_is_400_naming_the_field_and_oversize_is_413(stack: Stack) -> None:
    status, _, raw = request(stack.url, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON" in json.loads(raw)["error"]["message"]
    status, _, raw = request(stack.url, "POST", "/v1/completions",
                             {"prompt": "x", "max_tokens": 0})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "max_tokens" and ">= 1" in err["message"]
    status, _, raw = request(stack.url, "POST", "/v1/completions", {"max_tokens": 3})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    status, _, raw = request(stack.url, "POST", "/v1/completions", {"prompt": "x"},
                             headers={"x-slo-ttft-ms": "soon"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "x-slo-ttft-ms"
    big = json.dumps({"prompt": "w " * 700_000}).encode()
    status, _, _ = request(stack.url, "POST", "/v1/completions", raw=big)
    assert status == 413
    # aiohttp drains the unread body after a 413 ("lingering"); a server stopped while it
    # does waits its 10 s lingering time, so let it finish before the fixture stops it
    assert wait_until(lambda: stack.num_connections() == 0)


def test_a_reward_that_never_pays_refuses_nothing_the_engines_can_take(
        tmp_path: Path) -> None:
    """A reward that never pays for serving: bid_price holds every request, and once its
    patience has run out (at once here) sends it to an engine with room instead of
    refusing it (a 429 is for load: test_abuse_load's no_room refusals)."""
    loaded = load_config(_config(tmp_path, reward={"sigma": 0.0, "beta": 0.0, "gamma": 0.0},
                                 admission={"mode": "shed", "patience_s": 0.0}))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        for _ in range(3):
            status, headers, _ = request(s.url, "POST", "/v1/completions",
                                         {"prompt": "a", "max_tokens": 2})
            assert status == 200 and "not refused" in headers["x-olproute-reason"]
        assert sum(f.requests for f in s.fakes) == 3
    finally:
        s.close()


def backend_errors(url: str) -> dict[tuple[str, str], float]:
    """The router's ``olproute_backend_errors_total`` by (instance, kind)."""
    out = {}
    for family in text_string_to_metric_families(request(url, "GET", "/metrics")[2].decode()):
        for s in family.samples:
            if s.name == "olproute_backend_errors_total":
                out[(s.labels["instance"], s.labels["kind"])] = s.value
    return out


def test_failed_backend_is_retried_once_then_avoided(stack: Stack) -> None:
    stack.fakes[0].mode = "fail500"
    for _ in range(6):
        status, headers, _ = request(stack.url, "POST", "/v1/completions",
                                     {"prompt": "a b", "max_tokens": 2})
        assert status == 200 and headers["x-olproute-instance"] != "q-0"
    # every request q-0 got failed and was counted against it (its /health still answers,
    # so a probe after the 0.5 s backoff may bring it back: /instances' failure count
    # is reset then, so it is no record on a slow machine)
    assert stack.fakes[0].requests >= 1
    assert backend_errors(stack.url) == {("q-0", "before_first_byte"): stack.fakes[0].requests}


def test_killed_backend_ends_the_stream_with_an_error_and_is_avoided(stack: Stack) -> None:
    for fake in stack.fakes:
        fake.mode, fake.cut_after, fake.delay_s = "cut", 2, 0.02
    status, headers, lines = stream(stack.url, "/v1/completions",
                                    {"prompt": "a", "max_tokens": 8, "stream": True})
    assert status == 200
    victim = int(headers["x-olproute-instance"].split("-")[1])
    assert b"error" in lines[-1] and b"backend stream ended early" in lines[-1]
    for fake in stack.fakes:
        fake.mode = "ok"
    stack.kill_backend(victim)
    assert wait_until(lambda: not json.loads(request(stack.url, "GET", "/instances")[2])
                      ["instances"][victim]["healthy"])
    for _ in range(6):
        status, headers, _ = request(stack.url, "POST", "/v1/completions",
                                     {"prompt": "a", "max_tokens": 2})
        assert status == 200 and headers["x-olproute-instance"] != f"q-{victim}"
    # nothing stays in flight: every request was recorded as finished
    st = stack.app
    from olproute.server.state import STATE

    assert stack.call(lambda: sum(len(b.flights) for b in st[STATE].tracker.backends)) == 0
    assert stack.call(lambda: [b.flights for b in st[STATE].tracker.backends]) == [{}, {}, {}]


def test_the_openai_client_raises_on_a_stream_its_backend_cut(stack: Stack) -> None:
    """A backend that dies after two tokens: the client's stream ends with an error event
    in the error shape and no [DONE] after it, on which the openai client raises."""
    import openai

    for fake in stack.fakes:
        fake.mode, fake.cut_after, fake.delay_s = "cut", 2, 0.02
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    got: list[str] = []
    with pytest.raises(openai.APIError) as cut:
        for chunk in client.chat.completions.create(
                model="qwen3-0.6b", messages=[{"role": "user", "content": "hi"}],
                max_tokens=8, stream=True):
            got.append(chunk.choices[0].delta.content or "")
    assert got == ["tok ", "tok "]
    assert "backend stream ended early" in cut.value.message
    assert isinstance(cut.value.body, dict) and cut.value.body["type"] == "backend_error"
    _, _, lines = stream(stack.url, "/v1/completions",
                         {"prompt": "a", "max_tokens": 8, "stream": True})
    event = json.loads(lines[-1].removeprefix(b"data: "))
    assert set(event["error"]) == {"message", "type", "param", "code"}
    assert b"data: [DONE]" not in lines


def test_a_stream_that_dies_before_its_first_token_is_retried(stack: Stack) -> None:
    """q-0 answers 200 and a chunk without a token, then drops the connection: nothing
    reached the client yet, so the request goes to another backend and the client
    gets the whole stream."""
    import openai

    from olproute.server.state import STATE

    for fake in stack.fakes:
        fake.preamble = True
    stack.fakes[0].mode, stack.fakes[0].cut_after = "cut", 0
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(6):
        chunks = list(client.chat.completions.create(
            model="qwen3-0.6b", messages=[{"role": "user", "content": "hi"}],
            max_tokens=4, stream=True))
        assert [c.choices[0].delta.content for c in chunks] == ["", *["tok "] * 4]
    assert stack.fakes[0].requests >= 1
    assert backend_errors(stack.url) == {("q-0", "before_first_token"):
                                         stack.fakes[0].requests}
    assert stack.call(lambda: [b.flights for b in stack.app[STATE].tracker.backends]) == [
        {}, {}, {}]


def test_a_stream_cut_midway_is_recorded_unfinished_with_its_first_token(
        stack: Stack) -> None:

    outcomes = record_outcomes(stack)
    for fake in stack.fakes:
        fake.mode, fake.cut_after, fake.delay_s = "cut", 2, 0.02
    status, _, lines = stream(stack.url, "/v1/completions",
                              {"prompt": "a", "max_tokens": 8, "stream": True})
    assert status == 200 and b"backend stream ended early" in lines[-1]
    assert wait_until(lambda: len(outcomes) == 1)  # recorded once the relay returned
    [o] = outcomes
    assert o.first_token_s is not None and o.decode_tokens == 2
    assert o.finish_s is None  # not finished: no end-to-end latency for it
    counts = {name: 0.0 for name in ("olproute_eel_seconds_count",
                                     "olproute_ttft_seconds_count")}
    for family in text_string_to_metric_families(
            request(stack.url, "GET", "/metrics")[2].decode()):
        for sample in family.samples:
            if sample.name in counts:
                counts[sample.name] += sample.value
    assert counts == {"olproute_eel_seconds_count": 0.0, "olproute_ttft_seconds_count": 1.0}


def test_reload_needs_the_token_and_keeps_serving_on_a_bad_file(tmp_path: Path) -> None:
    path = _config(tmp_path)
    loaded = load_config(path)
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        assert request(s.url, "POST", "/admin/reload")[0] == 401
        assert request(s.url, "POST", "/admin/reload",
                       headers={"Authorization": "Bearer wrong"})[0] == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        doc = yaml.safe_load(path.read_text())
        doc["instances"][0]["max_num_seqs"] = 0
        path.write_text(yaml.safe_dump(doc))
        status, _, raw = request(s.url, "POST", "/admin/reload", headers=auth)
        err = json.loads(raw)["error"]
        assert status == 400 and "instances[0].max_num_seqs: must be >= 1" in err["message"]
        assert request(s.url, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}
                       )[0] == 200
        doc["instances"][0]["max_num_seqs"] = 256
        doc["router"]["policy"] = "least_outstanding"
        path.write_text(yaml.safe_dump(doc))
        status, _, raw = request(s.url, "POST", "/admin/reload", headers=auth)
        assert status == 200 and json.loads(raw)["policy"] == "least_outstanding"
        status, headers, _ = request(s.url, "POST", "/v1/completions",
                                     {"prompt": "a", "max_tokens": 2})
        assert status == 200 and "outstanding" in headers["x-olproute-reason"]
    finally:
        s.close()


def test_admin_token_from_the_environment(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLPROUTE_ADMIN_TOKEN", "from-env")
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        assert request(s.url, "POST", "/admin/reload",
                       headers={"Authorization": f"Bearer {TOKEN}"})[0] == 401
        assert request(s.url, "POST", "/admin/reload",
                       headers={"Authorization": "Bearer from-env"})[0] == 200
    finally:
        s.close()
        assert os.environ.get("OLPROUTE_ADMIN_TOKEN") == "from-env"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=12)
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"prompt": json_values, "max_tokens": json_values,
                                        "stream": json_values, "messages": json_values,
                                        "prompt_tokens": json_values,
                                        "ttft_target_ms": json_values}
                          ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=64))


def test_fuzzed_bodies_never_get_a_500(tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(raw=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                             "/route"]))
    def check(raw: bytes, path: str) -> None:
        status, _, _ = request(s.url, "POST", path, raw=raw)
        assert status < 500, (path, raw)

    try:
        check()
    finally:
        s.close()


def test_embedded_default_emulates_backends_and_streams(tmp_path: Path) -> None:
    """No backends in the config: the router starts emulated vLLM instances in-process."""
    import openai

    loaded = load_config(_config(tmp_path, server={"emulator_time_scale": 0.2,
                                                   "health_period_s": 0.2,
                                                   "any_model": True}))
    s = Stack(loaded, num_fakes=0, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        # requests stop where the emulators' lengths say (the trace's draws, set by the
        # prompt), capped at max_tokens
        from olproute.server.state import STATE

        lengths = s.app[STATE].emulators[0].instance.lengths
        assert not lengths.exact
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model="any-alias", prompt="hello world",
                                                max_tokens=4, stream=True))
        n, reason = lengths.tokens("hello world", "qwen3-0.6b", 4)
        assert len(chunks) == n and all(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == reason
        chat = client.chat.completions.create(
            model="qwen3-0.6b", messages=[{"role": "user", "content": "hi there"}],
            max_tokens=300)
        n, reason = lengths.tokens("hi there", "qwen3-0.6b", 300)
        assert chat.usage is not None and chat.usage.completion_tokens == n
        assert chat.choices[0].finish_reason == reason == "stop"  # (43 tokens, seed 0)
        inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
        assert [i["model"] for i in inst] == ["qwen3-0.6b"] * 3
        assert all(i["url"].startswith("http://127.0.0.1:") for i in inst)
        assert wait_until(lambda: all(
            i["scraped"].get("vllm:num_requests_running") is not None
            for i in json.loads(request(s.url, "GET", "/instances")[2])["instances"]))
    finally:
        s.close()


def test_a_client_leaving_mid_stream_is_not_a_backend_failure(stack: Stack) -> None:
    for fake in stack.fakes:
        fake.delay_s = 0.05  # 200 tokens: a 10 s stream, cut by the client after its first
    u = urlparse(stack.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG_S)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": "a", "max_tokens": 200, "stream": True}).encode())
    resp = conn.getresponse()
    victim = int(resp.getheader("x-olproute-instance", "q--1").split("-")[1])
    assert resp.readline().startswith(b"data: {")
    conn.sock.shutdown(2)  # the client goes away with 199 tokens to come
    conn.close()
    from olproute.server.state import STATE

    st = stack.app
    # the relay noticed: it closed the backend's stream before its end, and the flight ended
    assert wait_until(lambda: stack.fakes[victim].client_gone == 1)
    assert wait_until(lambda: stack.call(
        lambda: sum(len(b.flights) for b in st[STATE].tracker.backends)) == 0)
    assert [f.client_gone for f in stack.fakes] == [int(i == victim) for i in range(3)]
    # and the backend is not blamed for it: no failure counted (/instances' health flags
    # come from the probes too, whose 1 s timeout a loaded machine can miss)
    assert backend_errors(stack.url) == {}
