"""The prefix cache of the batch-formation core (vLLM v1's automatic prefix caching)
against its Python twin, which keeps vLLM's block pool literally, and the rules both
must follow: longest cached prefix on admission, the last token computed again, blocks
registered as they are scheduled, freed last block first, evicted least recently freed
first, cached free blocks counted free."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute._core import FINISHED, BatchCore
from olproute.core_ref import ReferenceCore

Core = BatchCore | ReferenceCore
BOTH = pytest.mark.parametrize("cls", [BatchCore, ReferenceCore])


class Chains:
    """Hash chains over block contents: a block's hash is the id of its whole prefix,
    so requests whose contents share a prefix share those hashes."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}

    def hashes(self, contents: list[int]) -> list[int]:
        return [self.ids.setdefault(tuple(contents[:i + 1]), len(self.ids))
                for i in range(len(contents))]


def _state(core: Core) -> tuple[object, ...]:
    slots = range(core.capacity)
    by_slot = np.arange(core.capacity, dtype=np.int64)
    table, ids, num_running, free, _inflight = core.snapshot(by_slot, by_slot)
    return ((table.tolist(), ids.tolist(), num_running, free),
            core.running().tolist(), core.waiting().tolist(), core.num_free_blocks,
            [core.request(s) for s in slots], [core.prefix_state(s) for s in slots],
            core.free_queue(), core.cache_contents(), core.prefix_cache_queries,
            core.prefix_cache_hits, core.num_cached_blocks, core.num_evictable_blocks)


def _check_accounting(core: Core, total: int) -> None:
    """Free blocks are the unhashed free ones plus the cached ones nobody holds."""
    queue, tail = core.free_queue()
    assert core.num_free_blocks == tail + sum(gap for gap, _ in queue) + len(queue)
    assert core.num_evictable_blocks == len(queue)
    assert 0 <= core.num_free_blocks <= total
    assert core.num_cached_blocks == sum(n for _, n in core.cache_contents())
    for s in core.running().tolist():
        _p, _o, _m, computed, blocks, _pre = core.request(s)
        assert blocks * core.block_size >= computed
        assert core.prefix_state(s)[1] <= blocks


def _step_both(fast: BatchCore, ref: ReferenceCore) -> list[tuple[int, int]]:
    assert fast.schedule() == ref.schedule()
    for a, b in zip(fast.batch(), ref.batch(), strict=True):
        assert a.tolist() == b.tolist()
    assert fast.preempted().tolist() == ref.preempted().tolist()
    assert _state(fast) == _state(ref)  # registrations and hits happen while scheduling
    assert fast.commit() == ref.commit()
    kv, kv_ref = fast.take_kv_events(), ref.take_kv_events()
    assert [a.tolist() for a in kv[:2]] + [kv[2]] == [a.tolist() for a in kv_ref[:2]] + [kv_ref[2]]
    events = fast.event_list()
    assert events == ref.event_list()
    for slot, flags in events:
        if flags & FINISHED:
            fast.release_slot(slot)
            ref.release_slot(slot)
    assert _state(fast) == _state(ref)
    return events


limits = st.fixed_dictionaries({
    "num_kv_blocks": st.integers(6, 32),
    "block_size": st.sampled_from([1, 2, 4]),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(1, 48),
})
# ("add", block contents from a small alphabet (shared prefixes), extra tokens past the
# last full block, hashed blocks kept, output), ("step",) or ("abort", k)
_add = st.tuples(st.just("add"), st.lists(st.integers(0, 1), min_size=1, max_size=8),
                st.integers(0, 3), st.integers(0, 10), st.integers(1, 24))
_step = st.tuples(st.just("step"))
ops = st.lists(
    st.one_of(_add, _add, _step, _step, _step, st.tuples(st.just("abort"), st.integers(0, 63))),
    min_size=20, max_size=120,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(lim=limits, program=ops)
def test_compiled_core_matches_reference_with_shared_prefixes(
        lim: dict[str, int], program: list[tuple]) -> None:
    # with KV events on (what they log is compared at every step; nothing else changes)
    fast = BatchCore(**lim, capacity=4, kv_events=True)
    ref = ReferenceCore(**lim, capacity=4, kv_events=True)
    chains = Chains()
    bs = lim["block_size"]
    for op in program:
        if op[0] == "add":
            _, contents, extra, keep, output = op
            prompt = max(len(contents) * bs + min(extra, bs - 1), 1)
            hashes = chains.hashes(contents[:min(keep, prompt // bs)])
            if math.ceil((prompt + output) / bs) > lim["num_kv_blocks"]:
                continue
            assert (fast.add_request(prompt, output, block_hashes=hashes)
                    == ref.add_request(prompt, output, block_hashes=hashes))
        elif op[0] == "abort":
            resident = fast.running().tolist() + fast.waiting().tolist()
            if resident:
                slot = resident[op[1] % len(resident)]
                fast.abort(slot)
                ref.abort(slot)
                assert _state(fast) == _state(ref)
        else:
            _step_both(fast, ref)
            _check_accounting(fast, lim["num_kv_blocks"])


def test_many_requests_on_few_shared_prefixes_evict_and_preempt_alike() -> None:
    """A seeded stream of conversations on a small cache: hits, duplicates, evictions and
    preemptions all happen, and the compiled core stays equal to the literal pool."""
    rng = random.Random(7)
    lim = {"num_kv_blocks": 48, "block_size": 4, "max_num_seqs": 6,
           "max_num_batched_tokens": 24}
    fast, ref = BatchCore(**lim, capacity=2), ReferenceCore(**lim, capacity=2)
    chains = Chains()
    systems = [[rng.randrange(1000) for _ in range(rng.randint(1, 5))] for _ in range(4)]
    seen = {"hits": 0, "preempted": 0, "evicted": 0, "duplicates": 0}
    for step in range(3000):
        if step < 2500 and rng.random() < 0.3:
            contents = rng.choice(systems) + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            prompt = len(contents) * 4 + rng.randint(0, 3) or 1
            output = rng.randint(1, 20)
            hashes = chains.hashes(contents)
            if math.ceil((prompt + output) / 4) <= lim["num_kv_blocks"]:
                assert (fast.add_request(prompt, output, block_hashes=hashes)
                        == ref.add_request(prompt, output, block_hashes=hashes))
        cached_before = fast.num_cached_blocks
        hits_before = fast.prefix_cache_hits
        _step_both(fast, ref)
        _check_accounting(fast, lim["num_kv_blocks"])
        seen["hits"] += fast.prefix_cache_hits > hits_before
        seen["preempted"] += len(fast.preempted()) > 0
        seen["evicted"] += fast.num_cached_blocks < cached_before
        seen["duplicates"] += any(n > 1 for _, n in fast.cache_contents())
    assert all(v > 0 for v in seen.values()), seen
    assert fast.num_running == fast.num_waiting == 0
    assert fast.num_free_blocks == lim["num_kv_blocks"]


def _run(core: Core, steps: int = 1000) -> None:
    for _ in range(steps):
        if core.schedule()[0] == 0:
            return
        core.commit()
        for slot, flags in core.event_list():
            if flags & FINISHED:
                core.release_slot(slot)


@BOTH
def test_a_cached_prefix_is_not_computed_again(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(18, 2, block_hashes=[1, 2, 3, 4])
    _run(core)
    # a longer prompt sharing the first three blocks: 12 tokens cached, 10 computed
    b = core.add_request(22, 2, block_hashes=[1, 2, 3, 9, 10])
    core.schedule()
    assert core.batch()[1].tolist() == [10] and core.batch()[2].tolist() == [12]
    assert core.prefix_state(b) == (5, 5, 12)  # 3 hit + 2 registered as scheduled
    assert (core.prefix_cache_queries, core.prefix_cache_hits) == (18 + 22, 12)


@BOTH
@pytest.mark.parametrize(("prompt", "cached"), [(16, 12), (18, 16), (17, 16)])
def test_a_fully_cached_prompt_computes_its_last_token_again(cls: type[Core], prompt: int,
                                                              cached: int) -> None:
    """As vLLM: the hit stops one token short of the prompt, at a block boundary, so a
    block-aligned prompt computes its whole last block again."""
    core = cls(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    hashes = [1, 2, 3, 4]
    core.add_request(prompt, 1, block_hashes=hashes)
    _run(core)
    b = core.add_request(prompt, 3, block_hashes=hashes)
    core.schedule()
    assert core.batch()[1].tolist() == [prompt - cached]
    assert core.prefix_state(b)[2] == cached
    if prompt == 16:
        # the recomputed last block is registered again: vLLM keeps both copies
        assert core.cache_contents() == [(1, 1), (2, 1), (3, 1), (4, 2)]


@BOTH
def test_free_blocks_leave_in_lru_order_tail_of_a_prompt_first(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(8, 1, block_hashes=[10, 11])     # A: 2 blocks
    _run(core)
    core.add_request(12, 1, block_hashes=[20, 21, 22])  # B: 3 blocks, freed after A's
    _run(core)
    # A's blocks were freed first, each request's last block before its first
    assert core.free_queue() == ([(7, 11), (0, 10), (0, 22), (0, 21), (0, 20)], 0)
    assert core.num_free_blocks == 12 and core.num_evictable_blocks == 5
    # 9 blocks of something new: the 7 never-used ones, then A's tail, then A's head
    core.add_request(36, 1, block_hashes=list(range(100, 109)))
    core.schedule()
    assert [h for h, _ in core.cache_contents()] == [20, 21, 22, *range(100, 109)]
    core.commit()
    # B's prefix is still found; A's is gone
    b = core.add_request(12, 1, block_hashes=[20, 21, 22])
    core.schedule()
    assert core.prefix_state(b)[2] == 8


@BOTH
def test_a_hit_takes_its_blocks_out_of_the_free_queue(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(16, 1, block_hashes=[1, 2, 3, 4])
    _run(core)
    assert core.num_free_blocks == 6 and core.num_evictable_blocks == 4
    # 3 cached blocks (taken out of the queue: no longer free) and 1 new one, from the
    # front of the queue: a never-used block, evicting nothing
    b = core.add_request(13, 4, block_hashes=[1, 2, 3])
    core.schedule()
    assert core.prefix_state(b) == (3, 3, 12)
    assert core.num_free_blocks == 2 and core.free_queue() == ([(1, 4)], 0)
    core.commit()


@BOTH
def test_cached_free_blocks_count_as_free_for_admission(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(15, 1, block_hashes=[1, 2, 3])
    _run(core)
    assert core.num_free_blocks == 4 and core.num_cached_blocks == 3
    # an unrelated request of 4 blocks fits: the unhashed free block, then the 3 cached
    core.add_request(15, 1, block_hashes=[5, 6, 7])
    assert core.schedule()[0] == 1
    assert [h for h, _ in core.cache_contents()] == [5, 6, 7]


@BOTH
def test_a_request_that_does_not_fit_keeps_waiting_untouched(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(16, 1, block_hashes=[1, 2, 3, 4])
    _run(core)
    core.add_request(20, 10)  # takes 5 of the 8 blocks, evicting hash 4
    big = core.add_request(24, 8, block_hashes=[1, 2, 3, 4, 5, 6])
    core.schedule()  # big would take its 3 cached blocks and 3 new ones: no room
    assert core.waiting().tolist() == [big]
    assert core.request(big)[3:5] == (0, 0)
    assert core.prefix_state(big) == (6, 0, 0)


@BOTH
def test_a_preempted_request_finds_what_is_left_of_its_prompt(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    core.add_request(8, 12, block_hashes=[1, 2])
    b = core.add_request(8, 12, block_hashes=[3, 4])
    preempted_at = None
    for step in range(100):
        if core.schedule()[0] == 0:
            break
        if core.preempted().tolist():
            assert core.preempted().tolist() == [b] and preempted_at is None
            preempted_at = step
            # its blocks are free and its prompt's stay cached, tail first in the queue
            assert core.free_queue() == ([(0, 4), (0, 3)], 0)
        core.commit()
        for slot, flags in core.event_list():
            if flags & FINISHED:
                core.release_slot(slot)
    assert preempted_at is not None
    # b came back with 8 + 5 known tokens; the other request's growth had evicted its
    # prompt's tail (hash 4), so it found its first block only
    assert (core.prefix_cache_queries, core.prefix_cache_hits) == (16 + 13, 4)
    assert core.prefix_state(b)[2] == 0  # cached tokens: those of its first admission


@BOTH
def test_same_prefix_in_one_step_hits_the_blocks_being_computed(cls: type[Core]) -> None:
    """vLLM registers a block when it schedules it: a later request of the same step
    finds it (its KV is written before the batch's attention reads it)."""
    core = cls(num_kv_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = core.add_request(12, 2, block_hashes=[1, 2, 3])
    b = core.add_request(14, 2, block_hashes=[1, 2, 3])
    core.schedule()
    assert core.batch()[1].tolist() == [12, 2]
    assert core.prefix_state(a)[2] == 0 and core.prefix_state(b)[2] == 12


@BOTH
def test_hashes_are_checked_where_requests_enter(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="3 block hashes for a prompt of 11 tokens, which "
                                         "has 2 full blocks of 4"):
        core.add_request(11, 1, block_hashes=[1, 2, 3])
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*63\)"):
        core.add_request(12, 1, block_hashes=[1, -2])
    with pytest.raises(ValueError, match="one-dimensional sequence of integers"):
        core.add_request(12, 1, block_hashes=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*63\)"):
        core.add_request(12, 1, block_hashes=np.array([2**63], dtype=np.uint64))
    assert core.num_waiting == 0
    core.add_request(12, 1, block_hashes=[])
    core.add_request(12, 1, block_hashes=np.array([5, 6, 7], dtype=np.int32))


@BOTH
def test_without_prefix_caching_hashes_change_nothing(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
               prefix_caching=False)
    core.add_request(16, 1, block_hashes=[1, 2, 3, 4])
    _run(core)
    b = core.add_request(16, 1, block_hashes=[1, 2, 3, 4])
    core.schedule()
    assert core.batch()[1].tolist() == [16]
    assert core.prefix_state(b) == (0, 0, 0)
    assert core.free_queue() == ([], 28) and core.cache_contents() == []
    assert not core.prefix_caching


def test_with_and_without_prefix_caching_agree_when_no_request_has_hashes() -> None:
    rng = random.Random(3)
    lim = {"num_kv_blocks": 40, "block_size": 4, "max_num_seqs": 5,
           "max_num_batched_tokens": 32}
    on, off = BatchCore(**lim), BatchCore(**lim, prefix_caching=False)
    for step in range(2000):
        if step < 1500 and rng.random() < 0.3:
            p, o = rng.randint(1, 80), rng.randint(1, 60)
            if math.ceil((p + o) / 4) <= 40:
                assert on.add_request(p, o) == off.add_request(p, o)
        assert on.schedule() == off.schedule()
        assert on.preempted().tolist() == off.preempted().tolist()
        assert on.commit() == off.commit()
        assert on.event_list() == off.event_list()
        assert on.num_free_blocks == off.num_free_blocks
        for slot, flags in on.event_list():
            if flags & FINISHED:
                on.release_slot(slot)
                off.release_slot(slot)
    assert on.prefix_cache_queries == 0 and on.num_cached_blocks == 0
