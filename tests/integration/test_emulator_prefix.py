"""The emulator's prefix cache over HTTP: an instance names a prompt text's blocks as the
router does (``olproute.routing.prefix_index.text_block_hashes``), so a repeated prompt finds its
prefix cached: its first token comes sooner, vLLM's counters on /metrics count the
cached tokens, and with ``--enable-prompt-tokens-details`` the usage reports them.

On a virtual-time event loop (``tests.virtual_time``): the emulator's batches pace
themselves with ``asyncio.sleep``, so times to first token are exact whatever the load."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.emulator import RunningEmulator, emulators
from olproute.types import InstanceSpec
from tests.virtual_time import run_virtual

BLOCK = 16
NUM_WORDS = 3000
PROMPT = " ".join(f"word{i}" for i in range(NUM_WORDS))
CACHED = (NUM_WORDS - 1) // BLOCK * BLOCK   # all full blocks but the last token's
LOADED = load_config()


def _spec(caching: bool = True) -> InstanceSpec:
    return InstanceSpec(name="emu-p", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                        max_num_seqs=4, max_num_batched_tokens=2048, block_size=BLOCK,
                        num_kv_blocks=1024, enable_prefix_caching=caching)


Case = Callable[[RunningEmulator, aiohttp.ClientSession], Awaitable[None]]


def _run(case: Case, caching: bool = True, details: bool = False) -> None:
    async def main() -> None:
        clock = asyncio.get_running_loop().time
        async with emulators([_spec(caching)], loaded=LOADED, seed=1, exact_lengths=True,
                             clock=clock, prompt_tokens_details=details) as running, \
                aiohttp.ClientSession() as http:
            await case(running[0], http)

    run_virtual(main)


async def _ttft(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                chat: bool = False) -> tuple[float, dict[str, Any]]:
    """(seconds to the first token on the loop's clock, the usage event) of a streamed
    request."""
    loop = asyncio.get_running_loop()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = loop.time()
    first: float | None = None
    usage: dict[str, Any] = {}
    async with http.post(url + path, json={**body, "stream": True, "max_tokens": 4,
                                           "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            if event["choices"] and first is None:
                first = loop.time() - t0
            if event.get("usage"):
                usage = event["usage"]
    assert first is not None
    return first, usage


async def _counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:prefix_cache") and s.name.endswith("_total")}


def test_a_repeated_prompt_hits_the_cache_and_its_first_token_comes_sooner() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        cold, usage_cold = await _ttft(http, emu.url, {"prompt": PROMPT})
        assert await _counters(http, emu.url) == {
            "vllm:prefix_cache_queries_total": NUM_WORDS, "vllm:prefix_cache_hits_total": 0}
        warm, usage_warm = await _ttft(http, emu.url, {"prompt": PROMPT})
        print(f"TTFT cold {cold * 1e3:.1f} ms, warm {warm * 1e3:.1f} ms (virtual clock)")
        assert warm < 0.5 * cold, (cold, warm)
        assert await _counters(http, emu.url) == {
            "vllm:prefix_cache_queries_total": 2 * NUM_WORDS,
            "vllm:prefix_cache_hits_total": CACHED}
        # vLLM reports cached tokens in the usage only with --enable-prompt-tokens-details
        assert "prompt_tokens_details" not in usage_cold
        assert "prompt_tokens_details" not in usage_warm

    _run(case)


def test_usage_reports_cached_tokens_when_asked_as_vllm_does() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        _, cold = await _ttft(http, emu.url, {"prompt": PROMPT})
        assert "prompt_tokens_details" not in cold   # none cached: vLLM leaves it out
        _, warm = await _ttft(http, emu.url, {"prompt": PROMPT})
        assert warm["prompt_tokens_details"] == {"cached_tokens": CACHED}
        assert warm["prompt_tokens"] == NUM_WORDS
        async with http.post(emu.url + "/v1/completions",
                             json={"prompt": PROMPT, "max_tokens": 2}) as r:
            whole = await r.json()
        assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}

    _run(case, details=True)


def test_a_chat_of_the_same_words_finds_a_completions_prefix() -> None:
    """The chat's text is its messages' words, as the router counts and hashes them: a
    chat whose messages hold a cached prompt's words (and more) finds them cached."""
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        await _ttft(http, emu.url, {"prompt": PROMPT})
        half = NUM_WORDS // 2
        words = PROMPT.split()
        messages = [{"role": "system", "content": " ".join(words[:half])},
                    {"role": "user", "content": [{"type": "text", "text": " ".join(words[half:])},
                                                 {"type": "text", "text": "and more words"}]}]
        _, usage = await _ttft(http, emu.url, {"messages": messages}, chat=True)
        assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}

    _run(case, details=True)


def test_without_prefix_caching_nothing_is_cached() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        cold, _ = await _ttft(http, emu.url, {"prompt": PROMPT})
        warm, usage = await _ttft(http, emu.url, {"prompt": PROMPT})
        assert warm == pytest.approx(cold, rel=0.2)
        assert "prompt_tokens_details" not in usage
        assert (await _counters(http, emu.url))["vllm:prefix_cache_hits_total"] == 0

    _run(case, caching=False, details=True)
