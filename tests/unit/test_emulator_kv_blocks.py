"""The emulator's names for its cache's blocks (``olproute.emulator.kv_blocks``) and its
publisher (``olproute.emulator.kv_publisher``): names are vLLM's (the router's
``PromptNamer`` gives the same keys), the book turns a real core's event log into vLLM's
events whose tally is the cache's contents (runs of a prompt's new blocks in one
``BlockStored``, one ``BlockRemoved`` per block), an overflowed log resyncs, the book
forgets what nobody holds, and the publisher numbers batches and replays the last ones
it keeps as vLLM's ROUTER does."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import numpy as np
import zmq
import zmq.asyncio

from olproute._core import FINISHED, BatchCore
from olproute.emulator.kv_blocks import BlockBook, BlockNamer, NamedBlocks
from olproute.emulator.kv_publisher import KvPublisher
from olproute.routing.block_hash import BlockHasher, PromptNamer, WordTokenizer
from olproute.routing.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    block_key,
    decode_message,
    replay_request,
    seq_of,
)
from tests.conftest import HANG_S

BLOCK = 4
NAMER = BlockNamer(WordTokenizer(), BlockHasher("sha256"), BLOCK)


def _text(prefix: int, tail: int, rng: random.Random) -> str:
    return " ".join([f"s{j}" for j in range(prefix)]
                    + [f"t{rng.randrange(1000)}" for _ in range(tail)])


def test_names_are_the_routers() -> None:
    router = PromptNamer(WordTokenizer(), BlockHasher("sha256"), BLOCK)
    text = " ".join(f"w{i}" for i in range(19))
    named = NAMER.name(text, None, None, 10)
    assert named is not None and len(named.keys) == 19 // BLOCK
    assert named.keys.tolist() == router.keys(text).tolist()  # type: ignore[union-attr]
    assert named.token_ids == tuple(WordTokenizer().encode(text)[:16])
    assert [block_key(d) for d in named.digests] == named.keys.tolist()
    capped = NAMER.name(text, None, None, 2)
    assert capped is not None and capped.keys.tolist() == named.keys[:2].tolist()
    ids = list(range(9))
    by_ids = NAMER.name("ignored", ids, None, 10)
    assert by_ids is not None and by_ids.token_ids == tuple(range(8))
    chat = [{"role": "user", "content": text}]
    by_chat = NAMER.name(text, None, chat, 10)
    assert by_chat is not None
    assert by_chat.keys.tolist() == router.keys(None, None, chat).tolist()[:10]  # type: ignore[union-attr]
    assert NAMER.name(None, None, None, 10) is None


def _drive(core: BatchCore, book: BlockBook, rng: random.Random, steps: int,
           named: dict[int, NamedBlocks]) -> list[list[KvEvent]]:
    """Seeded shared-prefix requests on a small core, the book fed as the emulator feeds
    it; each commit's events."""
    batches: list[list[KvEvent]] = []
    for _ in range(steps):
        if core.num_running + core.num_waiting < 6 and rng.random() < 0.7:
            text = _text(rng.choice((8, 12)), rng.randint(0, 9), rng)
            n = len(text.split())
            blocks = NAMER.name(text, None, None, n // BLOCK)
            assert blocks is not None
            slot = core.add_request(n, rng.randint(1, 6), 0, blocks.keys)
            book.hold(blocks)
            named[slot] = blocks
        if core.schedule()[0] == 0:
            continue
        core.commit()
        kinds, hashes, dropped = core.take_kv_events()
        batches.append(book.resync(core.cache_contents()) if dropped
                       else book.events(kinds, hashes))
        for slot, flags in core.event_list():
            if flags & FINISHED:
                core.release_slot(slot)
                book.release(named.pop(slot))
    return batches


def _tally(batches: list[list[KvEvent]]) -> dict[int, int]:
    held: Counter[int] = Counter()
    for events in batches:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockStored):
                held.update(block_key(h) for h in e.block_hashes)
            else:
                held.subtract(block_key(h) for h in e.block_hashes)
    return {k: n for k, n in held.items() if n}


def test_the_books_events_add_up_to_the_cache() -> None:
    core = BatchCore(24, BLOCK, 4, 16, prefix_caching=True, kv_events=True)
    book = BlockBook(BLOCK)
    named: dict[int, NamedBlocks] = {}
    batches = _drive(core, book, random.Random(3), 400, named)
    events = [e for b in batches for e in b]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    assert any(len(e.block_hashes) > 1 for e in events if isinstance(e, BlockStored))
    hasher = BlockHasher("sha256")
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert isinstance(parent, bytes | None)
                assert hasher.block(parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK]) == h
                parent = h
    contents = dict(core.cache_contents())
    assert _tally(batches) == contents == book.copies()
    assert book.num_unnamed == 0
    for slot, blocks in list(named.items()):   # every request leaves
        core.abort(slot)
        book.release(blocks)
    # what is left is what the cache holds, nothing of the requests that named it
    assert set(dict(core.cache_contents())) == set(book.copies()) and \
        len(book) == len(book.copies())


def test_an_overflowed_log_resyncs_from_the_cache() -> None:
    core = BatchCore(24, BLOCK, 4, 16, prefix_caching=True, kv_events=True,
                     kv_events_capacity=2)
    book = BlockBook(BLOCK)
    batches = _drive(core, book, random.Random(5), 300, {})
    assert any(isinstance(b[0], AllBlocksCleared) for b in batches if b)
    assert _tally(batches) == dict(core.cache_contents()) == book.copies()


def test_the_publisher_numbers_batches_and_replays_the_last_it_keeps() -> None:
    async def main() -> None:
        pub = KvPublisher(topic="kv", replay_size=3)
        await pub.start()
        ctx = zmq.asyncio.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            assert pub.endpoint is not None and pub.replay_endpoint is not None
            stored = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None,
                                 token_ids=[1, 2, 3, 4], block_size=BLOCK, lora_id=None,
                                 medium="GPU", lora_name=None)
            assert [pub.publish([stored], ts=float(i)) for i in range(5)] == list(range(5))
            dealer.connect(pub.replay_endpoint)
            await dealer.send_multipart([b"not", b"a", b"request"])  # ignored
            await dealer.send_multipart(replay_request(1))
            got = []
            while True:
                frames = await dealer.recv_multipart()
                if seq_of(frames[2]) == END_SEQ:
                    assert frames == [b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""]
                    break
                got.append(decode_message(frames[1:]))
            assert [(t, s, b.ts) for t, s, b in got] == [(b"kv", s, float(s))
                                                         for s in (2, 3, 4)]
            assert got[0][2].events == [stored] and got[0][2].data_parallel_rank == 0
            assert pub.num_replays == 1 and pub.num_dropped == 0
        finally:
            dealer.close(linger=0)
            await pub.close()
            await pub.close()   # idempotent

    asyncio.run(asyncio.wait_for(main(), HANG_S))


def test_a_book_without_holds_forgets_removed_blocks() -> None:
    book = BlockBook(BLOCK)
    blocks = NAMER.name(" ".join(f"w{i}" for i in range(8)), None, None, 2)
    assert blocks is not None
    book.hold(blocks)
    kinds = np.array([1, 1], dtype=np.int64)
    events = book.events(kinds, blocks.keys)
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].parent_block_hash is None and len(events[0].block_hashes) == 2
    book.release(blocks)
    assert len(book) == 2   # still cached
    book.events(np.array([2, 2], dtype=np.int64), blocks.keys)
    assert len(book) == 0 and book.copies() == {}


def test_instance_i_publishes_on_base_plus_2i() -> None:
    from olproute.emulator.app import _kv_publisher

    assert _kv_publisher(0, "127.0.0.1", None, "") is None
    pub = _kv_publisher(3, "127.0.0.1", 5557, "kv")
    assert pub is not None and (pub.port, pub.replay_port, pub.topic) == (5563, 5564, "kv")
    free = _kv_publisher(3, "127.0.0.1", 0, "")
    assert free is not None and (free.port, free.replay_port) == (0, 0)
