"""The emulator's KV events (``olproute.emulator.kv_publisher``): an instance started with
them publishes its prefix cache's events as vLLM does, and what a subscriber adds up from
the stream is what the engine's cache holds.

- the frames decode (``olproute.routing.kv_events.decode_message``), numbered 0, 1, 2,
  ...; each ``BlockStored`` carries vLLM's digests of its token ids (sha256, vLLM's
  seed) chained from its parent; after seeded shared-prefix requests on a small KV cache
  (evictions asserted) the stored minus removed keys are the cache's contents;
- the replay socket answers as vLLM's does (from a sequence number, byte-identical to the
  PUB frames, then the end marker), and a ``KvSubscriber`` that missed batches fills
  the gap from it;
- the embedded default with ``server.emulator_kv_events``: the router's exact index of
  each emulated backend equals its engine's cache, a repeated prompt is routed to the
  backend that holds it, and the router names a prompt's blocks as the emulator does;
- without events: no socket beyond HTTP, the approximate names, an approximate index.

Real time (ZMQ's sockets are not on the virtual clock), batches scaled down; waits are
bounded only against hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.emulator import RunningEmulator, emulators
from olproute.emulator.kv_blocks import NamedBlocks
from olproute.routing.block_hash import BlockHasher, WordTokenizer
from olproute.routing.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_key,
    decode_message,
    replay_request,
    seq_of,
)
from olproute.routing.prefix_index import PrefixIndex, prompt_block_hashes
from olproute.server.kv_subscriber import KvSubscriber
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from olproute.types import InstanceSpec
from tests.conftest import HANG_S
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config, request

BLOCK = 16
LOADED = load_config()
SPEC = InstanceSpec(name="emu-kv", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=4, max_num_batched_tokens=512, block_size=BLOCK,
                    num_kv_blocks=64)


def _prompts(seed: int, n: int) -> list[str]:
    """Seeded prompts on three shared prefixes (3 or 6 blocks), each with its own tail."""
    rng = random.Random(seed)
    prefixes = [" ".join(f"p{k}w{j}" for j in range(rng.choice((48, 96)))) for k in range(3)]
    return [rng.choice(prefixes) + " " + " ".join(f"r{i}w{j}" for j in
                                                  range(rng.randint(5, 120)))
            for i in range(n)]


def _run(case: Callable[[RunningEmulator, aiohttp.ClientSession], Awaitable[None]],
         kv: int | None = 0) -> None:
    async def main() -> None:
        async with emulators([SPEC], loaded=LOADED, seed=1, exact_lengths=True,
                             time_scale=0.02, kv_events_base_port=kv) as running, \
                aiohttp.ClientSession() as http:
            await asyncio.wait_for(case(running[0], http), HANG_S)

    asyncio.run(main())


async def _complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    chat: bool = False) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(url + path, json={"max_tokens": 4, **body}) as r:
        assert r.status == 200, await r.text()


async def _load(emu: RunningEmulator, http: aiohttp.ClientSession, seed: int) -> None:
    """Seeded prompts at once, with one of token ids and one chat among them."""
    prompts = _prompts(seed, 40)
    ids = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, 70)]
    await asyncio.gather(
        *(_complete(http, emu.url, {"prompt": p}) for p in prompts),
        _complete(http, emu.url, {"prompt": ids}),
        _complete(http, emu.url, {"messages": [{"role": "user", "content": prompts[0]}]},
                  chat=True))


async def _join(emu: RunningEmulator, http: aiohttp.ClientSession,
                sub: zmq.asyncio.Socket) -> list[bytes]:
    """PUB drops what it sends before a subscription holds: one-block requests until a
    message lands; that message."""
    for i in range(10_000):
        await _complete(http, emu.url, {"prompt": " ".join(f"j{i}w{j}" for j in range(BLOCK))})
        if await sub.poll(50):
            frames: list[bytes] = await sub.recv_multipart()
            return frames
    raise AssertionError("no KV event reached the subscriber")


async def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """The replay socket's answer from ``start``, up to and without its end marker."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[list[bytes]] = []
    try:
        await sock.send_multipart(replay_request(start))
        while True:
            frames = await sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if seq_of(frames[2]) == END_SEQ:
                assert frames[1:] == [b"", END_SEQ.to_bytes(8, "big", signed=True), b""]
                return out
            out.append(frames[1:])
    finally:
        sock.close(linger=0)


def _check_names(batch: EventBatch, hasher: BlockHasher) -> None:
    """Each BlockStored's digests are vLLM's of its token ids, chained from its parent."""
    for e in batch.events:
        if not isinstance(e, BlockStored):
            continue
        assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            assert isinstance(h, bytes) and len(h) == 32
            assert isinstance(parent, bytes | None)
            assert hasher.block(parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK]) == h
            parent = h


def _tally(batches: list[EventBatch]) -> tuple[dict[int, int], int]:
    """(key -> stored minus removed copies, blocks removed) over the batches in order."""
    held: Counter[int] = Counter()
    removed = 0
    for b in batches:
        for e in b.events:
            if isinstance(e, BlockStored):
                held.update(block_key(h) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed += len(e.block_hashes)
                held.subtract(block_key(h) for h in e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                held.clear()
    return {k: n for k, n in held.items() if n}, removed


def test_the_stream_adds_up_to_the_engines_cache() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        pub = emu.kv_events
        assert pub is not None and pub.endpoint is not None
        assert pub.replay_endpoint is not None
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(pub.endpoint)
        try:
            frames = [await _join(emu, http, sub)]
            await _load(emu, http, seed=7)
            last = pub.next_seq - 1   # every request answered: its batches published
            while seq_of(frames[-1][1]) < last:
                frames.append(await sub.recv_multipart())
        finally:
            sub.close(linger=0)
        decoded = [decode_message(f) for f in frames]
        first = decoded[0][1]
        assert [seq for _, seq, _ in decoded] == list(range(first, last + 1))
        history = await _replay(pub.replay_endpoint, 0)
        assert [seq_of(f[1]) for f in history] == list(range(last + 1))
        assert history[first:] == frames   # replay is byte-identical to PUB
        batches = [decode_message(f)[2] for f in history]
        hasher = BlockHasher("sha256")
        for topic, _, batch in decoded:
            assert topic == b"" and batch.data_parallel_rank == 0
            _check_names(batch, hasher)
        held, removed = _tally(batches)
        assert removed > 0, "the load was to evict blocks"
        assert held == dict(emu.instance.cache_contents()) and held
        feed = emu.instance.kv_feed
        assert feed is not None
        assert feed.book.copies() == held and feed.book.num_unnamed == 0
        assert pub.num_dropped == 0

    _run(case)


def test_a_subscriber_that_missed_batches_gets_them_replayed() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        pub = emu.kv_events
        assert pub is not None and pub.endpoint is not None
        assert pub.replay_endpoint is not None
        await _load(emu, http, seed=11)
        last = pub.next_seq - 1
        assert last >= 4
        # vLLM's replay: every batch it holds from a sequence number on
        tail = await _replay(pub.replay_endpoint, 3)
        assert [seq_of(f[1]) for f in tail] == list(range(3, last + 1))
        history = await _replay(pub.replay_endpoint, 0)
        index = PrefixIndex([SPEC])
        sub = KvSubscriber(SPEC.name, 0, index, pub.endpoint, pub.replay_endpoint,
                           hasher=BlockHasher("sha256"))
        await sub.on_message([b"", *history[0][1:]])
        await sub.on_message([b"", *history[1][1:]])
        # batches 2 .. last-1 missed: the one after the gap has them replayed first
        await sub.on_message([b"", *history[last][1:]])
        assert (sub.gaps_replayed, sub.gaps_lost, sub.last_seq) == (1, 0, last)
        assert sub.mode == "exact" and sub.checked > 0
        assert index.copies(0) == dict(emu.instance.cache_contents())

    _run(case)


def _socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):   # closed meanwhile
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def test_without_events_nothing_is_published_and_names_are_approximate() -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to count sockets")

    async def main() -> None:
        before = _socket_fds()
        async with emulators([SPEC], loaded=LOADED, seed=1, exact_lengths=True,
                             time_scale=0.02) as running, aiohttp.ClientSession() as http:
            assert _socket_fds() - before == 1   # the HTTP listener alone
            await asyncio.wait_for(_approximate(running[0], http), HANG_S)

    asyncio.run(main())


async def _approximate(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
    inst = emu.instance
    assert emu.kv_events is None and inst.kv_feed is None
    text = _prompts(3, 1)[0]
    n = len(text.split())
    got = inst.block_hashes(text, n)
    want = prompt_block_hashes(text, None, BLOCK, n)
    assert isinstance(got, np.ndarray) and want is not None
    assert got.tolist() == want.tolist()
    await _load(emu, http, seed=5)
    assert inst.cache_contents()   # the cache works, silently
    info = await _cache_config(http, emu.url)
    assert info["prefix_caching_hash_algo"] == "sha256"


async def _cache_config(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    found = [s for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "vllm:cache_config_info"]
    assert len(found) == 1 and found[0].value == 1.0
    return dict(found[0].labels)


def test_metrics_give_the_cache_config_as_vllm_does() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        labels = await _cache_config(http, emu.url)
        real = json.loads((Path(__file__).parents[1] / "data" / "kv_events" /
                           "vllm-0.32.0-sha256.json").read_text())["metrics_cache_config_info"]
        real_names = {kv.split("=")[0] for kv in real[0].split("{")[1].split("}")[0]
                      .split(",")}
        assert set(labels) <= real_names
        assert {k: labels[k] for k in ("block_size", "num_gpu_blocks",
                                       "enable_prefix_caching",
                                       "prefix_caching_hash_algo")} == {
            "block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "sha256"}

    _run(case)


# -- the router ---------------------------------------------------------------------------
def _router(tmp_path: Path, kv_events: bool) -> Stack:
    loaded = load_config(_config(
        tmp_path, router={"policy": "cache_aware", "slot_ms": 20},
        server={"health_period_s": 0.1, "scrape_period_s": 0.2, "admin_token": "t",
                "emulator_time_scale": 0.02, "emulator_exact_lengths": True,
                "emulator_kv_events": kv_events},
        instances=[{"name": "e", "model": "llama-2-7b", "gpu": "a100-80gb", "replicas": 2,
                    "block_size": BLOCK, "kv_capacity_tokens": 64 * BLOCK,
                    "max_num_seqs": 4, "max_num_batched_tokens": 512}]))
    return Stack(loaded, num_fakes=0, calibration=CalibrationSource(loaded, known=[CAL] * 2))


@pytest.fixture
def exact_router(tmp_path: Path) -> Iterator[Stack]:
    s = _router(tmp_path, kv_events=True)
    try:
        yield s
    finally:
        s.close()


def _caught_up(s: Stack) -> bool:
    st = s.app[STATE]
    return bool(s.call(lambda: all(
        sub is not None and emu.kv_events is not None
        and sub.last_seq == emu.kv_events.next_seq - 1
        for sub, emu in zip(st.kv_subscribers, st.emulators, strict=True))))


def _post(s: Stack, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    status, _, raw = request(s.url, "POST", path, {"max_tokens": 4, **body})
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


def _join_router(s: Stack) -> None:
    """Requests through the router until every subscriber has a batch (PUB drops what
    it sends before a subscription holds; the first batch replays what came before)."""
    st = s.app[STATE]
    deadline = time.monotonic() + HANG_S
    i = 0
    while s.call(lambda: min(sub.last_seq for sub in st.kv_subscribers)) < 0:
        assert time.monotonic() < deadline, "no KV event batch reached the router"
        _post(s, {"prompt": " ".join(f"j{i}w{j}" for j in range(BLOCK))})
        i += 1


def test_the_embedded_routers_exact_index_is_each_engines_cache(exact_router: Stack) -> None:
    s = exact_router
    st = s.app[STATE]
    assert s.call(lambda: list(st.router.prefixes.exact)) == [True, True]
    _join_router(s)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _post(s, {"prompt": p}), _prompts(13, 40)))
    assert wait_until(lambda: _caught_up(s))
    for g, emu in enumerate(st.emulators):
        assert s.call(lambda g=g: st.router.prefixes.copies(g)) == \
            dict(s.call(emu.instance.cache_contents))
        status = s.call(lambda g=g: st.kv_subscribers[g].status())
        assert status["mode"] == "exact" and status["gaps_lost"] == 0
    # a repeated prompt goes where its blocks are
    prompt = " ".join(f"again{j}" for j in range(20 * BLOCK))
    _post(s, {"prompt": prompt})
    assert wait_until(lambda: _caught_up(s))
    first = WordTokenizer().encode(prompt)[:BLOCK]
    key = int(BlockHasher("sha256").keys(first, BLOCK)[0])
    holders = [g for g, emu in enumerate(st.emulators)
               if key in dict(s.call(emu.instance.cache_contents))]
    assert len(holders) == 1
    answer = _post(s, {"prompt": prompt}, "/route")
    assert answer["instance"] == st.loaded.specs[holders[0]].name


def test_the_router_names_a_prompts_blocks_as_the_emulator(exact_router: Stack) -> None:
    s = exact_router
    st = s.app[STATE]
    text = _prompts(17, 1)[0]
    n = len(text.split())
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    chat_words = 2 + n   # the words of both messages
    for g, emu in enumerate(st.emulators):
        router = s.call(lambda g=g: st.router.new_request(
            0.0, n, 4, 1.0, text=text).engine_block_hashes[g])
        router_chat = s.call(lambda g=g: st.router.new_request(
            0.0, n, 4, 1.0, chat=chat).engine_block_hashes[g])
        named = emu.instance.block_hashes(text, n)
        named_chat = emu.instance.block_hashes(None, chat_words, None, chat)
        assert isinstance(named, NamedBlocks) and isinstance(named_chat, NamedBlocks)
        assert router.tolist() == named.keys.tolist() and len(named.keys) == n // BLOCK
        k = len(named_chat.keys)
        assert k > 0 and router_chat[:k].tolist() == named_chat.keys.tolist()


def test_the_embedded_default_without_events_stays_approximate(tmp_path: Path) -> None:
    s = _router(tmp_path, kv_events=False)
    try:
        st = s.app[STATE]
        assert all(e.kv_events is None for e in st.emulators)
        assert st.kv_subscribers == [] or all(x is None for x in st.kv_subscribers)
        assert s.call(lambda: list(st.router.prefixes.exact)) == [False, False]
        prompt = " ".join(f"w{j}" for j in range(4 * BLOCK))
        _post(s, {"prompt": prompt})
        # the approximate index records where the router sent it
        hashes = prompt_block_hashes(prompt, None, BLOCK, 4 * BLOCK)
        assert hashes is not None
        assert any(set(hashes.tolist()) <= s.call(lambda g=g: st.router.prefixes.holds(g))
                   for g in range(2))
    finally:
        s.close()


def test_a_request_whose_client_leaves_keeps_the_stream_exact() -> None:
    async def case(emu: RunningEmulator, http: aiohttp.ClientSession) -> None:
        pub = emu.kv_events
        assert pub is not None and pub.replay_endpoint is not None
        inst = emu.instance
        await _load(emu, http, seed=19)
        prompt = " ".join(f"gone{j}" for j in range(10 * BLOCK))
        async with http.post(emu.url + "/v1/completions",
                             json={"prompt": prompt, "max_tokens": 500, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()   # its first token: its prompt is cached
        while inst.num_running + inst.num_waiting > 0:   # the engine sees it leave
            await asyncio.sleep(0.01)
        async with http.get(emu.url + "/metrics") as m:
            text = await m.text()
        aborted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:request_success_total"
                   and s.labels["finished_reason"] == "abort"]
        assert aborted == [1.0]
        history = await _replay(pub.replay_endpoint, 0)
        held, _ = _tally([decode_message(f)[2] for f in history])
        assert held == dict(inst.cache_contents())
        key = int(BlockHasher("sha256").keys(WordTokenizer().encode(prompt), BLOCK)[0])
        assert key in held
        assert inst.kv_feed is not None and len(inst.kv_feed.book) == len(held)

    _run(case)
