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
    def add_request(self, prompt_tokens: int, max_output_tokens: int,
                    computed_tokens: int = 0) -> int:
        if prompt_tokens < 1 or max_output_tokens < 1:
            raise ValueError("prompt_tokens and max_output_tokens must be >= 1")
        if computed_tokens < 0 or computed_tokens >= prompt_tokens:
            raise ValueError("computed_tokens must be >= 0 and < prompt_tokens")
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
        self._computed[s] = computed_tokens
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
        self.num_free_blocks += self._blocks[slot]
        self._blocks[slot] = 0
        self._computed[slot] = 0
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
    def snapshot(
        self, predicted_by_slot: IntArray, id_by_slot: IntArray
    ) -> tuple[IntArray, IntArray, int, int, IntArray]:
        if predicted_by_slot.shape[0] < self.capacity or id_by_slot.shape[0] < self.capacity:
            raise ValueError("predicted_by_slot and id_by_slot must cover the slot table")
        slots = self._running + self._waiting
        table = np.array(
            [(self._prompt[s], self._output[s], int(predicted_by_slot[s]), self._computed[s],
              self._blocks[s]) for s in slots], dtype=np.int64).reshape(len(slots), 5)
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

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)


def _batch_time(beta: tuple[float, float, float, float] | list[float], sums: list[float]) -> float:
    return beta[0] + beta[1] * sums[1] + beta[2] * sums[3] + beta[3] * sums[5]


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
) -> tuple[float, float, int]:
    """Plain-Python twin of ``_core.replay_ttft`` for one instance: (ttft, wait, batches).

    Same steps: the in-flight batch completes; a stale snapshot is replayed up to now
    without the new request, the router's later dispatches (prompt, decode, dispatch
    time) joining the queue at their dispatch times; then the new request."""
    total, block_size, max_num_seqs, budget = limits
    ex = [] if extras is None else [(int(p), max(int(d), 1), float(t)) for p, d, t in extras]
    core = ReferenceCore(total, block_size, max_num_seqs, budget,
                         capacity=table.shape[0] + len(ex) + 1)
    rows = [(int(r[0]), int(r[1]), int(r[2]) if r[2] > r[1] else int(r[1]) + 1,
             int(r[3]), int(r[4])) for r in table]
    rows += [(p, 0, d, 0, 0) for p, d, _t in ex]
    for s, (prompt, out, mx, computed, blocks) in enumerate(rows):
        core._prompt[s], core._output[s], core._max_output[s] = prompt, out, mx
        core._computed[s], core._blocks[s] = computed, blocks
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
    core._computed[new_slot] = core._blocks[new_slot] = 0
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
