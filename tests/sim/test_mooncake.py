"""The Mooncake traces (data/mooncake): counts, units, the prompt blocks they share, the
engine block hashes derived from them, and a simulation of their requests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from olproute.config.loader import ConfigError
from olproute.sim.mooncake import (
    engine_block_hashes,
    prefix_nodes,
    read_mooncake_jsonl,
    repeat_fraction,
)
from olproute.sim.requests import build_requests
from olproute.sim.scenario import simulate
from olproute.sim.workloads import WorkloadError
from tests.conftest import REPO, make_config

MOONCAKE = REPO / "data" / "mooncake"
CONVERSATION = MOONCAKE / "conversation_trace.jsonl"
SYNTHETIC = MOONCAKE / "synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def conversation():  # type: ignore[no-untyped-def]
    return read_mooncake_jsonl(CONVERSATION)


def test_counts_and_units(conversation) -> None:  # type: ignore[no-untyped-def]
    assert len(conversation) == 12_031
    assert len(read_mooncake_jsonl(SYNTHETIC)) == 3_993
    t = conversation.trace
    first = json.loads(CONVERSATION.open().readline())
    assert (t.prompt_tokens[0], t.decode_tokens[0]) == (first["input_length"],
                                                       first["output_length"])
    assert conversation.hash_ids[0].tolist() == first["hash_ids"]
    # timestamps are milliseconds: the trace spans one hour
    assert t.arrival_s[0] == 0.0 and t.arrival_s[-1] == pytest.approx(3536.999)
    # data/mooncake/README.md's medians: prompt 6,909 tokens, output 350
    assert np.median(t.prompt_tokens) == 6909 and np.median(t.decode_tokens) == 350
    # one id per 512-token block, the last one possibly partial
    assert all(len(ids) == math.ceil(p / 512)
               for ids, p in zip(conversation.hash_ids, t.prompt_tokens.tolist(), strict=True))
    half = read_mooncake_jsonl(CONVERSATION, time_scale=0.5).trace.arrival_s
    np.testing.assert_allclose(half, t.arrival_s * 0.5)


def test_an_unbounded_cache_would_hold_36_6_percent_of_prompt_blocks(
        conversation) -> None:  # type: ignore[no-untyped-def]
    """data/mooncake/README.md's figure: 36.6% of the conversation trace's prompt blocks
    repeat an earlier block."""
    assert round(repeat_fraction(conversation.hash_ids), 3) == 0.366
    # the trace's ids are prefix ids: numbering every chain of ids changes nothing
    assert repeat_fraction(prefix_nodes(conversation.hash_ids)) == repeat_fraction(
        conversation.hash_ids)
    # counted in 16-token engine blocks (only full ones), slightly more repeat
    engine = engine_block_hashes(conversation, 16)
    assert sum(map(len, engine)) == int((conversation.trace.prompt_tokens // 16).sum())
    assert round(repeat_fraction(engine), 3) == 0.374


def test_engine_hashes_name_whole_prefixes(conversation) -> None:  # type: ignore[no-untyped-def]
    """Equal engine hashes exactly when the trace's ids agree from the first block up to
    the block holding it and the position inside it agrees (checked on 600 rows)."""
    rows = 600
    hashes = engine_block_hashes(conversation, 16)[:rows]
    by_key: dict[tuple[tuple[int, ...], int], int] = {}
    by_hash: dict[int, tuple[tuple[int, ...], int]] = {}
    for ids, h in zip(conversation.hash_ids[:rows], hashes, strict=True):
        assert h.dtype == np.int64 and not h.flags.writeable and (h >= 0).all()
        for k, value in enumerate(h.tolist()):
            key = (tuple(ids[:k // 32 + 1].tolist()), k % 32)
            assert by_key.setdefault(key, value) == value
            assert by_hash.setdefault(value, key) == key
    # blocks of 32 tokens: 16 per trace block
    h32 = engine_block_hashes(conversation, 32)[0]
    assert len(h32) == conversation.trace.prompt_tokens[0] // 32
    with pytest.raises(ValueError, match="must divide 512"):
        engine_block_hashes(conversation, 24)


def test_bad_lines_are_named(tmp_path: Path) -> None:
    good = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    cases = [
        ({**good, "hash_ids": [1]}, "line 2: hash_ids: 1 ids for 600 prompt tokens"),
        ({**good, "timestamp": 1}, "line 2: timestamp: 1.0 is earlier"),
        ({**good, "input_length": 0}, "line 2: input_length: expected a positive integer"),
        ({**good, "hash_ids": [1, -2]}, "line 2: hash_ids: expected a list of integers"),
        ({"timestamp": 5}, "line 2: expected an object with keys"),
    ]
    for bad, message in cases:
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(WorkloadError, match=message):
            read_mooncake_jsonl(path)


def _mooncake(num_requests: int, kv_tokens: int | None = None,
              **workload: object):  # type: ignore[no-untyped-def]
    return make_config(
        instances=[{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                    "replicas": 2, "kv_capacity_tokens": kv_tokens}],
        workload={"kind": "mooncake", "path": str(CONVERSATION),
                  "num_requests": num_requests, **workload})


def test_a_mooncake_workload_carries_block_hashes() -> None:
    loaded = _mooncake(200, time_scale=2.0)
    reqs = build_requests(loaded)
    assert len(reqs) == 200
    mc = read_mooncake_jsonl(CONVERSATION)
    hashes = engine_block_hashes(mc, 16)
    for i, r in enumerate(reqs):
        assert r.block_hashes is not None and len(r.block_hashes) == r.prompt_tokens // 16
        np.testing.assert_array_equal(r.block_hashes, hashes[i])
        assert r.arrival_s == pytest.approx(2.0 * mc.trace.arrival_s[i])
    # a window keeps each row's hashes with it
    window = build_requests(_mooncake(20, start_s=100.0))
    first = int(np.searchsorted(mc.trace.arrival_s, 100.0))
    assert window[0].prompt_tokens == mc.trace.prompt_tokens[first]
    np.testing.assert_array_equal(window[0].block_hashes, hashes[first])


def test_block_tokens_must_match_the_instances() -> None:
    with pytest.raises(ConfigError, match=r"workload\.block_tokens"):
        build_requests(_mooncake(10, block_tokens=32))
    loaded = make_config(
        instances=[{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                    "block_size": 32}],
        workload={"kind": "mooncake", "path": str(CONVERSATION), "block_tokens": 32,
                  "num_requests": 10})
    assert all(len(r.block_hashes) == r.prompt_tokens // 32  # type: ignore[arg-type]
               for r in build_requests(loaded))


def _seen_before(reqs: list) -> np.ndarray:  # type: ignore[type-arg]
    """Per request, the prompt tokens an unbounded cache shared by every engine would
    hold for it (its longest prefix of blocks that earlier requests had, one token
    short of the prompt)."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        hashes = r.block_hashes.tolist()
        k, most = 0, min(len(hashes), (r.prompt_tokens - 1) // 16)
        while k < most and hashes[k] in seen:
            k += 1
        out.append(16 * k)
        seen.update(hashes)
    return np.array(out)


def test_simulated_mooncake_requests_hit_their_shared_prefixes() -> None:
    """150 conversation requests (from 20 minutes in) on two engines. At the trace's pace
    their KV caches fill and preempt: the compiled core and its twin give the same run,
    and each request's cached prompt tokens are at most what an unbounded cache shared by
    both engines would give. With room (no preemption), the prefill work shrinks by
    exactly the cached tokens."""
    loaded = _mooncake(150, start_s=1200.0)
    fast = simulate(loaded, "round_robin")
    ref = simulate(loaded, "round_robin", reference_core=True)
    assert fast.num_preemptions.sum() > 0
    for name in ("first_token_s", "finish_s", "num_preemptions", "cached_prompt_tokens",
                 "batch_log"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name), err_msg=name)
    cached = fast.cached_prompt_tokens
    assert (cached % 16 == 0).all()
    assert (cached <= _seen_before(list(fast.requests))).all() and cached.sum() > 0

    spread = _mooncake(150, kv_tokens=2_000_000, start_s=1200.0)
    on = simulate(spread, "round_robin")
    off = simulate(spread.with_updates(instances=(spread.config.instances[0].model_copy(
        update={"enable_prefix_caching": False}),)), "round_robin")
    assert on.num_preemptions.sum() == off.num_preemptions.sum() == 0
    prompts = np.array([r.prompt_tokens for r in on.requests])
    assert not off.cached_prompt_tokens.any() and on.cached_prompt_tokens.sum() > 0
    assert on.batch_log[:, 7].sum() == prompts.sum() - on.cached_prompt_tokens.sum()
    assert off.batch_log[:, 7].sum() == prompts.sum()
