"""The compiled batch-formation core against its plain-Python reference, and the
scheduling invariants both must keep."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute._core import FINISHED as C_FINISHED
from olproute._core import FIRST_TOKEN as C_FIRST_TOKEN
from olproute._core import BatchCore
from olproute.core_ref import FINISHED, FIRST_TOKEN, ReferenceCore

Core = BatchCore | ReferenceCore

limits = st.fixed_dictionaries({
    "num_kv_blocks": st.integers(4, 64),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 96),
})
# An op is ("add", prompt, output), ("step",) or ("abort", k): abort the k-th resident
# request (modulo); steps dominate so requests progress.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40)),
        st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 63)),
    ),
    min_size=1, max_size=120,
)


def _fits(lim: dict[str, int], prompt: int, output: int) -> bool:
    return math.ceil((prompt + output) / lim["block_size"]) <= lim["num_kv_blocks"]


def _state(core: Core) -> tuple[object, ...]:
    slots = range(core.capacity)
    return (core.running().tolist(), core.waiting().tolist(), core.num_free_blocks,
            [core.request(s) for s in slots])


def _check_invariants(core: Core, lim: dict[str, int], tokens: np.ndarray,
                      slots: np.ndarray) -> None:
    assert int(tokens.sum()) <= lim["max_num_batched_tokens"]
    assert core.num_running <= lim["max_num_seqs"]
    held = sum(core.request(s)[4] for s in range(core.capacity))
    assert held == lim["num_kv_blocks"] - core.num_free_blocks
    assert 0 <= core.num_free_blocks <= lim["num_kv_blocks"]
    assert len(set(slots.tolist())) == len(slots)  # a request is in a batch at most once
    for s in core.running().tolist():
        _prompt, _out, _mx, computed, blocks, _pre = core.request(s)
        assert blocks * lim["block_size"] >= computed


def test_event_flags_agree() -> None:
    assert (C_FIRST_TOKEN, C_FINISHED) == (FIRST_TOKEN, FINISHED)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(lim=limits, program=ops)
def test_compiled_core_matches_reference(lim: dict[str, int], program: list[tuple]) -> None:
    fast, ref = BatchCore(**lim, capacity=4), ReferenceCore(**lim, capacity=4)
    for op in program:
        if op[0] == "add":
            _, prompt, output = op
            if not _fits(lim, prompt, output):
                with pytest.raises(ValueError):
                    fast.add_request(prompt, output)
                with pytest.raises(ValueError):
                    ref.add_request(prompt, output)
                continue
            assert fast.add_request(prompt, output) == ref.add_request(prompt, output)
            continue
        if op[0] == "abort":
            resident = fast.running().tolist() + fast.waiting().tolist()
            if resident:
                slot = resident[op[1] % len(resident)]
                fast.abort(slot)
                ref.abort(slot)
                assert _state(fast) == _state(ref)
            continue
        n_fast, sums_fast = fast.schedule()
        n_ref, sums_ref = ref.schedule()
        assert (n_fast, sums_fast) == (n_ref, sums_ref)
        batch_fast, batch_ref = fast.batch(), ref.batch()
        for a, b in zip(batch_fast, batch_ref, strict=True):
            assert a.tolist() == b.tolist()
        assert fast.preempted().tolist() == ref.preempted().tolist()
        _check_invariants(fast, lim, batch_fast[1], batch_fast[0])
        assert fast.commit() == ref.commit()
        assert fast.event_list() == ref.event_list()
        for slot, flags in fast.event_list():
            if flags & FINISHED:
                fast.release_slot(slot)
                ref.release_slot(slot)
        assert _state(fast) == _state(ref)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(lim=limits, reqs=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40)),
                                 min_size=1, max_size=30))
def test_every_request_finishes_once_with_its_tokens(lim: dict[str, int],
                                                     reqs: list[tuple[int, int]]) -> None:
    core = BatchCore(**lim)
    wanted = {}
    for prompt, output in reqs:
        if _fits(lim, prompt, output):
            wanted[core.add_request(prompt, output)] = output
    first: dict[int, int] = {}
    finished: dict[int, int] = {}
    decode_steps = 0
    for _ in range(100_000):
        if not wanted.keys() - finished.keys():
            break
        n, sums = core.schedule()
        assert n > 0, "work is pending, so a batch must form (no deadlock)"
        decode_steps += int(sums[2])
        core.commit()
        for slot, flags in core.event_list():
            if flags & FIRST_TOKEN:
                first[slot] = first.get(slot, 0) + 1
            if flags & FINISHED:
                finished[slot] = finished.get(slot, 0) + 1
                assert core.request(slot)[1] == wanted[slot]  # tokens produced == decode
    assert set(finished) == set(wanted) and all(v == 1 for v in finished.values())
    assert set(first) == set(wanted) and all(v == 1 for v in first.values())
    # every output token after the first comes from exactly one decode step, unless a
    # preemption made a recompute produce it
    preempted = sum(core.request(s)[5] for s in wanted)
    if preempted == 0:
        assert decode_steps == sum(o - 1 for o in wanted.values())
    assert core.num_free_blocks == lim["num_kv_blocks"]
    assert core.num_running == core.num_waiting == 0


def test_chunked_prefill_then_decode_by_hand() -> None:
    core = BatchCore(num_kv_blocks=100, block_size=16, max_num_seqs=4,
                     max_num_batched_tokens=64)
    a = core.add_request(100, 3)
    # 100 prompt tokens over chunks of 64 and 36; context grows by the chunk
    n, sums = core.schedule()
    assert n == 1 and core.batch()[1].tolist() == [64] and core.batch()[2].tolist() == [0]
    assert sums[5] == 64 * 65 / 2  # chunk*(chunk+1)/2 with no context
    core.commit()
    assert core.event_list() == []
    n, sums = core.schedule()
    assert core.batch()[1].tolist() == [36] and core.batch()[2].tolist() == [64]
    assert sums[5] == 36 * 64 + 36 * 37 / 2
    core.commit()
    assert core.event_list() == [(a, FIRST_TOKEN)]
    # two decode steps, each one token with the context so far
    for ctx in (100, 101):
        n, sums = core.schedule()
        assert core.batch()[3].tolist() == [1] and sums[3] == ctx and sums[2] == 1
        core.commit()
    assert core.event_list() == [(a, FINISHED)]
    assert core.request(a)[1] == 3


def test_waiting_request_blocked_by_slots_and_budget() -> None:
    core = BatchCore(num_kv_blocks=100, block_size=16, max_num_seqs=1,
                     max_num_batched_tokens=64)
    a = core.add_request(10, 5)
    b = core.add_request(10, 5)
    core.schedule()
    assert core.batch()[0].tolist() == [a] and core.waiting().tolist() == [b]
    core.commit()


def test_preemption_recomputes_the_latest_running_request() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; their decodes
    # grow until the cache is full, then the later one is preempted to the waiting front.
    core = BatchCore(num_kv_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = core.add_request(8, 12)
    b = core.add_request(8, 12)
    c = core.add_request(4, 1)
    seen_preemption = False
    for _ in range(200):
        n, _ = core.schedule()
        if n == 0:
            break
        pre = core.preempted().tolist()
        if pre:
            seen_preemption = True
            assert pre[0] == b, "the most recently started running request goes first"
            assert core.waiting().tolist()[0] == b
            assert core.request(b)[3] == 0  # computed tokens reset: recompute
            assert core.request(b)[5] >= 1
        core.commit()
        for slot, flags in core.event_list():
            if flags & FINISHED:
                core.release_slot(slot)
    assert seen_preemption
    assert core.num_free_blocks == 6
    del a, c


def test_add_request_rejects_what_can_never_fit() -> None:
    core = BatchCore(num_kv_blocks=2, block_size=16, max_num_seqs=4, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        core.add_request(30, 10)
    with pytest.raises(ValueError):
        core.add_request(0, 1)
    with pytest.raises(ValueError):
        BatchCore(num_kv_blocks=0, block_size=16, max_num_seqs=1, max_num_batched_tokens=1)


def test_release_of_unfinished_slot_is_an_error() -> None:
    core = BatchCore(num_kv_blocks=10, block_size=16, max_num_seqs=4, max_num_batched_tokens=8)
    s = core.add_request(4, 4)
    with pytest.raises(ValueError, match="has not finished"):
        core.release_slot(s)


def test_tables_grow_past_initial_capacity() -> None:
    core = BatchCore(num_kv_blocks=10_000, block_size=16, max_num_seqs=4,
                     max_num_batched_tokens=8, capacity=2)
    slots = [core.add_request(3, 2) for _ in range(50)]
    assert sorted(slots) == list(range(50))
    assert core.waiting().tolist() == slots
    assert core.capacity >= 50


@pytest.mark.parametrize("cls", [BatchCore, ReferenceCore])
def test_abort_frees_slot_and_blocks_and_keeps_queue_order(cls: type[Core]) -> None:
    core = cls(num_kv_blocks=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c, d = (core.add_request(8, 6) for _ in range(4))
    core.schedule()
    with pytest.raises(ValueError, match="commit"):
        core.abort(a)  # a batch in flight still refers to its slots
    core.commit()
    assert core.running().tolist() == [a, b] and core.waiting().tolist() == [c, d]
    free = core.num_free_blocks
    held = core.request(a)[4]
    core.abort(a)
    assert core.running().tolist() == [b] and core.num_free_blocks == free + held
    core.abort(c)
    assert core.waiting().tolist() == [d]
    with pytest.raises(ValueError, match="no unfinished request"):
        core.abort(a)
    # the freed slots are handed out again, and the rest still finishes
    assert {core.add_request(4, 2), core.add_request(4, 2)} == {a, c}
    for _ in range(100):
        if core.schedule()[0] == 0:
            break
        core.commit()
        for slot, flags in core.event_list():
            if flags & FINISHED:
                core.release_slot(slot)
    assert core.num_running == core.num_waiting == 0
    assert core.num_free_blocks == 20
