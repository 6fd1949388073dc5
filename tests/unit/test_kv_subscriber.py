"""A backend's KV-events stream into the prefix index (olproute.server.kv_subscriber):
sequence gaps replayed or counted lost, restarts, malformed frames and a wrong hash
setting falling back to the approximate index; over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest
import zmq
import zmq.asyncio

from olproute.routing.block_hash import BlockHasher
from olproute.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_key,
    encode_batch,
    encode_message,
)
from olproute.routing.prefix_index import PrefixIndex
from olproute.server.kv_subscriber import KvSubscriber
from olproute.types import InstanceSpec

BS = 4
HASHER = BlockHasher("sha256")
HANG_S = 20.0   # a hang guard only


def _spec(name: str) -> InstanceSpec:
    return InstanceSpec(name=name, model="m", gpu="g", tensor_parallel=1, num_kv_blocks=100,
                        block_size=BS, max_num_seqs=8, max_num_batched_tokens=512,
                        enable_prefix_caching=True)


def _stored(ids: Sequence[int]) -> BlockStored:
    digests = HASHER.digests(ids, BS)
    return BlockStored(block_hashes=[block_key(d) for d in digests], parent_block_hash=None,
                       token_ids=list(ids), block_size=BS, lora_id=None, medium="GPU",
                       lora_name=None)


def _keys(ids: Sequence[int]) -> set[int]:
    return set(HASHER.keys(ids, BS).tolist())


A, B, C = list(range(8)), list(range(100, 108)), list(range(200, 204))


def _message(seq: int, *events: object) -> list[bytes]:
    return encode_message("kv", seq, encode_batch(list(events), ts=1.0,   # type: ignore[arg-type]
                                                  data_parallel_rank=0))


def _subscriber(**kw: object) -> tuple[PrefixIndex, KvSubscriber]:
    index = PrefixIndex([_spec("a"), _spec("b")])
    sub = KvSubscriber("b", 1, index, "tcp://127.0.0.1:1", topic="kv", hasher=HASHER,
                       **kw)  # type: ignore[arg-type]
    return index, sub


def test_stored_removed_and_cleared_reach_the_index() -> None:
    index, sub = _subscriber()
    asyncio.run(sub.on_message(_message(0, _stored(A), _stored(B))))
    assert index.holds(1) == _keys(A) | _keys(B) and index.holds(0) == set()
    removed = BlockRemoved(block_hashes=[block_key(HASHER.digests(B, BS)[1])], medium="GPU")
    asyncio.run(sub.on_message(_message(1, removed)))
    assert index.holds(1) == _keys(A) | {block_key(HASHER.digests(B, BS)[0])}
    asyncio.run(sub.on_message(_message(2, AllBlocksCleared(), _stored(C))))
    assert index.holds(1) == _keys(C)
    assert (sub.last_seq, sub.batches, sub.mode) == (2, 3, "exact")


def test_each_stored_block_is_told_to_the_tracker_in_order() -> None:
    told: list[tuple[int, list[int]]] = []
    _, sub = _subscriber(on_stored=lambda g, keys: told.append((g, list(keys))))
    asyncio.run(sub.on_message(_message(0, _stored(A), _stored(B))))
    assert told == [(1, HASHER.keys(A, BS).tolist()), (1, HASHER.keys(B, BS).tolist())]


def test_another_topic_is_ignored() -> None:
    index, sub = _subscriber()
    asyncio.run(sub.on_message(encode_message("other", 0, encode_batch([_stored(A)]))))
    assert index.holds(1) == set() and sub.last_seq == -1


def test_a_restart_drops_the_backends_entries(caplog: pytest.LogCaptureFixture) -> None:
    index, sub = _subscriber()
    asyncio.run(sub.on_message(_message(0, _stored(A))))
    asyncio.run(sub.on_message(_message(1, _stored(B))))
    with caplog.at_level(logging.WARNING):
        asyncio.run(sub.on_message(_message(0, _stored(C))))
    assert index.holds(1) == _keys(C) and sub.restarts == 1
    assert "restarted" in caplog.text and "backend b" in caplog.text


def test_a_gap_without_replay_empties_the_index() -> None:
    index, sub = _subscriber()
    asyncio.run(sub.on_message(_message(0, _stored(A))))
    asyncio.run(sub.on_message(_message(3, _stored(B))))
    assert index.holds(1) == _keys(B) and sub.gaps_lost == 1 and sub.last_seq == 3


@pytest.mark.parametrize("frames", [[b"kv", b"\x00" * 8, b"junk"], [b"kv", b"\x00"],
                                    [b"kv", b"\x00" * 8, b"\x93\x01\x02"]])
def test_a_malformed_message_falls_back_to_the_approximate_index(
        frames: list[bytes], caplog: pytest.LogCaptureFixture) -> None:
    index, sub = _subscriber()
    asyncio.run(sub.on_message(_message(0, _stored(A))))
    with caplog.at_level(logging.ERROR):
        asyncio.run(sub.on_message(frames))
    assert sub.mode == "approximate" and not index.exact[1] and index.holds(1) == set()
    assert "backend b" in caplog.text and "malformed" in (sub.fallback_reason or "")
    asyncio.run(sub.on_message(_message(1, _stored(B))))   # nothing more is applied
    assert index.holds(1) == set()


def test_an_engine_hashing_otherwise_falls_back() -> None:
    index, sub = _subscriber()
    cbor = BlockHasher("sha256_cbor")
    other = BlockStored(block_hashes=[block_key(d) for d in cbor.digests(A, BS)],
                        parent_block_hash=None, token_ids=A, block_size=BS, lora_id=None,
                        medium="GPU", lora_name=None)
    asyncio.run(sub.on_message(_message(0, other)))
    assert sub.mode == "approximate" and "not sha256" in (sub.fallback_reason or "")
    assert not index.exact[1] and index.holds(1) == set()


def test_an_engine_with_other_blocks_falls_back() -> None:
    index, sub = _subscriber()
    wide = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=8, lora_id=None, medium="GPU", lora_name=None)
    asyncio.run(sub.on_message(_message(0, wide)))
    assert sub.mode == "approximate" and "of 8 tokens" in (sub.fallback_reason or "")
    assert not index.exact[1]


class Publisher:
    """vLLM's publisher in miniature: a PUB socket and a ROUTER replaying its buffer."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
        self.buffer: list[list[bytes]] = []

    async def send(self, seq: int, *events: object, publish: bool = True) -> None:
        msg = _message(seq, *events)
        self.buffer.append(msg)
        if publish:
            await self.pub.send_multipart(msg)

    async def serve_replays(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for topic, seq, payload in self.buffer:
                if int.from_bytes(seq, "big") >= first:
                    await self.router.send_multipart([ident, b"", topic, seq, payload])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big",
                                                                           signed=True), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def _until(cond: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + HANG_S
    while not cond():  # type: ignore[operator]
        if loop.time() > end:
            raise AssertionError(f"hung waiting for {what}")
        await asyncio.sleep(0.02)


def test_over_sockets_a_late_joiner_and_a_gap_are_replayed() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pub = Publisher(ctx)
        index = PrefixIndex([_spec("a"), _spec("b")])
        sub = KvSubscriber("b", 1, index, pub.endpoint, pub.replay, topic="kv",
                           hasher=HASHER, context=ctx)
        replays = asyncio.create_task(pub.serve_replays())
        task = asyncio.create_task(sub.run())
        try:
            # batches published before the subscription took hold are lost on PUB/SUB:
            # the first one received brings them back by replay
            seq = 0
            await pub.send(seq, _stored(A))
            while sub.last_seq < 0:
                await asyncio.sleep(0.05)
                seq += 1
                await pub.send(seq, BlockRemoved(block_hashes=[12345], medium="GPU"))
                if seq > 400:
                    raise AssertionError("no batch ever arrived")
            await _until(lambda: sub.last_seq == seq, "the joined batch")
            assert index.holds(1) == _keys(A)
            # a batch never published (a gap), then one that is: the gap is replayed
            await pub.send(seq + 1, _stored(B), publish=False)
            await pub.send(seq + 2, _stored(C))
            await _until(lambda: sub.last_seq == seq + 2, "the batch after the gap")
            assert index.holds(1) == _keys(A) | _keys(B) | _keys(C)
            assert sub.gaps_replayed >= 1 and sub.gaps_lost == 0
            assert sub.age_s() is not None and sub.status()["mode"] == "exact"
        finally:
            task.cancel()
            replays.cancel()
            await asyncio.gather(task, replays, return_exceptions=True)
            pub.close()
            ctx.term()

    asyncio.run(scenario())
