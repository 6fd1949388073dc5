"""Disaggregated prefill/decode dispatch through the real router on 127.0.0.1: every
request is prefilled once (``max_tokens: 1``, its token discarded) on a prefill backend
and decoded once, all its tokens, on a decode backend, whose first token is the client's
first; the KV transfer parameters pass between them. Over emulated instances (the
transfer delay recorded by the decode emulators) and over scriptable fakes (the exact
bodies, and failures recorded as unfinished requests)."""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import ConfigError, LoadedConfig, load_config
from olproute.emulator.engine import BATCH_COLUMNS
from olproute.emulator.protocol import generated_text
from olproute.routing.disagg import KvTransfer
from olproute.server.proxy import PREFILL_KV_PARAMS
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from olproute.types import Outcome
from tests.conftest import HANG_S
from tests.integration.server_harness import Stack, record_outcomes, wait_until
from tests.integration.test_server import CAL, backend_errors, request, stream

TIME_SCALE = 0.2
TRANSFER = {"link_gbytes_per_s": 0.5, "latency_ms": 20.0}


def _pd_config(tmp_path: Path, policy: str, num_prefill: int = 2, num_decode: int = 2,
               **extra: Any) -> Path:
    from tests.conftest import PROFILES

    data: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [
            {"name": "p", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill",
             "replicas": num_prefill, "max_num_seqs": 64},
            {"name": "d", "model": "qwen2.5-3b", "gpu": "a40", "role": "decode",
             "replicas": num_decode, "max_num_seqs": 64, "kv_capacity_tokens": 20000}],
        "transfer": TRANSFER,
        "router": {"policy": policy, "slot_ms": 20},
        "server": {"emulator_time_scale": TIME_SCALE, "health_period_s": 0.2},
        "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                     "prompt_tokens": 10, "decode_tokens": 10},
    }
    data.update(extra)
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _stack(loaded: LoadedConfig, num_fakes: int) -> Stack:
    n = len(loaded.specs)
    return Stack(loaded, num_fakes=num_fakes,
                 calibration=CalibrationSource(loaded, known=[CAL] * n))


def _bookkeeping(s: Stack) -> list[tuple[int, int]]:
    """(flights, inbound) per backend, read on the router's loop."""
    return s.call(lambda: [(len(b.flights), len(b.inbound))
                           for b in s.app[STATE].tracker.backends])


def _samples(text: str, **labels: str) -> dict[str, float]:
    """Sample values by name, summed over the samples with ``labels`` (histogram buckets
    left out)."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels and all(sample.labels.get(k) == v
                                                 for k, v in labels.items()):
                out[sample.name] += sample.value
    return dict(out)


def _router_samples(s: Stack, **labels: str) -> dict[str, float]:
    return _samples(request(s.url, "GET", "/metrics")[2].decode(), **labels)


# -- over emulated instances -------------------------------------------------------------
# (prompt words, max_tokens, stream, chat)
REQUESTS = [(12, 5, True, False), (30, 3, False, False), (7, 1, True, False),
            (20, 4, True, True), (9, 6, False, True), (40, 2, True, False),
            (15, 1, False, False), (25, 7, True, True)]


def _prompt(words: int) -> str:
    return " ".join(f"w{i}" for i in range(words))


def _send(url: str, words: int, max_tokens: int, streamed: bool, chat: bool
          ) -> tuple[int, dict[str, str], str, str | None]:
    """One request; (status, headers, the generated text, its finish reason)."""
    prompt = _prompt(words)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if chat
                            else {"prompt": prompt})
    body.update(max_tokens=max_tokens, stream=streamed)
    if not streamed:
        status, headers, raw = request(url, "POST", path, body)
        choice = json.loads(raw)["choices"][0] if status == 200 else {}
        return status, headers, (choice["message"]["content"] if chat else
                                 choice.get("text", "")), choice.get("finish_reason")
    status, headers, lines = stream(url, path, body)
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
                   for c in chunks)
    return status, headers, text, chunks[-1]["choices"][0]["finish_reason"] if chunks else None


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding", "calibrated_cost",
                                    "bid_price"])
def test_every_request_is_prefilled_once_and_decoded_once(tmp_path: Path, policy: str) -> None:
    # three prompts stop early (their truth below max_tokens), one on its last token
    truth = tmp_path / "truth.csv"
    truth.write_text("prompt,model,output_tokens\n" + "".join(
        f"{_prompt(words)},qwen2.5-3b,{n}\n" for words, n in ((12, 2), (30, 3), (9, 4),
                                                                (25, 5))))
    loaded = load_config(_pd_config(tmp_path, policy, server={
        "emulator_time_scale": TIME_SCALE, "health_period_s": 0.2,
        "emulator_truth": "truth.csv"}))
    s = _stack(loaded, num_fakes=0)  # no backends: the instances are emulated in-process
    try:
        outcomes = record_outcomes(s)
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(lambda r: _send(s.url, *r), REQUESTS))
        prefill = {s_.name for s_ in loaded.specs if s_.role == "prefill"}
        decode = {s_.name for s_ in loaded.specs if s_.role == "decode"}
        emus = {e.name: e.instance for e in s.app[STATE].emulators}
        # where each request stops, computed offline as the decode instances do
        lengths = next(iter(emus.values())).lengths
        outputs = [lengths.tokens(_prompt(w), "qwen2.5-3b", m) for w, m, *_ in REQUESTS]
        assert [n for n, _ in outputs] == [2, 3, 1, 4, 4, 2, 1, 5]
        assert [r for _, r in outputs].count("stop") == 3
        for (n, reason), (status, headers, text, got) in zip(outputs, answers, strict=True):
            assert status == 200
            assert headers["x-olproute-instance"] in prefill
            assert headers["x-olproute-decode-instance"] in decode
            assert text == generated_text(n)  # all from the decode instance
            assert got == reason

        # the prefill instances ran each prompt once, for one token, for a remote decode
        assert sum(emus[n].num_remote_decode_prefills for n in prefill) == len(REQUESTS)
        assert sum(emus[n].num_remote_decode_prefills for n in decode) == 0
        urls = {i["name"]: i["url"] for i in
                json.loads(request(s.url, "GET", "/instances")[2])["instances"]}
        metrics = {n: _samples(request(urls[n], "GET", "/metrics")[2].decode()) for n in emus}
        assert sum(metrics[n]["vllm:generation_tokens_total"] for n in prefill) == len(REQUESTS)
        assert sum(metrics[n]["vllm:prompt_tokens_total"] for n in prefill) == sum(
            w for w, *_ in REQUESTS)
        # the decode instances generated every output token (one-token answers included),
        # and computed one prompt token per request (the last: the rest arrived computed);
        # like vLLM they count each request's whole prompt and its first token's TTFT
        assert sum(metrics[n]["vllm:generation_tokens_total"] for n in decode) == sum(
            n for n, _ in outputs)
        assert sum(metrics[n]["vllm:time_to_first_token_seconds_count"]
                   for n in decode) == len(REQUESTS)
        assert sum(metrics[n]["vllm:prompt_tokens_total"] for n in decode) == sum(
            w for w, *_ in REQUESTS)
        prefill_col = BATCH_COLUMNS.index("num_prefill_tokens")
        assert sum(row[prefill_col] for n in decode
                   for row in emus[n].batch_records()[1]) == len(REQUESTS)

        # each KV cache moved once, to a decode instance, taking the modelled time
        model = loaded.profiles.models["qwen2.5-3b"]
        transfer = KvTransfer.of(model, loaded.config.transfer)
        records = [r for n in decode for r in emus[n].kv_transfers]
        assert all(not emus[n].kv_transfers for n in prefill)
        assert sorted(r.prompt_tokens for r in records) == sorted(w for w, *_ in REQUESTS)
        for r in records:
            assert r.remote_engine_id in prefill
            assert r.delay_s == pytest.approx(transfer.seconds(r.prompt_tokens) * TIME_SCALE)
            assert r.delay_s >= TRANSFER["latency_ms"] / 1e3 * TIME_SCALE

        # the router's outcomes: the decode's tokens, its first token the request's first
        assert sorted(o.decode_tokens for o in outcomes) == sorted(n for n, _ in outputs)
        names = [s_.name for s_ in loaded.specs]
        for o in outcomes:
            assert o.instance is not None and names[o.instance] in prefill
            assert o.decode_instance is not None and names[o.decode_instance] in decode
            assert o.dispatch_s is not None and o.first_token_s is not None
            assert o.finish_s is not None
            assert o.dispatch_s <= o.first_token_s <= o.finish_s
        # TTFT and end-to-end latency sampled once per request, by decode instance
        for metric in ("olproute_ttft_seconds_count", "olproute_eel_seconds_count"):
            assert sum(_router_samples(s, instance=n).get(metric, 0) for n in decode) == len(
                REQUESTS)
            assert sum(_router_samples(s, instance=n).get(metric, 0) for n in prefill) == 0
        streamed = sum(1 for r in REQUESTS if r[2])
        assert _router_samples(s)["olproute_handoff_seconds_count"] == streamed
        inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
        assert sum(i["handoffs"] for i in inst) == streamed
        assert {i["name"]: i["role"] for i in inst} == {n: ("prefill" if n in prefill
                                                            else "decode") for n in emus}
        assert _bookkeeping(s) == [(0, 0)] * len(loaded.specs)
    finally:
        s.close()


# -- over fakes: what is sent where, and failures -----------------------------------------
@pytest.fixture
def fake_pd(tmp_path: Path) -> Iterator[Stack]:
    """One prefill fake (p) and one decode fake (d) behind a round-robin router."""
    s = _stack(load_config(_pd_config(tmp_path, "round_robin", 1, 1)), num_fakes=2)
    try:
        yield s
    finally:
        s.close()


def test_prefill_gets_one_token_and_decode_the_request_with_kv_params(fake_pd: Stack) -> None:
    prefill, decode = fake_pd.fakes
    outcomes = record_outcomes(fake_pd)
    status, headers, lines = stream(fake_pd.url, "/v1/completions",
                                    {"prompt": "a b c", "max_tokens": 4, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert status == 200
    assert headers["x-olproute-instance"] == "p"
    assert headers["x-olproute-decode-instance"] == "d"
    assert len([line for line in lines if line.startswith(b"data: {")]) == 4
    [pbody], [dbody] = prefill.bodies, decode.bodies
    assert pbody["max_tokens"] == 1 and pbody["stream"] is False
    assert "stream_options" not in pbody
    assert pbody["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert pbody["model"] == dbody["model"] == "qwen2.5-3b"
    # the fake's answer carries no kv_transfer_params: the decode is told where from
    assert dbody["kv_transfer_params"] == {"do_remote_prefill": True, "remote_engine_id": "p"}
    assert dbody["max_tokens"] == 4 and dbody["stream"] is True
    assert dbody["stream_options"] == {"include_usage": True}
    # the prefill's token is not the client's: the request's tokens are the decode's four,
    # its first token the decode's first (TTFT labelled by the decode backend)
    assert wait_until(lambda: len(outcomes) == 1)
    [o] = outcomes
    assert (o.instance, o.decode_instance, o.decode_tokens) == (0, 1, 4)
    assert o.first_token_s is not None and o.finish_s is not None
    assert _router_samples(fake_pd, instance="d")["olproute_ttft_seconds_count"] == 1
    assert "olproute_ttft_seconds_count" not in _router_samples(fake_pd, instance="p")

    # a prefill answer with kv_transfer_params (as vLLM's): passed on as they are
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
              "remote_block_ids": [3, 4], "remote_host": "10.0.0.1", "remote_port": 5600,
              "tp_size": 1}
    prefill.extra = {"kv_transfer_params": params}
    status, _, raw = request(fake_pd.url, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert prefill.bodies[-1]["max_completion_tokens"] == 1
    assert prefill.bodies[-1]["max_tokens"] == 1
    assert decode.bodies[-1]["kv_transfer_params"] == params
    assert decode.bodies[-1]["max_completion_tokens"] == 3
    assert _bookkeeping(fake_pd) == [(0, 0), (0, 0)]


def test_prefill_failure_is_a_502_naming_it_and_nothing_is_decoded(fake_pd: Stack) -> None:
    prefill, decode = fake_pd.fakes
    prefill.mode = "fail500"
    outcomes = record_outcomes(fake_pd)
    status, headers, raw = request(fake_pd.url, "POST", "/v1/completions",
                                   {"prompt": "a b", "max_tokens": 3})
    assert status == 502
    error = json.loads(raw)["error"]
    assert error["message"] == "prefill backend p failed: status 500"
    assert error["type"] == "backend_error"
    assert headers["x-olproute-instance"] == "p"
    assert prefill.requests == 1 and decode.requests == 0
    assert _bookkeeping(fake_pd) == [(0, 0), (0, 0)]
    [o] = outcomes
    assert o.first_token_s is None and o.finish_s is None and o.decode_tokens == 0
    # counted against the prefill backend only (not /instances' failure count, which a
    # health probe resets after the backoff on a slow machine)
    assert backend_errors(fake_pd.url) == {("p", "prefill"): 1}
    inst = json.loads(request(fake_pd.url, "GET", "/instances")[2])["instances"]
    assert inst[1]["in_flight"] == 0


def test_a_prefill_connection_closed_before_its_answer_is_sent_once_more(
        fake_pd: Stack) -> None:
    """A prefill sent on a connection its backend closes unanswered
    (a kept-alive one uvicorn closed) goes once more on a new one, and the pair completes."""
    prefill, decode = fake_pd.fakes
    prefill.mode = "drop_once"
    status, headers, raw = request(fake_pd.url, "POST", "/v1/completions",
                                   {"prompt": "a b", "max_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert headers["x-olproute-decode-instance"] == "d"
    assert prefill.requests == 2 and decode.requests == 1
    assert backend_errors(fake_pd.url) == {}


def _unfinished(s: Stack, outcomes: list[Outcome], tokens: int) -> Outcome:
    """The one outcome, recorded as not finished with ``tokens`` tokens (a first token
    only if the client got one); no end-to-end latency sampled; bookkeeping released."""
    assert wait_until(lambda: len(outcomes) == 1)
    [o] = outcomes
    assert o.finish_s is None and o.decode_tokens == tokens
    assert (o.first_token_s is not None) == (tokens > 0)
    assert (o.instance, o.decode_instance) == (0, 1)
    router = _router_samples(s)
    assert router.get("olproute_eel_seconds_count", 0) == 0
    assert router.get("olproute_ttft_seconds_count", 0) == (tokens > 0)
    assert _bookkeeping(s) == [(0, 0), (0, 0)]
    return o


@pytest.mark.parametrize("streamed", [True, False])
def test_decode_failure_is_a_502_naming_it_and_an_unfinished_request(
        fake_pd: Stack, streamed: bool) -> None:
    prefill, decode = fake_pd.fakes
    decode.mode = "fail500"
    outcomes = record_outcomes(fake_pd)
    status, _, raw = request(fake_pd.url, "POST", "/v1/completions",
                             {"prompt": "a b", "max_tokens": 3, "stream": streamed})
    assert status == 502
    assert json.loads(raw)["error"]["message"] == (
        "decode backend d failed after the prefill on p: status 500")
    assert prefill.requests == 1 and decode.requests == 1
    _unfinished(fake_pd, outcomes, 0)
    assert backend_errors(fake_pd.url) == {("d", "before_first_byte"): 1}


def test_unreachable_decode_is_a_502_and_an_unfinished_request(fake_pd: Stack) -> None:
    fake_pd.kill_backend(1)
    outcomes = record_outcomes(fake_pd)
    status, _, raw = request(fake_pd.url, "POST", "/v1/completions",
                             {"prompt": "a b", "max_tokens": 3, "stream": True})
    assert status == 502
    assert json.loads(raw)["error"]["message"].startswith(
        "decode backend d failed after the prefill on p: connect: ")
    _unfinished(fake_pd, outcomes, 0)


def test_decode_refusal_is_passed_on_and_an_unfinished_request(fake_pd: Stack) -> None:
    decode = fake_pd.fakes[1]
    decode.mode = "fail400"
    outcomes = record_outcomes(fake_pd)
    status, headers, raw = request(fake_pd.url, "POST", "/v1/completions",
                                   {"prompt": "a b", "max_tokens": 3, "stream": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    assert headers["x-olproute-decode-instance"] == "d"
    _unfinished(fake_pd, outcomes, 0)
    assert backend_errors(fake_pd.url) == {}  # the backend's own answer, not a failure


def test_decode_cut_midway_is_an_unfinished_request_with_its_first_token(
        fake_pd: Stack) -> None:
    decode = fake_pd.fakes[1]
    decode.mode, decode.cut_after = "cut", 2
    outcomes = record_outcomes(fake_pd)
    status, _, lines = stream(fake_pd.url, "/v1/completions",
                              {"prompt": "a b", "max_tokens": 6, "stream": True})
    assert status == 200 and b"backend stream ended early" in lines[-1]
    o = _unfinished(fake_pd, outcomes, 2)  # the client got two tokens, then the error
    assert o.first_token_s is not None
    assert _router_samples(fake_pd, instance="d")["olproute_ttft_seconds_count"] == 1
    assert backend_errors(fake_pd.url) == {("d", "mid_stream"): 1}


def test_route_on_pools_leaves_no_reservation_in_the_policy() -> None:
    loaded = load_config(Path(__file__).parents[2] / "configs" / "pd.yaml")
    s = _stack(loaded, num_fakes=0)  # the embedded emulators, idle: nothing is dispatched
    try:
        policy = s.app[STATE].router.policy
        assert hasattr(policy, "_inbound")
        actions: Counter[str] = Counter()
        for i in range(40):
            status, _, raw = request(s.url, "POST", "/route",
                                     {"prompt_tokens": 200 + 50 * i, "max_tokens": 100})
            assert status == 200
            answer = json.loads(raw)
            actions[answer["action"]] += 1
            if answer["action"] == "dispatch":
                assert answer["decode_instance"] is not None
        assert actions["dispatch"] > 0  # decisions that took capacity, then were forgotten
        assert s.call(lambda: dict(policy._inbound)) == {}
        assert _bookkeeping(s) == [(0, 0)] * len(loaded.specs)
    finally:
        s.close()


def test_backend_role_must_match_its_instance(tmp_path: Path) -> None:
    backends = [{"name": "p", "url": "http://127.0.0.1:1", "role": "prefill"},
                {"name": "d", "url": "http://127.0.0.1:2", "role": "prefill"}]
    path = _pd_config(tmp_path, "round_robin", 1, 1, server={"backends": backends})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [("server.backends[1].role",
                                    "'prefill', but instance 'd' has role 'decode' "
                                    "(instances[].role)")]
    assert str(path) in str(info.value)
    backends[1]["role"] = "decode"
    path = _pd_config(tmp_path, "round_robin", 1, 1, server={"backends": backends})
    assert [b.role for b in load_config(path).config.server.backends] == ["prefill", "decode"]


def test_a_client_leaving_the_decode_stream_is_not_a_backend_failure(
        fake_pd: Stack) -> None:
    decode = fake_pd.fakes[1]
    decode.delay_s = 0.05  # 200 tokens: a 10 s stream, cut by the client after its first
    outcomes = record_outcomes(fake_pd)
    u = urlparse(fake_pd.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG_S)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": "a b", "max_tokens": 200,
                                  "stream": True}).encode())
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    conn.sock.shutdown(2)  # the client goes away with 199 tokens to come
    conn.close()
    # the relay closed the decode backend's stream early; the request is unfinished,
    # with the first token the client got, and its bookkeeping is released
    assert wait_until(lambda: decode.client_gone == 1)
    assert wait_until(lambda: len(outcomes) == 1)
    [o] = outcomes
    assert o.finish_s is None and o.first_token_s is not None and o.decode_tokens < 200
    assert wait_until(lambda: _bookkeeping(fake_pd) == [(0, 0), (0, 0)])
    # not blamed: no failure counted (/instances' health flags come from the probes too,
    # whose 1 s timeout a loaded machine can miss)
    assert backend_errors(fake_pd.url) == {}


def test_an_answered_pair_ends_both_backends_failure_streaks(fake_pd: Stack) -> None:
    """A health probe that passes lets a failed backend take traffic again but keeps its
    failure streak (its next backoff grows); a request it answers ends the streak, on
    the prefill and on the decode side alike."""
    prefill, decode = fake_pd.fakes
    prefill.mode = decode.mode = "fail500"
    assert request(fake_pd.url, "POST", "/v1/completions",
                   {"prompt": "a b", "max_tokens": 3})[0] == 502

    def instances() -> list[dict[str, Any]]:
        return json.loads(request(fake_pd.url, "GET", "/instances")[2])["instances"]

    assert instances()[0]["failures"] == 1 and not instances()[0]["healthy"]
    prefill.mode = decode.mode = "ok"
    assert wait_until(lambda: all(i["healthy"] for i in instances()), timeout=HANG_S)
    assert instances()[0]["failures"] == 1   # the probe did not end the streak
    assert request(fake_pd.url, "POST", "/v1/completions",
                   {"prompt": "a b", "max_tokens": 3})[0] == 200
    assert [i["failures"] for i in instances()] == [0, 0]
