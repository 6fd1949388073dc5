"""What an emulated engine's KV events say about its blocks: vLLM's names of a prompt's
full blocks (``olproute.routing.block_hash``: token ids of ``WordTokenizer`` or the
request's own, ``BlockHasher`` digests), and the book that turns the core's event log
(``BatchCore.take_kv_events``: KV_STORED / KV_REMOVED of ``block_key`` ints) into vLLM's
events (``olproute.routing.kv_events``) with the full digests, parents and token ids.

The core knows a block only by its 63-bit key; the book keeps, per key, the digest, its
parent's digest and the block's token ids while anything may still need them: the copies
the cache holds (vLLM does not deduplicate: one event per physical block) and the resident
requests that named it (``hold`` / ``release``). So it holds at most one entry per cached
block plus one per block of the resident requests' prompts, and the events of any commit
find their names. A stored run whose blocks chain (each one's parent the one before) is
one ``BlockStored``, as vLLM sends a request's new blocks of a step; every removed block
is a ``BlockRemoved`` of its own, as vLLM sends them. ``KvEventFeed`` is what an engine
holds of all this: its namer, its book, and where each commit's batch goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from olproute.core_ref import KV_STORED
from olproute.routing.block_hash import BlockHasher, PromptTokenizer
from olproute.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    block_key,
)
from olproute.routing.prefix_index import IntArray

MEDIUM = "GPU"   # what vLLM's CPU build reports too (tests/data/kv_events)


@dataclass(frozen=True, slots=True)
class NamedBlocks:
    """A prompt's full blocks as its engine names them: ``keys`` (``block_key`` of each
    digest, what the core holds), ``digests`` (32 bytes each) and the token ids of those
    blocks (``len(keys) * block_size`` of them)."""

    keys: IntArray
    digests: tuple[bytes, ...]
    token_ids: tuple[int, ...]


class BlockNamer:
    """A prompt's ``NamedBlocks`` with one tokenizer, hash setting and block size."""

    __slots__ = ("block_size", "hasher", "tokenizer")

    def __init__(self, tokenizer: PromptTokenizer, hasher: BlockHasher,
                 block_size: int) -> None:
        self.tokenizer, self.hasher, self.block_size = tokenizer, hasher, block_size

    def name(self, text: str | None, ids: Sequence[int] | None,
             chat: Sequence[Mapping[str, Any]] | None, max_blocks: int) -> NamedBlocks | None:
        """At most ``max_blocks`` full blocks of the chat's rendering, else the token ids,
        else the text's; None with no prompt."""
        if chat is not None:
            tokens = self.tokenizer.encode_chat(chat)
        elif ids is not None:
            tokens = [int(t) for t in ids]
        elif text is not None:
            tokens = self.tokenizer.encode(text)
        else:
            return None
        digests = self.hasher.digests(tokens, self.block_size, max_blocks)
        keys = np.fromiter((block_key(d) for d in digests), dtype=np.int64,
                           count=len(digests))
        keys.setflags(write=False)
        return NamedBlocks(keys, tuple(digests),
                           tuple(tokens[:len(digests) * self.block_size]))


class _Entry:
    __slots__ = ("copies", "digest", "holds", "parent", "token_ids")

    def __init__(self, digest: bytes, parent: bytes | None, token_ids: tuple[int, ...]):
        self.digest, self.parent, self.token_ids = digest, parent, token_ids
        self.copies = 0   # physical blocks the cache holds under this key
        self.holds = 0    # resident requests whose prompt names it


class BlockBook:
    """Key -> (digest, parent, token ids) of what the cache holds or a resident request
    named (module docstring); ``events`` names the core's log."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._entries: dict[int, _Entry] = {}
        self.num_unnamed = 0   # events of keys nobody named (none expected), skipped

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, named: NamedBlocks) -> None:
        """A request naming these blocks is resident."""
        bs = self.block_size
        parent: bytes | None = None
        for i, key in enumerate(named.keys.tolist()):
            e = self._entries.get(key)
            if e is None:
                e = self._entries[key] = _Entry(named.digests[i], parent,
                                                named.token_ids[i * bs:(i + 1) * bs])
            e.holds += 1
            parent = named.digests[i]

    def release(self, named: NamedBlocks) -> None:
        """That request left (its stored blocks stay as long as the cache holds them)."""
        for key in named.keys.tolist():
            e = self._entries.get(key)
            if e is not None:
                e.holds -= 1
                self._forget_if_unused(key, e)

    def _forget_if_unused(self, key: int, e: _Entry) -> None:
        if e.copies <= 0 and e.holds <= 0:
            del self._entries[key]

    def copies(self) -> dict[int, int]:
        """Key -> copies cached, of every key with at least one."""
        return {k: e.copies for k, e in self._entries.items() if e.copies > 0}

    def events(self, kinds: IntArray, hashes: IntArray) -> list[KvEvent]:
        """The core's log (in order) as vLLM's events; the copies follow it."""
        out: list[KvEvent] = []
        run: list[_Entry] = []
        for kind, key in zip(kinds.tolist(), hashes.tolist(), strict=True):
            e = self._entries.get(key)
            if e is None:
                self.num_unnamed += 1
                continue
            if kind == KV_STORED:
                e.copies += 1
                if run and e.parent != run[-1].digest:
                    out.append(self._stored(run))
                    run = []
                run.append(e)
                continue
            if run:
                out.append(self._stored(run))
                run = []
            e.copies -= 1
            out.append(BlockRemoved(block_hashes=[e.digest], medium=MEDIUM))
            self._forget_if_unused(key, e)
        if run:
            out.append(self._stored(run))
        return out

    def resync(self, contents: Sequence[tuple[int, int]]) -> list[KvEvent]:
        """After an overflowed log: the copies set to the cache's ``contents`` (sorted
        (key, copies)), and the events that say so: ``AllBlocksCleared``, then a
        ``BlockStored`` per cached copy."""
        held = dict(contents)
        for key, e in list(self._entries.items()):
            e.copies = held.get(key, 0)
            self._forget_if_unused(key, e)
        out: list[KvEvent] = [AllBlocksCleared()]
        for key, n in contents:
            found = self._entries.get(key)
            if found is None:
                self.num_unnamed += 1
                continue
            out.extend(self._stored([found]) for _ in range(n))
        return out

    def _stored(self, run: list[_Entry]) -> BlockStored:
        return BlockStored(block_hashes=[e.digest for e in run],
                           parent_block_hash=run[0].parent,
                           token_ids=[t for e in run for t in e.token_ids],
                           block_size=self.block_size, lora_id=None, medium=MEDIUM,
                           lora_name=None)


class KvEventFeed:
    """One engine's KV events: names its prompts (``namer``), keeps the names of its
    resident requests in the ``book`` (``admitted`` / ``left``), and turns each take of
    its core's log into one published batch (``commit``)."""

    def __init__(self, namer: BlockNamer, publish: Callable[[Sequence[KvEvent]], object]
                 ) -> None:
        self.namer = namer
        self.book = BlockBook(namer.block_size)
        self._publish = publish
        self._named: dict[int, NamedBlocks] = {}

    def admitted(self, request_id: int, named: NamedBlocks) -> None:
        self.book.hold(named)
        self._named[request_id] = named

    def left(self, request_id: int) -> None:
        """The request finished, was aborted or dropped (after the take that covers its
        last commit)."""
        named = self._named.pop(request_id, None)
        if named is not None:
            self.book.release(named)

    def commit(self, kinds: IntArray, hashes: IntArray, dropped: int,
               contents: Callable[[], Sequence[tuple[int, int]]]) -> None:
        """One take of the core's log published as a batch; an overflowed one (``dropped``
        > 0) as the cache's ``contents`` instead. Nothing when there is nothing."""
        if dropped > 0:
            events = self.book.resync(contents())
        elif len(kinds) > 0:
            events = self.book.events(kinds, hashes)
        else:
            return
        if events:
            self._publish(events)

    def close(self) -> None:
        """Every request left (the engine stopped)."""
        for request_id in list(self._named):
            self.left(request_id)
