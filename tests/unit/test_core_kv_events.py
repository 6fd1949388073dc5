"""The batch-formation core's KV events (vLLM's BlockStored / BlockRemoved, one per
block): the compiled core and its Python twin log the same stream, the stream replayed
into a count per hash is what the cache holds after every commit, a full log drops and
counts, and without the flag nothing is logged."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from olproute._core import FINISHED, KV_REMOVED, KV_STORED, BatchCore
from olproute.core_ref import KV_REMOVED as REF_REMOVED
from olproute.core_ref import KV_STORED as REF_STORED
from olproute.core_ref import ReferenceCore
from tests.unit.test_prefix_cache import _run as run_until_idle

Core = BatchCore | ReferenceCore
BOTH = pytest.mark.parametrize("cls", [BatchCore, ReferenceCore])
LIMITS = {"num_kv_blocks": 40, "block_size": 4, "max_num_seqs": 6,
          "max_num_batched_tokens": 24}


def _replay(counts: Counter[int], kinds: np.ndarray, hashes: np.ndarray) -> None:
    """Apply the events to a count per hash: stored +1, removed -1 (gone at 0)."""
    for kind, h in zip(kinds.tolist(), hashes.tolist(), strict=True):
        assert kind in (KV_STORED, KV_REMOVED)
        if kind == KV_STORED:
            counts[h] += 1
        else:
            assert counts[h] > 0, f"hash {h} removed while not held"
            counts[h] -= 1
            if counts[h] == 0:
                del counts[h]


def _add(rng: random.Random, systems: list[list[int]], fast: Core, ref: Core) -> None:
    """A prompt on one of the shared system prefixes, on both cores alike."""
    contents = rng.choice(systems) + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
    prompt = len(contents) * 4 + rng.randint(0, 3)
    output = rng.randint(1, 20)
    hashes = _chain(contents)
    if math.ceil((prompt + output) / 4) <= LIMITS["num_kv_blocks"]:
        assert (fast.add_request(prompt, output, block_hashes=hashes)
                == ref.add_request(prompt, output, block_hashes=hashes))


def _chain(contents: list[int]) -> list[int]:
    """A block's hash names its whole prefix (a stable id of the tuple)."""
    return [hash(tuple(contents[:i + 1])) & ((1 << 62) - 1) for i in range(len(contents))]


def _step(fast: Core, ref: Core) -> None:
    fast.schedule()
    ref.schedule()
    fast.commit()
    ref.commit()
    for slot, flags in fast.event_list():
        if flags & FINISHED:
            fast.release_slot(slot)
            ref.release_slot(slot)


@pytest.mark.parametrize("seed", [3, 11])
def test_both_cores_log_one_stream_that_rebuilds_the_cache(seed: int) -> None:
    rng = random.Random(seed)
    fast = BatchCore(**LIMITS, capacity=2, kv_events=True)
    ref = ReferenceCore(**LIMITS, capacity=2, kv_events=True)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(1, 5))] for _ in range(5)]
    counts: Counter[int] = Counter()
    seen = Counter[str]()
    for step in range(2500):
        if step < 2000 and rng.random() < 0.3:
            _add(rng, systems, fast, ref)
        if step % 97 == 50 and fast.num_waiting > 0:   # an abort: frees, evicts nothing
            slot = int(fast.waiting()[-1])
            fast.abort(slot)
            ref.abort(slot)
        _step(fast, ref)
        kinds, hashes, dropped = fast.take_kv_events()
        r_kinds, r_hashes, r_dropped = ref.take_kv_events()
        assert kinds.dtype == hashes.dtype == np.int64
        assert (kinds.tolist(), hashes.tolist(), dropped) == (
            r_kinds.tolist(), r_hashes.tolist(), r_dropped)
        _replay(counts, kinds, hashes)
        assert sorted(counts.items()) == fast.cache_contents() == ref.cache_contents()
        seen["stored"] += int(np.sum(kinds == KV_STORED))
        seen["removed"] += int(np.sum(kinds == KV_REMOVED))
        seen["duplicates"] += any(n > 1 for n in counts.values())
    # the cache was under pressure: blocks were evicted, and copies of one hash were held
    assert seen["stored"] > seen["removed"] > 0 and seen["duplicates"] > 0, seen
    assert fast.num_running == fast.num_waiting == 0


def test_the_constants_agree() -> None:
    assert (KV_STORED, KV_REMOVED) == (REF_STORED, REF_REMOVED) == (1, 2)


def _evicting_run(core: Core) -> None:
    """Eight prompts of three new blocks each on a cache of eight blocks: 24 stored,
    the first prompts' blocks evicted to make room for the later ones."""
    for i in range(8):
        core.add_request(12, 1, block_hashes=[100 * i + 1, 100 * i + 2, 100 * i + 3])
        run_until_idle(core)


@BOTH
def test_a_full_log_drops_and_counts_and_the_next_take_starts_afresh(cls: type[Core]) -> None:
    full = cls(8, 4, 4, 64, kv_events=True)
    _evicting_run(full)
    all_kinds, all_hashes, none = full.take_kv_events()
    assert none == 0 and int(np.sum(all_kinds == KV_REMOVED)) > 0

    tiny = cls(8, 4, 4, 64, kv_events=True, kv_events_capacity=5)
    _evicting_run(tiny)
    kinds, hashes, dropped = tiny.take_kv_events()
    assert kinds.tolist() == all_kinds[:5].tolist() and hashes.tolist() == all_hashes[:5].tolist()
    assert dropped == len(all_kinds) - 5
    assert [a.tolist() for a in tiny.take_kv_events()[:2]] == [[], []]
    assert tiny.take_kv_events()[2] == 0
    # after a take the log has room again: the next events are kept from the first one
    # (two blocks taken, evicting at most two, and one registered: within five)
    tiny.add_request(4, 1, block_hashes=[901])
    tiny.schedule()
    kinds, hashes, dropped = tiny.take_kv_events()
    assert dropped == 0 and 1 < len(kinds) <= 3
    assert (kinds[-1], hashes[-1]) == (KV_STORED, 901)


@BOTH
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_without_the_flag_nothing_is_logged(cls: type[Core], prefix_caching: bool) -> None:
    core = cls(8, 4, 4, 64, prefix_caching=prefix_caching)
    assert not core.kv_events
    _evicting_run(core)
    kinds, hashes, dropped = core.take_kv_events()
    assert kinds.tolist() == hashes.tolist() == [] and dropped == 0
    assert kinds.dtype == hashes.dtype == np.int64
    if prefix_caching:
        assert core.cache_contents()      # the cache was used, only not logged


@BOTH
def test_kv_events_without_prefix_caching_log_nothing(cls: type[Core]) -> None:
    core = cls(8, 4, 4, 64, prefix_caching=False, kv_events=True)
    assert not core.kv_events
    _evicting_run(core)
    assert core.take_kv_events()[2] == 0 and len(core.take_kv_events()[0]) == 0


@BOTH
def test_a_negative_capacity_is_refused(cls: type[Core]) -> None:
    with pytest.raises(ValueError, match="kv_events_capacity"):
        cls(8, 4, 4, 64, kv_events=True, kv_events_capacity=-1)
