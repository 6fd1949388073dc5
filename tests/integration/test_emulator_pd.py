"""Emulated instances with roles, spoken to over HTTP as the router's disaggregated
dispatch does: a prefill instance answers ``do_remote_decode`` with the KV transfer
parameters, a decode instance takes ``do_remote_prefill`` after the modelled transfer
delay and decodes with all but the last prompt token computed, generating every output
token itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.emulator import RunningEmulator, start_emulators, stop_emulators
from olproute.emulator.lengths import OutputLengths, prompt_key
from olproute.emulator.protocol import generated_text
from olproute.routing.disagg import KvTransfer
from olproute.types import InstanceSpec

pytestmark = pytest.mark.anyio

TIME_SCALE = 0.5
BASE = InstanceSpec(name="x", model="qwen2.5-3b", gpu="a40", tensor_parallel=1,
                    max_num_seqs=8, max_num_batched_tokens=2048, block_size=16,
                    num_kv_blocks=1024)
LOADED = load_config()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RunningEmulator, RunningEmulator]]:
    """Exact lengths: the first test counts the decode's batches token by token."""
    specs = [replace(BASE, name="pre", role="prefill"), replace(BASE, name="dec", role="decode")]
    running = await start_emulators(specs, loaded=LOADED, seed=3, time_scale=TIME_SCALE,
                                    exact_lengths=True)
    try:
        yield running[0], running[1]
    finally:
        await stop_emulators(running)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[int, Any]:
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def _stream_text(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    text = []
    async with http.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


async def test_prefill_answers_with_kv_params_and_decode_waits_the_transfer(
        pair: tuple[RunningEmulator, RunningEmulator], http: aiohttp.ClientSession) -> None:
    pre, dec = pair
    prompt = " ".join(["w"] * 40)  # 40 tokens: 3 blocks of 16
    status, answer = await _post(http, pre.url, {
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "pre" and params["remote_block_ids"] == [0, 1, 2]
    assert params["remote_host"] == "127.0.0.1" and params["tp_size"] == 1
    assert pre.instance.num_remote_decode_prefills == 1

    text = await _stream_text(http, dec.url, {"prompt": prompt, "max_tokens": 6,
                                              "kv_transfer_params": params})
    assert text == generated_text(6)  # six new tokens, the first one included
    status, whole = await _post(http, dec.url, {"prompt": prompt, "max_tokens": 1,
                                                "kv_transfer_params": params})
    assert status == 200 and whole["choices"][0]["text"] == generated_text(1)
    assert whole["usage"] == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
    transfer = KvTransfer.of(LOADED.profiles.models["qwen2.5-3b"], LOADED.config.transfer)
    expected = transfer.seconds(40) * TIME_SCALE
    assert [(r.prompt_tokens, r.remote_engine_id) for r in dec.instance.kv_transfers] == [
        (40, "pre"), (40, "pre")]
    assert all(r.delay_s == pytest.approx(expected) for r in dec.instance.kv_transfers)
    # the decode engine ran one one-token step per output token (6, then 1 for the
    # one-token answer, which is decoded too); each request's first step recomputes its
    # last prompt token (a one-token prefill chunk over the 39 computed) and samples
    # its first output
    _, rows = dec.instance.batch_records()
    assert [row[4] for row in rows] == [1.0] * 7                            # num_tokens
    assert [row[7] for row in rows] == [1.0, 0, 0, 0, 0, 0, 1.0]           # prefill tokens

    # vLLM's metrics: the decode's first token is a normal first token (its TTFT counted
    # from its arrival, before the transfer), its whole prompt counted, all its outputs
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(
                   (await (await http.get(dec.url + "/metrics")).read()).decode())
               for s in f.samples if "le" not in s.labels}
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == 2
    assert samples[("vllm:prompt_tokens_total", None)] == 80
    assert samples[("vllm:generation_tokens_total", None)] == 7
    assert samples[("vllm:request_success_total", "length")] == 2


async def test_roles_refuse_the_other_side(pair: tuple[RunningEmulator, RunningEmulator],
                                           http: aiohttp.ClientSession) -> None:
    pre, dec = pair
    cases = [
        (pre.url, {"kv_transfer_params": {"do_remote_prefill": True}},
         "kv_transfer_params.do_remote_prefill"),
        (dec.url, {"kv_transfer_params": {"do_remote_decode": True}},
         "kv_transfer_params.do_remote_decode"),
        (pre.url, {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream"),
        (dec.url, {"kv_transfer_params": "yes"}, "kv_transfer_params"),
        (dec.url, {"kv_transfer_params": {"do_remote_prefill": 1}},
         "kv_transfer_params.do_remote_prefill"),
    ]
    for url, extra, param in cases:
        status, answer = await _post(http, url, {"prompt": "a b", "max_tokens": 2, **extra})
        assert status == 400 and answer["error"]["param"] == param, (extra, answer)
    assert not dec.instance.kv_transfers and pre.instance.num_remote_decode_prefills == 0


async def test_the_decode_instance_stops_where_the_prompt_says(
        http: aiohttp.ClientSession) -> None:
    """Lengths set by the prompt: the prefill instance runs its one token (a ``length``
    finish, as vLLM's connector needs), the decode instance, given the same prompt, stops
    at the prompt's length; its engine, counters and batch records run that length."""
    prompt = " ".join(["v"] * 20)
    lengths = OutputLengths.from_trace(seed=3, truth={prompt_key(prompt): {BASE.model: 4}})
    specs = [replace(BASE, name="pre", role="prefill"), replace(BASE, name="dec", role="decode")]
    pre, dec = await start_emulators(specs, loaded=LOADED, time_scale=TIME_SCALE,
                                     lengths=lengths)
    try:
        status, answer = await _post(http, pre.url, {
            "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        body = {"prompt": prompt, "max_tokens": 10,
                "kv_transfer_params": answer["kv_transfer_params"]}
        status, whole = await _post(http, dec.url, body)
        assert whole["choices"][0]["finish_reason"] == "stop"
        assert whole["usage"]["completion_tokens"] == 4
        assert await _stream_text(http, dec.url, body) == generated_text(4)
        _, rows = dec.instance.batch_records()
        assert [row[4] for row in rows] == [1.0] * 8  # two requests of 4 one-token steps
        samples = {(s.name, s.labels.get("finished_reason")): s.value
                   for f in text_string_to_metric_families(
                       (await (await http.get(dec.url + "/metrics")).read()).decode())
                   for s in f.samples if "le" not in s.labels}
        assert samples[("vllm:generation_tokens_total", None)] == 8
        assert samples[("vllm:request_success_total", "stop")] == 2
        assert samples[("vllm:request_success_total", "length")] == 0
    finally:
        await stop_emulators([pre, dec])
