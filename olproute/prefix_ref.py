"""vLLM v1's block pool as it is, in plain Python: the reference of the prefix cache that
``_core.pyx`` keeps compressed (``_prefix_cache.pxi``).

Every block has an id. The free blocks wait in one queue, least recently freed first; a
new block is popped from its front and, if it still carries a hash, that hash is evicted
with it. A block that a request fills with a full prompt block is registered under the
block's hash and keeps it after the request frees it, so a later request with the same
prefix finds it (and takes it back out of the queue) until it is evicted. Several blocks
may carry one hash (vLLM does not deduplicate); a lookup takes the first one registered
that is still cached. ``core_ref.ReferenceCore`` drives it as the compiled core drives
its compressed twin, and the tests compare the two step by step. With a ``KvEventLog``
the pool logs what vLLM publishes: a block registered (KV_STORED) or evicted
(KV_REMOVED), with its hash, in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

KV_STORED = 1
KV_REMOVED = 2


class KvEventLog:
    """The cache's events between two takes, at most ``capacity`` of them; later ones
    are counted in ``dropped`` and not kept (as ``BatchCore.take_kv_events``)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("kv_events_capacity must be >= 0")
        self.capacity = capacity
        self.events: list[tuple[int, int]] = []
        self.dropped = 0

    def append(self, kind: int, block_hash: int) -> None:
        if len(self.events) < self.capacity:
            self.events.append((kind, block_hash))
        else:
            self.dropped += 1

    def take(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """(kinds, hashes, dropped) since the last take; the log starts afresh."""
        kinds = np.array([k for k, _ in self.events], dtype=np.int64)
        hashes = np.array([h for _, h in self.events], dtype=np.int64)
        dropped = self.dropped
        self.events, self.dropped = [], 0
        return kinds, hashes, dropped


class BlockPool:
    """``num_blocks`` KV blocks: reference counts, the free queue and the hash map."""

    def __init__(self, num_blocks: int, log: KvEventLog | None = None) -> None:
        self.log = log
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}  # hash -> block ids, registration order

    def get_cached_block(self, block_hash: int) -> int | None:
        """The first block registered under ``block_hash`` that is still cached."""
        blocks = self.cached.get(block_hash)
        return next(iter(blocks)) if blocks else None

    def get_new_blocks(self, n: int) -> list[int]:
        """n blocks from the front of the free queue, each referenced once; a block that
        still carries a hash loses it (evicted)."""
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            if self.hash[block] is not None:
                self._evict(block)
            self.ref[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        block_hash = self.hash[block]
        assert block_hash is not None
        del self.cached[block_hash][block]
        if not self.cached[block_hash]:
            del self.cached[block_hash]
        self.hash[block] = None
        if self.log is not None:
            self.log.append(KV_REMOVED, block_hash)

    def touch(self, blocks: Iterable[int]) -> None:
        """A request takes cached blocks: one more reference each, out of the free queue."""
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """One reference less each; a block nobody holds joins the back of the queue, in
        the given order (a request's blocks are freed last first)."""
        for block in ordered:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None

    def cache_block(self, block: int, block_hash: int) -> None:
        """A full prompt block is registered under its hash."""
        assert self.hash[block] is None
        self.hash[block] = block_hash
        self.cached.setdefault(block_hash, {})[block] = None
        if self.log is not None:
            self.log.append(KV_STORED, block_hash)

    def free_queue(self) -> tuple[list[tuple[int, int]], int]:
        """The free queue compressed as ``BatchCore.free_queue`` gives it: (unhashed
        blocks before it, hash) per hashed block, and the unhashed blocks after the last."""
        out: list[tuple[int, int]] = []
        run = 0
        for block in self.free:
            block_hash = self.hash[block]
            if block_hash is None:
                run += 1
            else:
                out.append((run, block_hash))
                run = 0
        return out, run

    def contents(self) -> list[tuple[int, int]]:
        """Sorted (hash, blocks cached under it)."""
        return sorted((h, len(blocks)) for h, blocks in self.cached.items())

    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.cached.values())

    def num_evictable_blocks(self) -> int:
        return sum(self.hash[b] is not None for b in self.free)
