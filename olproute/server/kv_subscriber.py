"""One backend's KV-events stream (``olproute.routing.kv_events``) into the router's prefix
index, which for that backend is then exact: what the engine says it holds.

A ``KvSubscriber`` runs as a task on the event loop, on ZMQ's asyncio sockets, so it never
blocks the loop: a publisher that is slow, silent or gone only leaves the index as it
last was, and ``age_s`` (seconds since its last batch) says how stale that is.

**Sequence numbers.** Batches are numbered from 0 by the publisher. A batch after a gap
(its number more than one past the last applied) first asks the replay socket for the
missing ones (a DEALER to vLLM's ROUTER; at most ``replay_timeout_s``); if the replay
covers the gap, they are applied in order (``gaps_replayed``), else the index of that
backend is emptied, so that it errs by misses, never by a hit the engine cannot give
(``gaps_lost``). The first batch seen asks for the history before it the same way. A
number at or below the last applied means the engine started again (its publisher counts
from 0): the backend's entries are dropped and refilled from the new stream
(``restarts``), logged.

**Trust.** A frame that does not decode, or an engine whose block hashes are not those
the router computes (checked on each prompt's first stored block: its token ids hashed
with the configured setting must give the engine's hash), turns the backend back to the
approximate index (``mode`` ``"approximate"``, the reason in ``fallback_reason``, one
error log line naming the backend) and stops the subscription: a misconfigured backend
costs precision, never a crash or a wrong hit. Memory is bounded by the index's capacity
per backend and ZMQ's receive high-water mark.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import zmq
import zmq.asyncio

from olproute.routing.block_hash import BlockHasher
from olproute.routing.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KvEventsError,
    block_key,
    decode_batch,
    decode_message,
    replay_request,
    seq_of,
)
from olproute.routing.prefix_index import PrefixIndex

LOG = logging.getLogger("olproute.server.kv_events")
MAX_REPLAY_MESSAGES = 100_000

Mode = Literal["exact", "approximate"]


class KvSubscriber:
    """Backend ``g`` (named ``name``) of ``index``: its stream at ``endpoint`` (topic
    ``topic``), replays from ``replay_endpoint`` (None: gaps are never filled), hashes
    checked with ``hasher`` (None: not checked)."""

    def __init__(self, name: str, g: int, index: PrefixIndex, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "",
                 hasher: BlockHasher | None = None, replay_timeout_s: float = 2.0,
                 receive_hwm: int = 10_000, context: zmq.asyncio.Context | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_stored: Callable[[int, list[int]], None] | None = None) -> None:
        self.name, self.g, self.index = name, g, index
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode("utf-8")
        self.hasher = hasher
        self.replay_timeout_s = replay_timeout_s
        self.receive_hwm = receive_hwm
        self._ctx = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self.on_stored = on_stored   # (g, keys) of each BlockStored: prefill progress
        self.mode: Mode = "exact"
        self.fallback_reason: str | None = None
        self.last_seq = -1
        self.last_batch_s: float | None = None
        self.batches = self.gaps_replayed = self.gaps_lost = self.restarts = 0
        self.checked = 0
        index.set_exact(g, block_size=index.block_sizes[g])

    def age_s(self) -> float | None:
        """Seconds since the last batch applied (None: none yet)."""
        return None if self.last_batch_s is None else self._clock() - self.last_batch_s

    def status(self) -> dict[str, Any]:
        """What ``/instances`` shows of the stream."""
        return {"mode": self.mode, "fallback_reason": self.fallback_reason,
                "last_seq": self.last_seq, "age_s": self.age_s(), "batches": self.batches,
                "gaps_replayed": self.gaps_replayed, "gaps_lost": self.gaps_lost,
                "restarts": self.restarts}

    async def run(self) -> None:
        """Read the stream until cancelled or fallen back."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.receive_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while self.mode == "exact":
                frames = await sub.recv_multipart()
                await self.on_message(frames)
        finally:
            sub.close(linger=0)

    async def on_message(self, frames: list[bytes]) -> None:
        """One PUB message: decoded, sequenced (gaps replayed, restarts seen), applied."""
        try:
            topic, seq, batch = decode_message(frames)
        except KvEventsError as e:
            self.fall_back(f"a malformed message after seq {self.last_seq}: {e}")
            return
        if topic != self.topic:
            return
        if self.last_seq >= 0 and seq <= self.last_seq:
            self.restarts += 1
            LOG.warning("backend %s: KV events start again at seq %d (last %d): the engine "
                        "restarted; its prefix index is dropped and refilled", self.name,
                        seq, self.last_seq)
            self.index.clear(self.g)
            self.last_seq = -1
        if seq > self.last_seq + 1:
            await self._fill(self.last_seq + 1, seq)
        if self.mode == "exact":
            self.apply(seq, batch)

    async def _fill(self, start: int, stop: int) -> None:
        """Batches ``start`` to ``stop - 1`` from the replay socket, applied in order."""
        got = {} if self.replay_endpoint is None else await self._replay(start)
        wanted = range(start, stop)
        if all(s in got for s in wanted):
            for s in wanted:
                self.apply(s, got[s])
            if start > 0:
                self.gaps_replayed += 1
            return
        if start == 0:   # joined a stream whose start the replay no longer holds
            LOG.info("backend %s: KV events joined at seq %d, history before it not "
                     "replayed: blocks cached earlier stay unknown until used again",
                     self.name, stop)
            return
        self.gaps_lost += 1
        LOG.warning("backend %s: KV events %d-%d lost (not replayed): its prefix index is "
                    "dropped and refilled", self.name, start, stop - 1)
        self.index.clear(self.g)

    async def _replay(self, start: int) -> dict[int, EventBatch]:
        """What the replay socket holds from ``start`` on (empty if it does not answer)."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: dict[int, EventBatch] = {}
        try:
            await sock.send_multipart(replay_request(start))
            for _ in range(MAX_REPLAY_MESSAGES):
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    LOG.warning("backend %s: the KV-events replay socket did not answer "
                                "within %g s", self.name, self.replay_timeout_s)
                    break
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    raise KvEventsError(f"a replay message of {len(frames)} frames")
                seq = seq_of(frames[2])
                if seq == END_SEQ:
                    break
                out[seq] = decode_batch(frames[3])
        except KvEventsError as e:
            LOG.warning("backend %s: a malformed replay (%s); the gap counts as lost",
                        self.name, e)
            return {}
        finally:
            sock.close(linger=0)
        return out

    def apply(self, seq: int, batch: EventBatch) -> None:
        """One batch's events into the index."""
        for e in batch.events:
            if isinstance(e, BlockStored):
                if not self._check(e):
                    return
                keys = [block_key(h) for h in e.block_hashes]
                self.index.stored(self.g, keys)
                if self.on_stored is not None:
                    self.on_stored(self.g, keys)
            elif isinstance(e, AllBlocksCleared):
                self.index.clear(self.g)
            else:
                self.index.removed(self.g, (block_key(h) for h in e.block_hashes))
        self.last_seq = seq
        self.batches += 1
        self.last_batch_s = self._clock()

    def _check(self, e: BlockStored) -> bool:
        """A prompt's first stored blocks hashed as the router hashes them must be the
        engine's (a few checks, then trusted); False (and fallen back) if not."""
        bs = self.index.block_sizes[self.g]
        if e.block_size != bs:
            self.fall_back(f"the engine's blocks are of {e.block_size} tokens, the router "
                           f"names blocks of {bs}")
            return False
        if self.hasher is None or e.parent_block_hash is not None or self.checked >= 8 \
                or len(e.token_ids) < bs:
            return True
        self.checked += 1
        ours = self.hasher.keys(e.token_ids[:bs], bs).tolist()
        if ours != [block_key(e.block_hashes[0])]:
            self.fall_back(f"the engine's block hashes are not {self.hasher.algo} with seed "
                           f"{self.hasher.seed!r}: set the backend's kv_events.hash_algo and "
                           "hash_seed as the engine runs (--prefix-caching-hash-algo, "
                           "PYTHONHASHSEED) and its tokenizer")
            return False
        return True

    def fall_back(self, reason: str) -> None:
        """Turn this backend back to the approximate index, for good, saying why."""
        if self.mode == "approximate":
            return
        self.mode = "approximate"
        self.fallback_reason = reason
        self.index.set_exact(self.g, exact=False)
        LOG.error("backend %s: KV events not used, its prefix index is approximate again: "
                  "%s", self.name, reason)

