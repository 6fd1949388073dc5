"""Plain-Python reference of the batch-formation kernel in ``_core.pyx``.

It follows the compiled kernel rule for rule and exposes the same methods, so tests can
drive both with the same operations and assert they agree exactly. It is the readable
statement of the scheduling rules; the compiled one is the fast one. With prefix caching
on it keeps vLLM's block pool literally (``olproute.prefix_ref.BlockPool``: every block by
id), where the compiled core keeps only the blocks that carry a hash; without it, free
blocks are a count, as in the BEA replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from olproute.prefix_ref import KV_REMOVED, KV_STORED, BlockPool, KvEventLog

FIRST_TOKEN = 1
FINISHED = 2
NUM_SUMS = 8
__all__ = ["FINISHED", "FIRST_TOKEN", "KV_REMOVED", "KV_STORED", "NUM_SUMS", "IntArray",
           "ReferenceCore", "Sums", "checked_block_hashes", "replay_ttft_reference"]

Sums = tuple[float, float, float, float, float, float, float, float]
IntArray = npt.NDArray[np.int64]


def _blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


def checked_block_hashes(block_hashes: Sequence[int] | IntArray | None, prompt_tokens: int,
                         block_size: int) -> list[int]:
    """The hashes as a list of ints, or ValueError unless they are integers >= 0 and in
    [0, 2**63), at most one per full block of the prompt (``_core.checked_block_hashes``)."""
    if block_hashes is None:
        return []
    h = np.asarray(block_hashes)
    if h.ndim != 1 or (h.size > 0 and h.dtype.kind not in "iu"):
        raise ValueError("block_hashes must be a one-dimensional sequence of integers")
    values = [int(x) for x in h]
    if any(not 0 <= x < 2**63 for x in values):
        raise ValueError("block hashes must be integers in [0, 2**63)")
    full = prompt_tokens // block_size
    if len(values) > full:
        raise ValueError(f"{len(values)} block hashes for a prompt of {prompt_tokens} "
                         f"tokens, which has {full} full blocks of {block_size}")
    return values


class ReferenceCore:
    """Same contract as ``olproute._core.BatchCore``; see its docstrings."""

    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        capacity: int = 256,
        prefix_caching: bool = True,
        kv_events: bool = False,
        kv_events_capacity: int = 65536,
    ) -> None:
        if kv_events_capacity < 0:
            raise ValueError("kv_events_capacity must be >= 0")
        if min(num_kv_blocks, block_size, max_num_seqs, max_num_batched_tokens) < 1:
            raise ValueError("BatchCore limits must all be >= 1")
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_free_blocks = num_kv_blocks
        self.capacity = 0
        self._prompt: list[int] = []
        self._output: list[int] = []
        self._max_output: list[int] = []
        self._computed: list[int] = []
        self._blocks: list[int] = []
        self._preempt: list[int] = []
        self._running: list[int] = []
        self._waiting: list[int] = []
        self._free_slots: list[int] = []
        self._batch: list[tuple[int, int, int, int]] = []
        self._preempted: list[int] = []
        self._events: list[tuple[int, int]] = []
        # prefix cache: the pool, and per slot its hashes, its block ids (the first
        # _num_cached of them registered or hit), its tokens found cached when admitted
        self._kv_log = KvEventLog(kv_events_capacity) if kv_events and prefix_caching \
            else None
        self._pool = BlockPool(num_kv_blocks, self._kv_log) if prefix_caching else None
        self._hashes: list[list[int]] = []
        self._table: list[list[int]] = []
        self._num_cached: list[int] = []
        self._cached_tokens: list[int] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._grow(max(capacity, 1))

    def _grow(self, new_capacity: int) -> None:
        extra = new_capacity - self.capacity
        for table in (self._prompt, self._output, self._max_output, self._computed,
                      self._blocks, self._preempt, self._num_cached, self._cached_tokens):
            table.extend([0] * extra)
        self._hashes.extend([] for _ in range(extra))
        self._table.extend([] for _ in range(extra))
        self._free_slots.extend(range(new_capacity - 1, self.capacity - 1, -1))
        self.capacity = new_capacity

    # -- requests -------------------------------------------------------------------
    def add_request(self, prompt_tokens: int, max_output_tokens: int,
                    computed_tokens: int = 0,
                    block_hashes: Sequence[int] | IntArray | None = None) -> int:
        if prompt_tokens < 1 or max_output_tokens < 1:
            raise ValueError("prompt_tokens and max_output_tokens must be >= 1")
        if computed_tokens < 0 or computed_tokens >= prompt_tokens:
            raise ValueError("computed_tokens must be >= 0 and < prompt_tokens")
        if _blocks_for(prompt_tokens + max_output_tokens, self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"request of {prompt_tokens}+{max_output_tokens} tokens exceeds the KV capacity "
                f"of {self.num_kv_blocks * self.block_size} tokens"
            )
        hashes = checked_block_hashes(block_hashes, prompt_tokens, self.block_size)
        if not self._free_slots:
            self._grow(self.capacity * 2)
        s = self._free_slots.pop()
        self._prompt[s] = prompt_tokens
        self._output[s] = 0
        self._max_output[s] = max_output_tokens
        self._computed[s] = computed_tokens
        self._blocks[s] = 0
        self._preempt[s] = 0
        self._hashes[s] = hashes if self._pool is not None else []
        self._num_cached[s] = self._cached_tokens[s] = 0
        self._waiting.append(s)
        return s

    def release_slot(self, slot: int) -> None:
        if self._output[slot] < self._max_output[slot]:
            raise ValueError(f"slot {slot} has not finished")
        self._max_output[slot] = 0
        self._output[slot] = 0
        self._hashes[slot] = []
        self._free_slots.append(slot)

    def abort(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} out of range")
        if self._batch:
            raise ValueError("cannot abort while a batch is scheduled; commit() first")
        if self._output[slot] >= self._max_output[slot]:
            raise ValueError(f"slot {slot} holds no unfinished request")
        if slot in self._running:
            self._running.remove(slot)
        else:
            self._waiting.remove(slot)
        self._free_all(slot)
        self._computed[slot] = 0
        self._max_output[slot] = 0
        self._output[slot] = 0
        self._hashes[slot] = []
        self._free_slots.append(slot)

    # -- blocks ---------------------------------------------------------------------
    def _take(self, s: int, n: int) -> None:
        """Slot s takes n new blocks (checked free by the caller)."""
        self._blocks[s] += n
        if self._pool is None:
            self.num_free_blocks -= n
            return
        self._table[s] += self._pool.get_new_blocks(n)
        self.num_free_blocks = len(self._pool.free)

    def _free_all(self, s: int) -> None:
        """Slot s's blocks back to the pool, its last block first."""
        if self._pool is None:
            self.num_free_blocks += self._blocks[s]
        else:
            self._pool.free_blocks(reversed(self._table[s]))
            self._table[s] = []
            self._num_cached[s] = 0
            self.num_free_blocks = len(self._pool.free)
        self._blocks[s] = 0

    def _lookup(self, s: int) -> list[int] | None:
        """The blocks of slot s's longest cached prefix, stopping one token short of its
        known tokens (vLLM computes at least the last one again); None when no lookup
        applies (no pool, no hashes, or tokens already computed)."""
        if self._pool is None or not self._hashes[s] or self._computed[s] > 0:
            return None
        max_blocks = (self._prompt[s] + self._output[s] - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._hashes[s][:max_blocks]:
            block = self._pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _admit_cached(self, s: int, hits: list[int]) -> None:
        """Slot s, admitted, holds its cached blocks; the counters count it."""
        assert self._pool is not None
        self._pool.touch(hits)
        self.num_free_blocks = len(self._pool.free)
        self._table[s] = list(hits)
        self._blocks[s] = self._num_cached[s] = len(hits)
        self._computed[s] = len(hits) * self.block_size
        self.prefix_cache_queries += self._prompt[s] + self._output[s]
        self.prefix_cache_hits += len(hits) * self.block_size
        if self._preempt[s] == 0:
            self._cached_tokens[s] = len(hits) * self.block_size

    def _cache_scheduled(self, s: int, new: int) -> None:
        """Register the full prompt blocks the batch being formed fills."""
        if self._pool is None or self._num_cached[s] >= len(self._hashes[s]):
            return
        full = min((self._computed[s] + new) // self.block_size, len(self._hashes[s]))
        for i in range(self._num_cached[s], full):
            self._pool.cache_block(self._table[s][i], self._hashes[s][i])
        self._num_cached[s] = max(self._num_cached[s], full)

    # -- one step -------------------------------------------------------------------
    def _preempt_last(self) -> int:
        v = self._running.pop()
        self._free_all(v)
        self._computed[v] = 0
        self._preempt[v] += 1
        self._waiting.insert(0, v)
        self._preempted.append(v)
        return v

    def _needs(self, s: int, budget: int) -> tuple[int, int]:
        """(tokens to schedule, extra blocks needed) for slot s under the budget."""
        need = self._prompt[s] + self._output[s] - self._computed[s]
        new = min(need, budget)
        return new, _blocks_for(self._computed[s] + new, self.block_size) - self._blocks[s]

    def _needs_waiting(self, s: int, budget: int, hits: list[int]) -> tuple[int, int]:
        """(tokens to schedule, free blocks taken) for waiting slot s with these cached
        blocks: new blocks, plus the cached ones that sit in the free queue (counted
        once per occurrence, as vLLM counts them)."""
        assert self._blocks[s] == 0
        computed = self._computed[s] + len(hits) * self.block_size
        new = min(self._prompt[s] + self._output[s] - computed, budget)
        fresh = _blocks_for(computed + new, self.block_size) - len(hits)
        pool = self._pool
        evictable = 0 if pool is None else sum(pool.ref[b] == 0 for b in hits)
        return new, fresh + evictable

    def _record(self, s: int, new: int, sums: list[float]) -> None:
        ctx = self._computed[s]
        is_decode = int(self._output[s] > 0 and ctx == self._prompt[s] + self._output[s] - 1)
        self._batch.append((s, new, ctx, is_decode))
        sums[0] += 1.0
        sums[1] += new
        if is_decode:
            sums[2] += 1.0
            sums[3] += ctx
        else:
            sums[4] += new
            sums[5] += float(new) * ctx + float(new) * (new + 1) / 2.0
            sums[6] += 1.0
            sums[7] += ctx

    def _schedule_running(self, budget: int, sums: list[float]) -> int:
        i = 0
        while i < len(self._running) and budget > 0:
            s = self._running[i]
            new, req_blocks = self._needs(s, budget)
            victim = -1
            while req_blocks > self.num_free_blocks and victim != s:
                victim = self._preempt_last()
            if victim == s:
                break
            self._take(s, max(req_blocks, 0))
            self._cache_scheduled(s, new)
            self._record(s, new, sums)
            budget -= new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, sums: list[float]) -> int:
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            s = self._waiting[0]
            hits = self._lookup(s)
            new, req_blocks = self._needs_waiting(s, budget, hits or [])
            if req_blocks > self.num_free_blocks:
                break
            self._waiting.pop(0)
            self._running.append(s)
            if hits is not None:
                self._admit_cached(s, hits)
            self._take(s, _blocks_for(self._computed[s] + new, self.block_size)
                       - self._blocks[s])
            self._cache_scheduled(s, new)
            self._record(s, new, sums)
            budget -= new
        return budget

    def _check_step(self, budget: int) -> None:
        assert budget >= 0
        assert len(self._running) <= self.max_num_seqs
        assert 0 <= self.num_free_blocks <= self.num_kv_blocks
        if self._pool is not None:
            assert self.num_free_blocks == len(self._pool.free)
            assert all(len(self._table[s]) == self._blocks[s] for s in range(self.capacity))

    def schedule(self) -> tuple[int, Sums]:
        self._batch = []
        self._preempted = []
        sums = [0.0] * NUM_SUMS
        budget = self._schedule_running(self.max_num_batched_tokens, sums)
        if not self._preempted:
            budget = self._schedule_waiting(budget, sums)
        self._check_step(budget)
        return len(self._batch), (sums[0], sums[1], sums[2], sums[3],
                                  sums[4], sums[5], sums[6], sums[7])

    def commit(self) -> int:
        self._events = []
        for s, new, _ctx, _dec in self._batch:
            self._computed[s] += new
            if self._computed[s] == self._prompt[s] + self._output[s]:
                self._output[s] += 1
                flags = FIRST_TOKEN if self._output[s] == 1 else 0
                if self._output[s] >= self._max_output[s]:
                    flags |= FINISHED
                    self._free_all(s)
                if flags:
                    self._events.append((s, flags))
        if self._events:
            self._running = [s for s in self._running if self._output[s] < self._max_output[s]]
        self._batch = []
        return len(self._events)

    # -- views ----------------------------------------------------------------------
    def snapshot(
        self, predicted_by_slot: IntArray, id_by_slot: IntArray
    ) -> tuple[IntArray, IntArray, int, int, IntArray]:
        if predicted_by_slot.shape[0] < self.capacity or id_by_slot.shape[0] < self.capacity:
            raise ValueError("predicted_by_slot and id_by_slot must cover the slot table")
        slots = self._running + self._waiting
        table = np.array(
            [(self._prompt[s], self._output[s], int(predicted_by_slot[s]), self._computed[s],
              self._blocks[s]) for s in slots], dtype=np.int64).reshape(len(slots), 5)
        # a waiting request counts as computed the prefix it would find cached now
        for r, s in enumerate(self._waiting, start=len(self._running)):
            hits = self._lookup(s)
            if hits:
                table[r, 3] = len(hits) * self.block_size
        inflight = np.array([(self._running.index(s), new) for s, new, _c, _d in self._batch],
                            dtype=np.int64).reshape(len(self._batch), 2)
        return (table, id_by_slot[np.array(slots, dtype=np.int64)], len(self._running),
                self.num_free_blocks, inflight)

    def events(self) -> tuple[IntArray, IntArray]:
        slots = np.array([s for s, _ in self._events], dtype=np.int64)
        flags = np.array([f for _, f in self._events], dtype=np.int64)
        return slots, flags

    def event_list(self) -> list[tuple[int, int]]:
        return list(self._events)

    def batch(self) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        cols = list(zip(*self._batch, strict=True)) if self._batch else [(), (), (), ()]
        slots, tokens, ctx, dec = (np.array(c, dtype=np.int64) for c in cols)
        return slots, tokens, ctx, dec

    def preempted(self) -> IntArray:
        return np.array(self._preempted, dtype=np.int64)

    def running(self) -> IntArray:
        return np.array(self._running, dtype=np.int64)

    def waiting(self) -> IntArray:
        return np.array(self._waiting, dtype=np.int64)

    def request(self, slot: int) -> tuple[int, int, int, int, int, int]:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} out of range")
        return (self._prompt[slot], self._output[slot], self._max_output[slot],
                self._computed[slot], self._blocks[slot], self._preempt[slot])

    def prefix_state(self, slot: int) -> tuple[int, int, int]:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} out of range")
        return len(self._hashes[slot]), self._num_cached[slot], self._cached_tokens[slot]

    def free_queue(self) -> tuple[list[tuple[int, int]], int]:
        if self._pool is None:
            return [], self.num_free_blocks
        return self._pool.free_queue()

    def cache_contents(self) -> list[tuple[int, int]]:
        return [] if self._pool is None else self._pool.contents()

    def take_kv_events(self) -> tuple[IntArray, IntArray, int]:
        if self._kv_log is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
        return self._kv_log.take()

    @property
    def kv_events(self) -> bool:
        return self._kv_log is not None

    @property
    def prefix_caching(self) -> bool:
        return self._pool is not None

    @property
    def num_cached_blocks(self) -> int:
        return 0 if self._pool is None else self._pool.num_cached_blocks()

    @property
    def num_evictable_blocks(self) -> int:
        return 0 if self._pool is None else self._pool.num_evictable_blocks()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)


def _batch_time(beta: tuple[float, float, float, float] | list[float], sums: list[float]) -> float:
    return beta[0] + beta[1] * sums[1] + beta[2] * sums[3] + beta[3] * sums[5]


def _replay_engine(table: IntArray, limits: tuple[int, int, int, int],
                   ex: list[tuple[int, int, float, int]]
                   ) -> tuple[ReferenceCore, list[tuple[int, int, int, int, int]]]:
    """A core without a prefix cache holding the snapshot's rows, then the later
    dispatches' (prompt, decode, dispatch time, cached), in its first slots; a slot
    left for the new request."""
    total, block_size, max_num_seqs, budget = limits
    core = ReferenceCore(total, block_size, max_num_seqs, budget,
                         capacity=table.shape[0] + len(ex) + 1, prefix_caching=False)
    rows = [(int(r[0]), int(r[1]), int(r[2]) if r[2] > r[1] else int(r[1]) + 1,
             int(r[3]), int(r[4])) for r in table]
    rows += [(p, 0, d, c, 0) for p, d, _t, c in ex]
    for s, (prompt, out, mx, computed, blocks) in enumerate(rows):
        core._prompt[s], core._output[s], core._max_output[s] = prompt, out, mx
        core._computed[s], core._blocks[s] = computed, blocks
    return core, rows


def replay_ttft_reference(
    table: IntArray,
    num_running: int,
    num_free_blocks: int,
    inflight: IntArray,
    inflight_start_s: float,
    snapshot_time_s: float,
    limits: tuple[int, int, int, int],
    beta: list[float],
    new_prompt: int,
    new_decode: int,
    now_s: float,
    extras: npt.NDArray[np.float64] | None = None,
    max_batches: int = 200_000,
    new_cached: int = 0,
) -> tuple[float, float, int]:
    """Plain-Python twin of ``_core.replay_ttft`` for one instance: (ttft, wait, batches).

    Same steps: the in-flight batch completes; a stale snapshot is replayed up to now
    without the new request, the router's later dispatches (prompt, decode, dispatch
    time, and optionally their cached prompt tokens) joining the queue at their dispatch
    times; then the new request, its first ``new_cached`` prompt tokens computed (at most
    all but its last)."""
    ex = [] if extras is None else [
        (int(e[0]), max(int(e[1]), 1), float(e[2]),
         max(min(int(e[3]), int(e[0]) - 1), 0) if len(e) > 3 else 0) for e in extras]
    core, rows = _replay_engine(table, limits, ex)
    core._running = list(range(num_running))
    core._waiting = list(range(num_running, table.shape[0]))
    core._free_slots = []
    core.num_free_blocks = num_free_blocks
    t = snapshot_time_s
    if len(inflight):
        sums = [0.0] * NUM_SUMS
        for row, new in inflight:
            core._record(int(row), int(new), sums)
        t = max(inflight_start_s + _batch_time(beta, sums), snapshot_time_s)
        core.commit()
    n = 0
    released = 0
    while n < max_batches:
        while released < len(ex) and ex[released][2] <= t:
            core._waiting.append(table.shape[0] + released)
            released += 1
        if t >= now_s:
            break
        k, sums_t = core.schedule()
        if k == 0:
            if released < len(ex) and ex[released][2] < now_s:
                t = ex[released][2]
                continue
            break
        t += _batch_time(beta, list(sums_t))
        core.commit()
        n += 1
    core._waiting.extend(range(table.shape[0] + released, table.shape[0] + len(ex)))
    t = max(t, now_s)
    new_slot = len(rows)
    core._prompt[new_slot], core._output[new_slot] = new_prompt, 0
    core._max_output[new_slot] = max(new_decode, 1)
    core._computed[new_slot] = max(min(new_cached, new_prompt - 1), 0)
    core._blocks[new_slot] = 0
    core._waiting.append(new_slot)
    wait = -1.0
    n = 0
    while n < max_batches:
        k, sums_t = core.schedule()
        if k == 0:
            break
        n += 1
        if wait < 0 and any(s == new_slot for s, _n, _c, _d in core._batch):
            wait = t - now_s
        t += _batch_time(beta, list(sums_t))
        core.commit()
        if core._output[new_slot] > 0:
            return t - now_s, wait, n
    return float("inf"), float("inf"), n
