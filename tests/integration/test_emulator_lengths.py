"""Emulated requests stop like a model's, over HTTP: the finish reason, the text and the
usage of every answer (streamed or not, completion or chat) are what
``olproute.emulator.lengths`` computes offline; ``exact_lengths`` gives ``max_tokens``;
``stream_interval`` groups a stream's token events into fewer writes, the same text, and
the router's proxy still counts every token."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.emulator import EmulatedInstance, RunningEmulator, start_emulators
from olproute.emulator.protocol import generated_text
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from olproute.sim.timing import LinearTiming
from olproute.types import InstanceSpec
from tests.integration.server_harness import Stack, record_outcomes, wait_until
from tests.integration.test_server import CAL, _config, stream
from tests.virtual_time import run_virtual

MODEL = "llama-2-7b"
SPEC = InstanceSpec(name="emu-l", model=MODEL, gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=16, max_num_batched_tokens=2048, block_size=16,
                    num_kv_blocks=1024)
LOADED = load_config()
TIME_SCALE = 0.2
MAX_TOKENS = 9
# prompts whose truth the test hands the emulator (stops before, at and after the cap)
TRUTH = {"tell me a very short story": 3, "what is two plus two": 9, "count to twenty": 20}
PROMPTS = [*TRUTH, "a prompt of the trace", "another prompt of the trace",
           "one more of the trace, with a comma"]


def _truth_file(tmp_path: Path) -> Path:
    path = tmp_path / "truth.csv"
    rows = [f'"{p}",{MODEL},{n}' for p, n in TRUTH.items()]
    path.write_text("prompt,model,output_tokens\n" + "\n".join(rows) + "\n")
    return path


def _body(prompt: str, chat: bool, streamed: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if chat
                            else {"prompt": prompt})
    return {**body, "max_tokens": MAX_TOKENS, "stream": streamed, **extra}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _start(tmp_path: Path, **kwargs: Any) -> RunningEmulator:
    [emu] = await start_emulators([SPEC], loaded=LOADED, seed=1, time_scale=TIME_SCALE,
                                  truth_path=_truth_file(tmp_path), **kwargs)
    return emu


async def _events(resp: aiohttp.ClientResponse) -> tuple[list[Any], list[int]]:
    """(the parsed data of each SSE event, '[DONE]' as is; the token events of each HTTP
    chunk, i.e. of each write of the emulator)."""
    events: list[Any] = []
    per_write: list[int] = []
    buf = b""
    async for data, end_of_chunk in resp.content.iter_chunks():
        buf += data
        if not end_of_chunk:
            continue
        lines = [line[6:] for line in buf.split(b"\n") if line.startswith(b"data: ")]
        events += [line.decode() if line == b"[DONE]" else json.loads(line) for line in lines]
        tokens = sum(1 for line in lines if line.startswith(b'{"id"') and b'"choices":[]'
                     not in line)
        if tokens:
            per_write.append(tokens)
        buf = b""
    assert buf == b""
    return events, per_write


def _text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return str(choice["delta"]["content"] if "delta" in choice else choice["text"])


async def _ask(http: aiohttp.ClientSession, emu: RunningEmulator, body: dict[str, Any]
               ) -> tuple[str, str, int, list[int]]:
    """(text, finish reason, completion tokens, tokens per write) of one answer."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(emu.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        if not body["stream"]:
            out = await r.json()
            choice = out["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return text, choice["finish_reason"], out["usage"]["completion_tokens"], []
        events, per_write = await _events(r)
    assert events[-1] == "[DONE]"  # every stream ends with it
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(
        body.get("prompt", "").split() or body["messages"][0]["content"].split())
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1)
    assert usage["usage"]["completion_tokens"] == len(chunks)
    return "".join(map(_text, chunks)), reasons[-1], len(chunks), per_write


def _cases() -> list[tuple[str, bool, bool]]:
    return [(p, chat, streamed) for p in PROMPTS for chat in (False, True)
            for streamed in (False, True)]


@pytest.mark.anyio
async def test_answers_stop_where_the_lengths_function_says(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    emu = await _start(tmp_path)
    try:
        lengths = emu.instance.lengths
        reasons = set()
        for prompt, chat, streamed in _cases():
            body = _body(prompt, chat, streamed, stream_options={"include_usage": True}
                         ) if streamed else _body(prompt, chat, streamed)
            n, reason = lengths.tokens(prompt, MODEL, MAX_TOKENS)
            assert (n, reason) == lengths.tokens_of_body(body, MODEL, MAX_TOKENS)
            if prompt in TRUTH:  # the file's truth, capped
                assert n == min(TRUTH[prompt], MAX_TOKENS)
            text, got_reason, tokens, _ = await _ask(http, emu, body)
            assert (tokens, got_reason) == (n, reason), (prompt, chat, streamed)
            assert text == generated_text(n)
            reasons.add(reason)
        assert reasons == {"stop", "length"}
        # the engine ran the real lengths: its counters and a lone request's batches
        m = await _samples(http, emu.url)
        expected = [lengths.tokens(p, MODEL, MAX_TOKENS) for p, *_ in _cases()]
        assert m[("vllm:generation_tokens_total", None)] == sum(n for n, _ in expected)
        for reason in ("stop", "length"):
            assert m[("vllm:request_success_total", reason)] == sum(
                r == reason for _, r in expected)
        since = emu.instance.num_batches
        await _ask(http, emu, _body("tell me a very short story", False, False))
        async with http.get(emu.url + f"/olproute/batches?since={since}") as r:
            rows = (await r.json())["batches"]
        assert [b["num_tokens"] for b in rows] == [6, 1, 1]  # a 6-word prompt, 3 tokens
    finally:
        await emu.stop()


async def _samples(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str | None], float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {(s.name, s.labels.get("finished_reason")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if "le" not in s.labels}


@pytest.mark.anyio
async def test_exact_lengths_generate_max_tokens(tmp_path: Path,
                                                 http: aiohttp.ClientSession) -> None:
    emu = await _start(tmp_path, exact_lengths=True)
    try:
        assert emu.instance.lengths.exact
        for prompt, chat, streamed in _cases()[::3]:
            body = (_body(prompt, chat, streamed, stream_options={"include_usage": True})
                    if streamed else _body(prompt, chat, streamed))
            text, reason, tokens, _ = await _ask(http, emu, body)
            assert (text, reason, tokens) == (generated_text(MAX_TOKENS), "length", MAX_TOKENS)
    finally:
        await emu.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("interval", [1, 4, 50])
async def test_a_stream_interval_groups_token_events_into_writes(
        tmp_path: Path, http: aiohttp.ClientSession, interval: int) -> None:
    emu = await _start(tmp_path, stream_interval=interval)
    try:
        lengths = emu.instance.lengths
        for prompt in ("count to twenty", "a prompt of the trace"):
            for chat in (False, True):
                body = _body(prompt, chat, True, max_tokens=30,
                             stream_options={"include_usage": True})
                n, reason = lengths.tokens_of_body(body, MODEL, 30)
                text, got, tokens, per_write = await _ask(http, emu, body)
                assert (text, got, tokens) == (generated_text(n), reason, n)
                assert sum(per_write) == n
                # the first token at once; then a write per `interval` tokens, or more if
                # the stream fell behind (a loaded machine: so exact counts are checked on
                # a virtual clock below); the rest at the end: at most 1 + ceil((n-1)/N)
                assert all(k >= interval for k in per_write[1:-1])
                assert len(per_write) <= 1 + math.ceil((n - 1) / interval)
    finally:
        await emu.stop()


def test_a_stream_writes_at_the_interval_on_a_virtual_clock() -> None:
    """Exactly when each write is due, on an engine whose batches take 20 ms of a virtual
    clock (so the stream always keeps up): tokens 1, 1+N, 1+2N, ..., then the rest."""
    async def sends(output_tokens: int, interval: int) -> list[int]:
        timer = LinearTiming((0.02, 0.0, 0.0, 0.0), 0.0, np.random.default_rng(0))
        inst = EmulatedInstance(SPEC, timer, clock=asyncio.get_running_loop().time,
                                stream_interval=interval)
        await inst.start()
        try:
            req = inst.submit(30, 100, output_tokens)
            sent, out = 0, []
            while sent < req.output_tokens:
                sent = await req.wait_to_send(sent, inst.stream_interval)
                out.append(sent)
            assert req.finish_reason == ("length" if output_tokens == 100 else "stop")
            return out
        finally:
            await inst.close()

    async def main() -> None:
        assert await sends(10, 1) == list(range(1, 11))
        assert await sends(10, 4) == [1, 5, 9, 10]
        assert await sends(13, 4) == [1, 5, 9, 13]
        assert await sends(10, 50) == [1, 10]
        assert await sends(1, 4) == [1]
        assert await sends(100, 25) == [1, 26, 51, 76, 100]

    run_virtual(main)


@pytest.mark.parametrize(("interval", "exact"), [(1, False), (4, False), (4, True)])
def test_the_router_counts_every_token_of_grouped_events(tmp_path: Path, interval: int,
                                                         exact: bool) -> None:
    """Through the router's proxy to embedded emulators (the config's server keys): the
    client gets the emulator's answer, and the router's own count of each request's
    tokens (fed back to the policy) is the emulator's length."""
    _truth_file(tmp_path)  # beside the config, which names it relative to itself
    server = {"emulator_time_scale": TIME_SCALE, "health_period_s": 0.2,
              "emulator_stream_interval": interval, "emulator_truth": "truth.csv",
              "emulator_exact_lengths": exact}
    loaded = load_config(_config(tmp_path, server=server, instances=[
        {"name": "q", "model": MODEL, "gpu": "a100-80gb", "replicas": 2}]))
    s = Stack(loaded, num_fakes=0, calibration=CalibrationSource(loaded, known=[CAL] * 2))
    try:
        emus = s.app[STATE].emulators
        assert all(e.instance.stream_interval == interval for e in emus)
        lengths = emus[0].instance.lengths
        assert lengths.exact == exact and len(lengths.truth) == (0 if exact else len(TRUTH))
        outcomes = record_outcomes(s)
        expected = []
        for prompt in PROMPTS:
            for chat in (False, True):
                body = _body(prompt, chat, True, max_tokens=30)
                n, reason = lengths.tokens_of_body(body, MODEL, 30)
                expected.append(n)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                status, _, lines = stream(s.url, path, body)
                assert status == 200 and lines[-1] == b"data: [DONE]"
                chunks = [json.loads(line[6:]) for line in lines[:-1]]
                assert "".join(map(_text, chunks)) == generated_text(n)
                assert chunks[-1]["choices"][0]["finish_reason"] == reason
        assert any(n == 30 for n in expected)
        assert any(n < 30 for n in expected) != exact
        # (the router records a request once its relay has ended, maybe after [DONE])
        assert wait_until(lambda: len(outcomes) == len(expected))
        assert [o.decode_tokens for o in outcomes] == expected
        assert all(o.finish_s is not None for o in outcomes)
    finally:
        s.close()
