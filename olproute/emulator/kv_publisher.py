"""An emulated engine's KV events on ZMQ, as vLLM's ``ZmqEventPublisher`` sends them
(``olproute.routing.kv_events`` has the frames): a PUB socket with one message
``[topic, seq, payload]`` per batch, batches numbered from 0 when the publisher starts,
and a ROUTER replay socket that answers ``[identity, b"", start_seq]`` with
``[identity, b"", topic, seq, payload]`` for every batch it still holds from
``start_seq`` on (the last ``replay_size``), then ``[identity, b"", b"", END_SEQ,
b""]``.

Nothing here blocks the event loop: ``publish`` sends without waiting (``zmq.NOBLOCK``;
PUB never waits: past a subscriber's high-water mark ZMQ drops that subscriber's
messages, which it sees as a gap and fills from the replay socket; a send ZMQ refuses
outright is counted in ``num_dropped``; the batch stays in the replay buffer either
way), and the replay socket is served by a task on ZMQ's asyncio sockets.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from olproute.routing.kv_events import END_SEQ, KvEvent, encode_batch, encode_message

LOG = logging.getLogger("olproute.emulator.kv_events")
REPLAY_SIZE = 10_000   # vLLM's buffer_steps default
SEND_HWM = 100_000     # vLLM's hwm default
_END = END_SEQ.to_bytes(8, "big", signed=True)


class KvPublisher:
    """PUB on ``host:port`` and ROUTER on ``host:replay_port`` (0: a free port each),
    messages on ``topic``; ``endpoint`` / ``replay_endpoint`` once started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int = 0,
                 topic: str = "", replay_size: int = REPLAY_SIZE, send_hwm: int = SEND_HWM,
                 context: zmq.asyncio.Context | None = None) -> None:
        if replay_size < 1:
            raise ValueError(f"replay_size must be >= 1, got {replay_size}")
        self.host, self.port, self.replay_port = host, port, replay_port
        self.topic = topic
        self.send_hwm = send_hwm
        self._ctx = context or zmq.asyncio.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_size)
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.next_seq = 0
        self.num_dropped = 0    # messages PUB refused (its high-water mark)
        self.num_replays = 0    # replay requests answered
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None

    def _bind(self, sock: zmq.Socket[bytes] | zmq.asyncio.Socket, port: int) -> str:
        base = f"tcp://{self.host}"
        if port:
            sock.bind(f"{base}:{port}")
        else:
            port = sock.bind_to_random_port(base)
        return f"{base}:{port}"

    async def start(self) -> None:
        """Bind both sockets and serve replays; raises ZMQError if a port is taken."""
        # PUB as a plain socket on the same context: a send that never waits
        pub: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUB)
        router = self._ctx.socket(zmq.ROUTER)
        try:
            for s in (pub, router):
                s.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.send_hwm)
            self.endpoint = self._bind(pub, self.port)
            self.replay_endpoint = self._bind(router, self.replay_port)
        except BaseException:
            pub.close(linger=0)
            router.close(linger=0)
            raise
        self._pub, self._router = pub, router
        self._task = asyncio.get_running_loop().create_task(self._serve_replays(),
                                                            name="kv-events-replay")

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> int:
        """One batch of events: numbered, kept for replay, sent if PUB takes it; its seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(events, ts, data_parallel_rank=0)
        self._buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart(encode_message(self.topic, seq, payload),
                                         flags=zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1
        return seq

    async def _serve_replays(self) -> None:
        assert self._router is not None
        router = self._router
        topic = self.topic.encode("utf-8")
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                LOG.warning("a KV-events replay request of %d frames (3 expected), "
                            "ignored", len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"),
                                                 payload])
            await router.send_multipart([ident, b"", b"", _END, b""])
            self.num_replays += 1

    async def close(self) -> None:
        """Stop serving replays and close both sockets. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = None
