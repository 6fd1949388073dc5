"""The emulator below HTTP: request validation, the engine's abort, timers built as the
simulator builds them, and batch pacing (on a virtual clock, so exact under any load)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from olproute.config.loader import ConfigError, load_config
from olproute.emulator import (
    EmulatedInstance,
    EmulatedRequest,
    emulation_config,
    ground_truth_timers,
)
from olproute.emulator.protocol import ApiError, ChunkWriter, parse_request
from olproute.sim.engine import SimEngine
from olproute.sim.scenario import build_timers
from olproute.sim.timing import LinearTiming
from olproute.types import InstanceSpec
from tests.virtual_time import run_virtual

SPEC = InstanceSpec(name="u", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                    num_kv_blocks=8)  # 128 KV tokens


OK = [  # (kind, body, prompt_tokens, max_tokens, stream, include_usage)
    ("completion", {"prompt": "a b  c\nd"}, 4, 16, False, False),
    ("completion", {"prompt": [5, 6, 7]}, 3, 16, False, False),
    ("completion", {"prompt": ["one two"], "max_tokens": 3}, 2, 3, False, False),
    ("completion", {"prompt": "x", "prompt_tokens": 50, "max_tokens": 1}, 50, 1, False, False),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
     1, 16, True, True),
    ("chat", {"messages": [{"role": "user", "content": "hi there"},
                           {"role": "assistant", "content": None},
                           {"role": "user", "content": [{"type": "text", "text": "go"}]}],
              "max_completion_tokens": 7}, 3, 7, False, False),
]


@pytest.mark.parametrize(("kind", "body", "prompt", "max_tokens", "stream", "usage"), OK)
def test_requests_parse(kind: Any, body: dict[str, Any], prompt: int, max_tokens: int,
                        stream: bool, usage: bool) -> None:
    req = parse_request(body, kind, "m", 128)
    assert (req.prompt_tokens, req.max_tokens, req.stream, req.include_usage) == (
        prompt, max_tokens, stream, usage)
    assert req.model == "m"


def test_length_limit_is_the_kv_cache_when_it_is_smaller() -> None:
    inst = EmulatedInstance(SPEC, LinearTiming((1e-3, 0, 0, 0), 0.0, np.random.default_rng(0)),
                            max_model_len=4096)
    assert inst.max_model_len == 128  # 8 blocks x 16 tokens < the model's 4096
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "x", "prompt_tokens": 128}, "completion", "m",
                      inst.max_model_len)
    assert (err.value.status, err.value.param) == (400, "prompt")
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "x", "prompt_tokens": 100, "max_tokens": 29}, "completion",
                      "m", inst.max_model_len)
    assert err.value.param == "max_tokens"


def test_sim_engine_abort_frees_the_request() -> None:
    eng = SimEngine(0, SPEC, lambda sums: 0.01)
    a = eng.admit(10, 20, 5, 5)
    b = eng.admit(11, 20, 5, 5)
    assert (a, b) == (0, 1)  # admit returns the core slot
    assert eng.start_batch(0.0) is not None
    with pytest.raises(ValueError, match="commit"):
        eng.abort(10)  # not while a batch is in flight
    eng.finish_batch()
    eng.abort(10)
    assert eng.num_resident == 1
    with pytest.raises(KeyError):
        eng.abort(10)
    done = []
    while eng.start_batch(0.0) is not None:
        done += [rid for rid, flags, _ in eng.finish_batch() if flags & 2]
    assert done == [11] and eng.core.num_free_blocks == SPEC.num_kv_blocks


def test_ground_truth_timers_are_the_simulators() -> None:
    loaded = load_config()
    ours = ground_truth_timers(loaded.specs, loaded.profiles, loaded.config.sim, seed=7)
    theirs = build_timers(loaded, seed=7)
    sums = (3.0, 300.0, 2.0, 900.0, 298.0, 45000.0, 1.0, 0.0)
    for a, b in zip(ours, theirs, strict=True):
        assert [a(sums) for _ in range(5)] == [b(sums) for _ in range(5)]


def test_emulation_config_overrides() -> None:
    loaded = emulation_config(load_config(), 3, ("qwen3-8b", "h100"))
    assert [s.name for s in loaded.specs] == [f"qwen3-8b-h100-{i}" for i in range(3)]
    assert all(s.model == "qwen3-8b" for s in loaded.specs)
    assert [s.name for s in emulation_config(load_config(), 1).specs] == ["llama7b-a100"]
    with pytest.raises(ConfigError, match=r"instances\[0\]\.gpu"):
        emulation_config(load_config(), None, ("llama-2-7b", "tpu"))


def _twenty_ms_engine() -> EmulatedInstance:
    """SPEC's engine where every batch takes 20 ms, on the running loop's clock."""
    timer = LinearTiming((0.02, 0.0, 0.0, 0.0), 0.0, np.random.default_rng(0))
    return EmulatedInstance(SPEC, timer, clock=asyncio.get_running_loop().time)


def test_batches_keep_their_time_and_late_wake_ups_do_not_add_up() -> None:
    """A 10-token request alone takes 10 batches of 20 ms. Every wake-up of the loop
    comes 3 ms late: the busy engine lays its batches back to back on its own clock,
    so the request ends 0.2 s + one lateness after it arrived, not 0.2 s + ten."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        inst = _twenty_ms_engine()
        await inst.start()
        try:
            t0 = loop.time()
            req = inst.submit(20, 10)
            await req.wait_done()
            assert req.num_tokens == 10 and not (req.aborted or req.failed)
            assert loop.time() - t0 == pytest.approx(0.2 + 0.003)
            assert req.first_token_s is not None
            assert req.first_token_s - t0 == pytest.approx(0.02 + 0.003)
            _, records = inst.batch_records()
            starts = [r[1] for r in records]
            assert starts == pytest.approx([0.02 * i for i in range(10)])
        finally:
            await inst.close()

    run_virtual(main, lateness_s=0.003)


def test_an_engine_far_behind_its_clock_restarts_it_instead_of_bursting() -> None:
    """Wake-ups 60 ms late (more than the engine's 50 ms of tolerated lag, a stalled
    loop): each batch starts when the loop woke up, so batches are never run back to
    back in a burst to catch up."""
    async def main() -> None:
        inst = _twenty_ms_engine()
        await inst.start()
        try:
            req = inst.submit(20, 5)
            await req.wait_done()
            _, records = inst.batch_records()
            assert [r[1] for r in records] == pytest.approx([0.08 * i for i in range(5)])
        finally:
            await inst.close()

    run_virtual(main, lateness_s=0.06)


def test_aborts_wait_for_the_batch_in_flight() -> None:
    async def main() -> EmulatedRequest:
        inst = _twenty_ms_engine()
        await inst.start()
        try:
            a, b = inst.submit(20, 50), inst.submit(20, 50)
            await a.wait_beyond(0)  # both have their first token; the next batch is in flight
            inst.abort(a)
            assert a.done and a.aborted
            assert inst.num_running == 2  # dropped only once the batch commits
            await asyncio.sleep(0.03)  # virtual: the batch in flight commits meanwhile
            assert inst.num_running == 1 and a.num_tokens == 1
            inst.abort(b)  # between batches or not, the engine ends up empty
            await asyncio.sleep(0.03)
            assert inst.num_running == inst.num_waiting == 0 and inst.kv_cache_usage == 0
            c = inst.submit(20, 50)
        finally:
            await inst.close()
        with pytest.raises(RuntimeError, match="not running"):
            inst.submit(1, 1)
        return c

    c = run_virtual(main, lateness_s=0.003)
    assert c.done and c.failed  # resident when the engine stopped


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_are_the_documented_json(kind: Any, include_usage: bool) -> None:
    body: dict[str, Any] = {"max_tokens": 20, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    body["prompt" if kind == "completion" else "messages"] = (
        "a b" if kind == "completion" else [{"role": "user", "content": "a b"}])
    writer = ChunkWriter(parse_request(body, kind, 'm "q"', 128), "id-1")
    for i in range(20):
        raw = writer.token(i)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        assert json.loads(raw[6:]) == writer.chunk_dict(i)
    assert writer.chunk_dict(19)["choices"][0]["finish_reason"] == "length"
    events = writer.end(20).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert len(events) == (3 if include_usage else 2)


def test_a_request_after_a_short_idle_gets_a_full_batch() -> None:
    # batches of 30 ms; the engine idles 10 ms after one: the next batch starts when the
    # request arrives, not at the end of the previous batch
    async def main() -> None:
        loop = asyncio.get_running_loop()
        timer = LinearTiming((0.03, 0.0, 0.0, 0.0), 0.0, np.random.default_rng(0))
        inst = EmulatedInstance(SPEC, timer, clock=loop.time)
        await inst.start()
        try:
            await inst.submit(4, 1).wait_done()
            await asyncio.sleep(0.01)
            t0 = loop.time()
            req = inst.submit(4, 1)
            await req.wait_done()
            assert req.first_token_s is not None
            assert req.first_token_s - t0 == pytest.approx(0.03)
            _, records = inst.batch_records()
            assert records[1][1] == pytest.approx(records[0][1] + records[0][2] + 0.01)
        finally:
            await inst.close()

    run_virtual(main)
