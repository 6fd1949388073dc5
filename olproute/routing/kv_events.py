"""vLLM's KV-cache events on the wire: what an engine started with ``--kv-events-config``
publishes over ZMQ, decoded and encoded here the same way (vLLM 0.32's
``vllm/distributed/kv_events.py``), so that the router reads a real engine's stream and
the emulator writes one a real subscriber could read.

**Frames.** Each message on the PUB socket is three frames: the topic (UTF-8 bytes, may be
empty), the batch's sequence number (8 bytes, big-endian, unsigned; the publisher counts
from 0 when it starts, so a sequence that starts again means the engine restarted), and
the batch as msgpack. The replay socket (ZMQ ROUTER) answers a request frame
``[b"", start_seq as 8 bytes big-endian]`` with one ``[b"", topic, seq, payload]`` message
per batch it still holds from ``start_seq`` on, then ``[b"", b"", seq -1, b""]``
(``END_SEQ``).

**Batch.** ``EventBatch`` is a msgpack array ``[ts, events, data_parallel_rank]`` (the last
omitted when None). Each event is a msgpack map tagged by ``"type"``: ``"BlockStored"``
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``,
``medium``, ``lora_name``, and optional fields vLLM adds over versions), ``"BlockRemoved"``
(``block_hashes``, ``medium``) or ``"AllBlocksCleared"``. Fields this module does not know
are ignored (``forbid_unknown_fields`` is off), so a newer vLLM that adds one still
decodes; a frame that does not decode, or an event type it does not know, is a
``KvEventsError`` naming what is wrong.

**Block hashes** are vLLM's SHA-256 digests: on the wire by default (vLLM 0.32) the
integer of the digest big-endian masked to 64 bits (its last eight bytes, a msgpack
uint64), or with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` the 32 bytes themselves
(``tests/data/kv_events`` holds streams of both, recorded from vLLM's CPU build).
``block_key`` maps either form to one non-negative int64, the key the prefix index holds:
the low 63 bits of the integer form, which for bytes are the low 63 bits of the last
eight. ``olproute.routing.block_hash`` computes the same keys from a prompt's token ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

END_SEQ = -1
_MASK_63 = (1 << 63) - 1
_MASK_64 = (1 << 64) - 1

BlockHash = bytes | int


class KvEventsError(ValueError):
    """A frame or batch that is not vLLM's KV-events format."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks an engine registered in its prefix cache: ``block_hashes`` in prompt
    order, the first one's parent ``parent_block_hash`` (None: the first block of a
    prompt), their ``token_ids`` (``block_size`` per block, concatenated). ``lora_id``,
    ``medium`` and ``lora_name`` have no defaults, as in vLLM: an encoder that omitted
    them would write batches vLLM's own decoder refuses."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks whose hashes an engine dropped from its prefix cache (evicted)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The engine's prefix cache was reset: nothing it held is findable any more."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's events, stamped ``ts`` (the engine's ``time.time()``)."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def block_key(h: BlockHash) -> int:
    """The prefix index's key of a vLLM block hash, bytes or int form (module docstring):
    an int in [0, 2**63)."""
    if isinstance(h, bytes):
        if len(h) < 8:
            raise KvEventsError(f"a block hash of {len(h)} bytes (at least 8 expected)")
        return int.from_bytes(h[-8:], "big") & _MASK_63
    if isinstance(h, bool) or not isinstance(h, int):
        raise KvEventsError(f"a block hash of type {type(h).__name__}")
    return (h & _MASK_64) & _MASK_63


def seq_of(frame: bytes) -> int:
    """A sequence-number frame as an int (``END_SEQ`` is -1)."""
    if len(frame) != 8:
        raise KvEventsError(f"a sequence frame of {len(frame)} bytes (8 expected)")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """A batch's msgpack payload decoded; ``KvEventsError`` saying why it is not one."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as e:
        raise KvEventsError(f"not a KV event batch: {e}") from None


def decode_message(frames: Sequence[bytes]) -> tuple[bytes, int, EventBatch]:
    """A PUB message ``[topic, seq, payload]`` as (topic, seq, batch)."""
    if len(frames) != 3:
        raise KvEventsError(f"a message of {len(frames)} frames (3 expected: topic, seq, "
                            "payload)")
    topic, seq, payload = frames
    return bytes(topic), seq_of(bytes(seq)), decode_batch(bytes(payload))


def encode_batch(events: Sequence[KvEvent], ts: float | None = None,
                 data_parallel_rank: int | None = None) -> bytes:
    """A batch's msgpack payload, as vLLM's publisher encodes it."""
    return _ENCODER.encode(EventBatch(ts=time.time() if ts is None else ts,
                                      events=list(events),
                                      data_parallel_rank=data_parallel_rank))


def encode_message(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """A PUB message's frames."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a subscriber sends the replay socket (from a DEALER: with the empty
    delimiter a REQ socket would add) to get every batch from ``start_seq`` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def event_summary(batch: EventBatch) -> dict[str, Any]:
    """Counts of a batch's events by type, for logs."""
    out: dict[str, Any] = {}
    for e in batch.events:
        name = type(e).__name__
        out[name] = out.get(name, 0) + 1
    return out
