"""One simulated serving instance: the batch-formation core timed by a ground truth."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from olproute._core import BatchCore
from olproute.core_ref import (
    FINISHED,
    FIRST_TOKEN,
    KV_REMOVED,
    KV_STORED,
    IntArray,
    ReferenceCore,
    Sums,
)
from olproute.types import BATCH_LOG_COLUMNS, EngineSnapshot, InstanceLoad, InstanceSpec

BatchTimer = Callable[[Sequence[float]], float]


class Core(Protocol):
    """What the engine needs of a batch-formation core (compiled or reference)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    def add_request(self, prompt_tokens: int, max_output_tokens: int,
                    computed_tokens: int = 0,
                    block_hashes: IntArray | None = None) -> int: ...
    def release_slot(self, slot: int) -> None: ...
    def abort(self, slot: int) -> None: ...
    def schedule(self) -> tuple[int, Sums]: ...
    def commit(self) -> int: ...
    def event_list(self) -> list[tuple[int, int]]: ...
    def batch(self) -> tuple[IntArray, IntArray, IntArray, IntArray]: ...
    def request(self, slot: int) -> tuple[int, int, int, int, int, int]: ...
    def prefix_state(self, slot: int) -> tuple[int, int, int]: ...
    def cache_contents(self) -> list[tuple[int, int]]: ...
    def take_kv_events(self) -> tuple[IntArray, IntArray, int]: ...
    def snapshot(
        self, predicted_by_slot: IntArray, id_by_slot: IntArray
    ) -> tuple[IntArray, IntArray, int, int, IntArray]: ...
    @property
    def capacity(self) -> int: ...


def make_core(spec: InstanceSpec, reference: bool = False, kv_events: bool = False) -> Core:
    """The instance's core; ``kv_events``: it logs its prefix cache's events."""
    cls: type[BatchCore] | type[ReferenceCore] = ReferenceCore if reference else BatchCore
    return cls(spec.num_kv_blocks, spec.block_size, spec.max_num_seqs,
               spec.max_num_batched_tokens, prefix_caching=spec.enable_prefix_caching,
               kv_events=kv_events)


class SimEngine:
    """Owns one instance's core; the cluster drives it batch by batch.

    ``start_batch`` forms the next batch and returns its duration in seconds (None when
    there is nothing to run); ``finish_batch`` applies it and returns the requests that
    produced their first token or finished, as (request_id, flags, num_preemptions). For
    a finished request admitted with block hashes, ``cached_prompt_tokens`` then holds its
    prompt tokens found in the prefix cache when it was first admitted (vLLM's
    ``num_cached_tokens``), until the caller pops it. With ``kv_events`` the core logs
    its prefix cache's events, which ``take_kv_events`` hands out (vLLM publishes them
    after each step: the caller takes them after ``finish_batch``).
    """

    def __init__(
        self,
        index: int,
        spec: InstanceSpec,
        timer: BatchTimer,
        batch_log: array[float] | None = None,
        reference_core: bool = False,
        kv_events: bool = False,
    ) -> None:
        self.index = index
        self.spec = spec
        self.core = make_core(spec, reference_core, kv_events)
        self._timer = timer
        self._slot_request: dict[int, int] = {}
        self._predicted = np.zeros(0, dtype=np.int64)   # by slot, for snapshots
        self._request_id = np.zeros(0, dtype=np.int64)  # by slot, for snapshots
        self._log = batch_log
        self.busy = False
        self.batch_start_s = 0.0
        self.num_batches = 0
        self._hashed_slots: set[int] = set()
        self.cached_prompt_tokens: dict[int, int] = {}

    @property
    def num_resident(self) -> int:
        return self.core.num_running + self.core.num_waiting

    def admit(self, request_id: int, prompt_tokens: int, decode_tokens: int,
              predicted_decode_tokens: int, computed_tokens: int = 0,
              block_hashes: IntArray | None = None) -> int:
        """Queue a request and return its core slot; ``decode_tokens`` is the truth the
        engine runs to, ``predicted_decode_tokens`` what snapshots report to the router,
        ``computed_tokens`` the prompt tokens whose KV arrived from a prefill instance,
        ``block_hashes`` its prompt's block hashes for the prefix cache."""
        slot = self.core.add_request(prompt_tokens, decode_tokens, computed_tokens,
                                     block_hashes)
        self._slot_request[slot] = request_id
        if block_hashes is not None and len(block_hashes) > 0:
            self._hashed_slots.add(slot)
        if slot >= self._predicted.shape[0]:
            grown = max(self.core.capacity, 2 * self._predicted.shape[0], 16)
            self._predicted = np.resize(self._predicted, grown)
            self._request_id = np.resize(self._request_id, grown)
        self._predicted[slot] = predicted_decode_tokens
        self._request_id[slot] = request_id
        return slot

    def abort(self, request_id: int) -> None:
        """Drop an unfinished request, freeing its slot and KV blocks (its client went
        away). Only between finish_batch() and the next start_batch(): the core raises
        ValueError while a batch is scheduled. O(resident), aborts being rare."""
        for slot, rid in self._slot_request.items():
            if rid == request_id:
                self.core.abort(slot)
                del self._slot_request[slot]
                self._hashed_slots.discard(slot)
                return
        raise KeyError(f"request {request_id} is not resident")

    def snapshot(self, now_s: float) -> EngineSnapshot:
        """The engine's state now, with the batch in flight (if busy)."""
        if self._predicted.shape[0] < self.core.capacity:
            self._predicted = np.resize(self._predicted, self.core.capacity)
            self._request_id = np.resize(self._request_id, self.core.capacity)
        table, ids, num_running, free, inflight = self.core.snapshot(self._predicted,
                                                                     self._request_id)
        return EngineSnapshot(
            time_s=now_s, table=table, num_running=num_running, num_free_blocks=free,
            inflight=inflight if self.busy else inflight[:0],
            inflight_start_s=self.batch_start_s if self.busy else now_s,
            request_ids=ids)

    def start_batch(self, now_s: float) -> float | None:
        n, sums = self.core.schedule()
        if n == 0:
            self.busy = False
            return None
        self.busy = True
        self.batch_start_s = now_s
        self.num_batches += 1
        duration = self._timer(sums)
        if self._log is not None:
            self._log.extend((float(self.index), now_s, duration))
            self._log.extend(sums)
        return duration

    def finish_batch(self) -> list[tuple[int, int, int]]:
        if self.core.commit() == 0:
            return []
        out = []
        for slot, flags in self.core.event_list():
            preemptions = 0
            if flags & FINISHED:
                preemptions = self.core.request(slot)[5]
                request_id = self._slot_request.pop(slot)
                if slot in self._hashed_slots:
                    self._hashed_slots.remove(slot)
                    self.cached_prompt_tokens[request_id] = self.core.prefix_state(slot)[2]
                self.core.release_slot(slot)
            else:
                request_id = self._slot_request[slot]
            out.append((request_id, flags, preemptions))
        return out

    def take_kv_events(self) -> tuple[IntArray, IntArray, int]:
        """The prefix cache's events since the last take: (kinds KV_STORED or
        KV_REMOVED, block hashes, events dropped past the log's capacity)."""
        return self.core.take_kv_events()

    def cache_contents(self) -> list[tuple[int, int]]:
        """Sorted (block hash, copies cached) of the prefix cache."""
        return self.core.cache_contents()

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens of the requests admitted after a prefix-cache lookup (vLLM's counter)."""
        return self.core.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found in the cache (vLLM's counter)."""
        return self.core.prefix_cache_hits

    def load(self, num_outstanding: int) -> InstanceLoad:
        core = self.core
        return InstanceLoad(
            index=self.index, name=self.spec.name, num_running=core.num_running,
            num_waiting=core.num_waiting, num_outstanding=num_outstanding,
            num_kv_blocks_used=self.spec.num_kv_blocks - core.num_free_blocks,
            num_kv_blocks=self.spec.num_kv_blocks, max_num_seqs=self.spec.max_num_seqs,
        )


__all__ = ["BATCH_LOG_COLUMNS", "FINISHED", "FIRST_TOKEN", "KV_REMOVED", "KV_STORED",
           "BatchTimer", "Core", "SimEngine", "make_core"]
