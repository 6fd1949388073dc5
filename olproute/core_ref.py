"""Plain-Python reference of the batch-formation kernel in ``_core.pyx``.

It follows the compiled kernel rule for rule and exposes the same methods, so tests can
drive both with the same operations and assert they agree exactly. It is the readable
statement of the scheduling rules; the compiled one is the fast one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FIRST_TOKEN = 1
FINISHED = 2
NUM_SUMS = 8

Sums = tuple[float, float, float, float, float, float, float, float]
IntArray = npt.NDArray[np.int64]


def _blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


class ReferenceCore:
    """Same contract as ``olproute._core.BatchCore``; see its docstrings."""

    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        capacity: int = 256,
    ) -> None:
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
        self._grow(max(capacity, 1))

    def _grow(self, new_capacity: int) -> None:
        extra = new_capacity - self.capacity
        for table in (self._prompt, self._output, self._max_output, self._computed,
                      self._blocks, self._preempt):
            table.extend([0] * extra)
        self._free_slots.extend(range(new_capacity - 1, self.capacity - 1, -1))
        self.capacity = new_capacity

    # -- requests -------------------------------------------------------------------
    def add_request(self, prompt_tokens: int, max_output_tokens: int) -> int:
        if prompt_tokens < 1 or max_output_tokens < 1:
            raise ValueError("prompt_tokens and max_output_tokens must be >= 1")
        if _blocks_for(prompt_tokens + max_output_tokens, self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"request of {prompt_tokens}+{max_output_tokens} tokens exceeds the KV capacity "
                f"of {self.num_kv_blocks * self.block_size} tokens"
            )
        if not self._free_slots:
            self._grow(self.capacity * 2)
        s = self._free_slots.pop()
        self._prompt[s] = prompt_tokens
        self._output[s] = 0
        self._max_output[s] = max_output_tokens
        self._computed[s] = 0
        self._blocks[s] = 0
        self._preempt[s] = 0
        self._waiting.append(s)
        return s

    def release_slot(self, slot: int) -> None:
        if self._output[slot] < self._max_output[slot]:
            raise ValueError(f"slot {slot} has not finished")
        self._max_output[slot] = 0
        self._output[slot] = 0
        self._free_slots.append(slot)

    # -- one step -------------------------------------------------------------------
    def _preempt_last(self) -> int:
        v = self._running.pop()
        self.num_free_blocks += self._blocks[v]
        self._blocks[v] = 0
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
            self.num_free_blocks -= max(req_blocks, 0)
            self._blocks[s] += max(req_blocks, 0)
            self._record(s, new, sums)
            budget -= new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, sums: list[float]) -> int:
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            s = self._waiting[0]
            new, req_blocks = self._needs(s, budget)
            if req_blocks > self.num_free_blocks:
                break
            self._waiting.pop(0)
            self._running.append(s)
            self.num_free_blocks -= req_blocks
            self._blocks[s] += req_blocks
            self._record(s, new, sums)
            budget -= new
        return budget

    def _check_step(self, budget: int) -> None:
        assert budget >= 0
        assert len(self._running) <= self.max_num_seqs
        assert 0 <= self.num_free_blocks <= self.num_kv_blocks

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
                    self.num_free_blocks += self._blocks[s]
                    self._blocks[s] = 0
                if flags:
                    self._events.append((s, flags))
        if self._events:
            self._running = [s for s in self._running if self._output[s] < self._max_output[s]]
        self._batch = []
        return len(self._events)

    # -- views ----------------------------------------------------------------------
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

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
