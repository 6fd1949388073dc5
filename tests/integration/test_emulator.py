"""The emulator as a client sees it: real aiohttp servers on 127.0.0.1 free ports, spoken to
over HTTP (aiohttp's client and the official ``openai`` client)."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute._core import BatchCore
from olproute.config.loader import load_config
from olproute.emulator import RunningEmulator, ground_truth_timers, start_emulators
from olproute.emulator import stop_emulators as stop_all
from olproute.sim.engine import BATCH_LOG_COLUMNS
from olproute.types import InstanceSpec
from tests.conftest import HANG_S

pytestmark = pytest.mark.anyio

TIME_SCALE = 0.5  # batches run at half the modelled time (~5.5 ms per decode step)
# two batch slots, so a third request waits; 8,192 KV tokens
SPEC = InstanceSpec(name="emu-a", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=2, max_num_batched_tokens=2048, block_size=16,
                    num_kv_blocks=512)
LOADED = load_config()


@pytest.fixture
async def emu() -> AsyncIterator[RunningEmulator]:
    """Exact lengths: these tests count on every request generating all its max_tokens
    (long streams that outlast the test, token and batch counts); where a request stops
    like a model is tested in test_emulator_lengths.py and unit/test_output_lengths.py."""
    running = await start_emulators([SPEC], loaded=LOADED, seed=1, time_scale=TIME_SCALE,
                                    exact_lengths=True)
    try:
        yield running[0]
    finally:
        await stop_all(running)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _sse(resp: aiohttp.ClientResponse, t0: float) -> list[tuple[float, Any]]:
    """(arrival time since t0, parsed data) of each server-sent event; '[DONE]' as is."""
    events = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            data = text[6:]
            events.append((time.monotonic() - t0, data if data == "[DONE]" else json.loads(data)))
    return events


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of /metrics by name plus labels other than model_name."""
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                             if k not in ("model_name", "le"))
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def _prefill_estimate_s(prompt_tokens: int) -> float:
    """Noise-free time to first token of a lone request, by the ground-truth timer."""
    timer = ground_truth_timers([SPEC], LOADED.profiles, LOADED.config.sim, seed=1)[0]
    core = BatchCore(SPEC.num_kv_blocks, SPEC.block_size, SPEC.max_num_seqs,
                     SPEC.max_num_batched_tokens)
    core.add_request(prompt_tokens, 4)
    total = 0.0
    while not core.event_list():
        _, sums = core.schedule()
        total += timer.mean_time_s(sums)  # type: ignore[attr-defined]
        core.commit()
    return total * TIME_SCALE


async def _batches(http: aiohttp.ClientSession, url: str, since: int = 0
                   ) -> list[dict[str, float]]:
    async with http.get(url + f"/olproute/batches?since={since}") as r:
        assert r.status == 200
        return (await r.json())["batches"]  # type: ignore[no-any-return]


async def test_streaming_completion_arrives_chunk_by_chunk(
        emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
    body = {"model": "llama-2-7b", "prompt": "ignored words", "prompt_tokens": 3000,
            "max_tokens": 6, "stream": True}
    t0 = time.monotonic()
    async with http.post(emu.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["x-olproute-instance"] == "emu-a"
        events = await _sse(r, t0)
    *chunks, (_, done) = events
    assert done == "[DONE]"
    assert len(chunks) == 6
    # 3000 prompt tokens = two prefill chunks (2048 + 952) of the roofline timer, then one
    # decode step per further token; the first two batches are timed as the model says
    rows = await _batches(http, emu.url)
    assert [b["num_prefill_tokens"] for b in rows] == [2048, 952] + [0] * 5
    prefill_s = rows[0]["duration_s"] + rows[1]["duration_s"]
    expected = _prefill_estimate_s(3000)
    assert 0.5 * expected < prefill_s < 1.5 * expected, (prefill_s, expected)
    # and the engine kept that time: the first chunk came no earlier than those batches
    # (a lower bound, which load cannot break)
    assert chunks[0][0] >= prefill_s
    texts = [c["choices"][0]["text"] for _, c in chunks]
    assert "".join(texts) == " lorem ipsum dolor sit amet consectetur"
    assert [c["choices"][0]["finish_reason"] for _, c in chunks] == [None] * 5 + ["length"]
    first = chunks[0][1]
    assert first["object"] == "text_completion" and first["model"] == "llama-2-7b"
    assert first["id"].startswith("cmpl-") and isinstance(first["created"], int)
    assert "usage" not in first  # only with stream_options.include_usage


async def test_a_stream_sends_each_token_before_the_request_ends(
        emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
    """Not buffered to the end: with the first token in the client's hands, the request
    (2,000 tokens, ~11 s) is still running in the engine."""
    body = {"prompt": "a b", "max_tokens": 2000, "stream": True}
    async with http.post(emu.url + "/v1/completions", json=body) as r:
        line = await r.content.readline()
        assert line.startswith(b"data: {")
        assert json.loads(line[6:])["choices"][0]["text"] == " lorem"
        assert emu.instance.num_running == 1
        r.close()


async def test_non_streaming_completion_and_usage(emu: RunningEmulator,
                                                  http: aiohttp.ClientSession) -> None:
    async with http.post(emu.url + "/v1/completions",
                         json={"prompt": "one two three four", "max_tokens": 5}) as r:
        assert r.status == 200
        out = await r.json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == " lorem ipsum dolor sit amet"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    async with http.post(emu.url + "/v1/completions",
                         json={"prompt": [11, 12, 13], "max_tokens": 2}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == 3  # token ids count as given


async def test_chat_completions_stream_and_not(emu: RunningEmulator,
                                               http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    async with http.post(emu.url + "/v1/chat/completions",
                         json={"messages": messages, "max_tokens": 3}) as r:
        out = await r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant",
                                            "content": " lorem ipsum dolor"}
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    body = {"messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(emu.url + "/v1/chat/completions", json=body) as r:
        events = await _sse(r, time.monotonic())
    *chunks, (_, usage), (_, done) = events
    assert done == "[DONE]" and len(chunks) == 4
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None
               for _, c in chunks)
    assert chunks[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": " lorem"}
    assert chunks[3][1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


async def _wait_metrics(http: aiohttp.ClientSession, url: str,
                        cond: Callable[[dict[str, float]], bool],
                        timeout_s: float = HANG_S) -> dict[str, float]:
    """Scrape /metrics until ``cond`` holds; the timeout only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await _metrics(http, url)
        if cond(m):
            return m
        assert time.monotonic() < deadline, m
        await asyncio.sleep(0.01)


def _load(m: dict[str, float]) -> tuple[float, float]:
    return m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]


async def test_metrics_parse_and_gauges_move(emu: RunningEmulator,
                                             http: aiohttp.ClientSession) -> None:
    before = await _metrics(http, emu.url)
    assert _load(before) == (0, 0)
    # three streams of 4,000 tokens (~22 s each if left to run): each state below lasts
    # until the test ends it, so no scrape can miss it
    body = {"prompt": "a b c", "max_tokens": 4000, "stream": True}
    streams = [await http.post(emu.url + "/v1/completions", json=body) for _ in range(3)]
    try:
        # two batch slots: two run, the third waits its turn
        m = await _wait_metrics(http, emu.url, lambda m: _load(m) == (2, 1))
        assert 0 < m["vllm:kv_cache_usage_perc"] <= 1
        for r in streams[:2]:
            assert (await r.content.readline()).startswith(b"data: {")
            r.close()
        # their clients left: the third one runs alone
        m = await _wait_metrics(http, emu.url, lambda m: _load(m) == (1, 0))
        assert 0 < m["vllm:kv_cache_usage_perc"] <= 1
        assert (await streams[2].content.readline()).startswith(b"data: {")
    finally:
        for r in streams:
            r.close()
    m = await _wait_metrics(http, emu.url, lambda m: _load(m) == (0, 0))
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] == 3
    assert m["vllm:time_to_first_token_seconds_count"] == 3

    # counters of three requests run to their end, side by side
    async def one() -> None:
        body = {"prompt": "a b c", "max_tokens": 40, "stream": True}
        async with http.post(emu.url + "/v1/completions", json=body) as r:
            await r.read()

    await asyncio.gather(*(one() for _ in range(3)))
    after = await _metrics(http, emu.url)
    assert _load(after) == (0, 0) and after["vllm:kv_cache_usage_perc"] == 0

    def delta(name: str) -> float:
        return after[name] - m.get(name, 0.0)

    assert delta("vllm:generation_tokens_total") == 120
    assert delta("vllm:prompt_tokens_total") == 9
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert after["vllm:e2e_request_latency_seconds_count"] == 3  # the aborted ones: none
    assert after["vllm:request_success_total{finished_reason=length}"] == 3


async def test_concurrent_requests_share_batches(emu: RunningEmulator,
                                                 http: aiohttp.ClientSession) -> None:
    """Counted in the engine's batch records, not timed: a request alone takes one
    batch per token; beside a running request it takes as many batches, each shared."""
    async def one() -> None:
        async with http.post(emu.url + "/v1/completions",
                             json={"prompt": "x y", "max_tokens": 30}) as r:
            assert r.status == 200
            await r.read()

    await one()
    alone = await _batches(http, emu.url)
    assert len(alone) == 30 and all(b["num_seqs"] == 1 for b in alone)
    # a long stream (~11 s if left to run) is running while the second request comes
    body = {"prompt": "a b", "max_tokens": 2000, "stream": True}
    async with http.post(emu.url + "/v1/completions", json=body) as r:
        assert (await r.content.readline()).startswith(b"data: {")
        await one()
        r.close()
    beside = await _batches(http, emu.url, since=len(alone))
    assert sum(b["num_seqs"] == 2 for b in beside) == len(alone)
    assert max(b["num_seqs"] for b in beside) == 2


BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_tokens": -3}, 400, "prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_tokens": 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "prompt_tokens": 4000, "max_tokens": 200},
     400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"prompt": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
]


async def test_bad_inputs_name_the_field(emu: RunningEmulator,
                                         http: aiohttp.ClientSession) -> None:
    for path, body, status, param in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(emu.url + path, data=data,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == status, (body, await r.text())
            err = (await r.json())["error"]
        assert err["param"] == param, (body, err)
        assert err["type"] in ("invalid_request_error", "NotFoundError") and err["message"]
    async with http.post(emu.url + "/v1/completions", data=io.BytesIO(b"x" * (2 << 20))) as r:
        assert r.status == 413
        assert "too large" in (await r.json())["error"]["message"]
    async with http.get(emu.url + "/olproute/batches?since=-1") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "since"
    # none of it left anything resident
    m = await _metrics(http, emu.url)
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0


async def _wait_idle(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return await _wait_metrics(http, url, lambda m: _load(m) == (0, 0))


async def test_client_disconnect_aborts_the_request(emu: RunningEmulator,
                                                    http: aiohttp.ClientSession) -> None:
    body = {"prompt": "a b", "max_tokens": 2000, "stream": True}  # ~11 s if it ran on
    async with http.post(emu.url + "/v1/completions", json=body) as r:
        for _ in range(4):  # two events' worth of lines
            await r.content.readline()
        r.close()
    m = await _wait_idle(http, emu.url)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1
    assert m["vllm:kv_cache_usage_perc"] == 0
    # a non-streaming request whose client times out is aborted too
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(emu.url + "/v1/completions",
                             json={"prompt": "a", "max_tokens": 2000},
                             timeout=aiohttp.ClientTimeout(total=0.1)) as r:
            await r.read()
    m = await _wait_idle(http, emu.url)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 2
    assert m["vllm:generation_tokens_total"] < 2000  # neither ran on to its end
    async with http.post(emu.url + "/v1/completions",
                         json={"prompt": "a", "max_tokens": 2}) as r:
        assert r.status == 200  # the engine goes on serving


async def test_stopping_an_emulator_cuts_its_streams(http: aiohttp.ClientSession) -> None:
    running = await start_emulators([SPEC], loaded=LOADED, time_scale=TIME_SCALE,
                                    exact_lengths=True)
    try:
        body = {"prompt": "a", "max_tokens": 2000, "stream": True}
        async with http.post(running[0].url + "/v1/completions", json=body) as r:
            await r.content.readline()
            await running[0].stop()
            # cut, not run on to its end (2,000 tokens, ~11 s) and then closed
            assert running[0].instance.num_batches < 2000
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    finally:
        await stop_all(running)
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(running[0].url + "/health")


async def test_models_health_and_batch_records(emu: RunningEmulator,
                                               http: aiohttp.ClientSession) -> None:
    async with http.get(emu.url + "/health") as r:
        assert r.status == 200
    async with http.get(emu.url + "/v1/models") as r:
        cards = (await r.json())["data"]
    assert [c["id"] for c in cards] == ["llama-2-7b"] and cards[0]["max_model_len"] == 4096
    async with http.post(emu.url + "/v1/completions",
                         json={"prompt": "w " * 2500, "max_tokens": 5}) as r:
        assert r.status == 200
    async with http.get(emu.url + "/olproute/batches?since=0") as r:
        log = await r.json()
    rows = log["batches"]
    assert log["first"] == 0 and all(list(b) == list(BATCH_LOG_COLUMNS) for b in rows)
    assert log["next"] == len(rows) == 6  # two prefill chunks, then four decode steps
    assert sum(b["num_tokens"] for b in rows) == 2500 + 5 - 1
    assert [b["num_prefill_tokens"] for b in rows[:2]] == [2048, 452]
    assert all(b["duration_s"] > 0 for b in rows)
    for a, b in itertools.pairwise(rows):  # back to back while busy
        assert b["start_s"] == pytest.approx(a["start_s"] + a["duration_s"])
    async with http.get(emu.url + f"/olproute/batches?since={log['next']}") as r:
        assert (await r.json())["batches"] == []


async def test_official_openai_client(emu: RunningEmulator) -> None:
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.completions.create(model="llama-2-7b", prompt="hello world",
                                                 max_tokens=5, stream=True)
        texts = [chunk.choices[0].text async for chunk in stream]
        assert texts == [" lorem", " ipsum", " dolor", " sit", " amet"]
        chat = await client.chat.completions.create(
            model="llama-2-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content == " lorem ipsum dolor"
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        models = await client.models.list()
        assert [m.id for m in models.data] == ["llama-2-7b"]
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.completions.create(model="llama-2-7b", prompt="x", max_tokens=0)
    finally:
        await client.close()


async def test_emulate_command_serves_until_interrupted(http: aiohttp.ClientSession) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "olproute.cli", "emulate", "--instances", "2",
         "--time-scale", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        urls = []
        for _ in range(3):  # a hang is caught: the process is killed, the read ends
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), HANG_S)
            urls += [w for w in line.split() if w.startswith("http://")]
        assert len(urls) == 2, urls
        for url in urls:
            async with http.post(url + "/v1/completions",
                                 json={"prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
