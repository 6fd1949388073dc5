"""The engines' own word, against real vLLM (``conftest.fleet``: both servers publish
their KV events, the router subscribes): the router's exact prefix index holds what each
engine says it holds, prompts sent straight to a backend (around the router) included, a
repeated prompt goes to the backend that holds it, and a gap in the stream is filled from
the engine's replay socket.

What an engine holds is read here on its own, from its replay socket: every batch since
it started, stored minus removed, a count per block (vLLM stores a block again when a
repeated prompt's last block is recomputed)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import pytest
import zmq
import zmq.asyncio
from fleet import KV_TOPIC, SERVED, Fleet, KvEventPorts, held, replayed, settled, vllm_cpu

from olproute.config.loader import load_config
from olproute.routing.block_hash import BlockHasher, HfTokenizer, PromptNamer
from olproute.routing.kv_events import (
    decode_message,
    seq_of,
)
from olproute.routing.prefix_index import PrefixIndex
from olproute.server.engine_config import EngineConfig
from olproute.server.kv_subscriber import KvSubscriber
from tests.conftest import HANG_S

BLOCK = vllm_cpu.BLOCK_SIZE


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HANG_S) as r:
        return json.loads(r.read())


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=HANG_S) as r:
        return dict(r.headers), json.loads(r.read())


def instances(fleet: Fleet) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in get(fleet.router_url + "/instances")["instances"]}


def namer(fleet: Fleet) -> PromptNamer:
    """The prompt's block keys as the engine names them: its tokenizer, sha256, blocks of
    ``BLOCK`` tokens."""
    return PromptNamer(HfTokenizer(str(fleet.servers[0].model_dir)), BlockHasher("sha256"),
                       BLOCK)


def direct(server: vllm_cpu.VllmServer, prompt: str) -> None:
    """One completion sent straight to the backend, around the router."""
    post(server.url + "/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 1})


def test_both_backends_are_exact_from_their_events(fleet: Fleet) -> None:
    for name, inst in instances(fleet).items():
        assert inst["prefix_index"] == "exact", name
        status = inst["kv_events"]
        assert status["mode"] == "exact" and status["fallback_reason"] is None, (name, status)


def test_the_router_reads_what_each_engine_says_it_runs_with(fleet: Fleet) -> None:
    for server in fleet.servers:
        with urllib.request.urlopen(server.url + "/metrics", timeout=HANG_S) as r:
            said = EngineConfig.of_metrics(r.read().decode())
        assert said is not None and said.block_size == BLOCK and said.hash_algo == "sha256"
        assert said.num_gpu_blocks is not None and said.prefix_caching is True
        t0 = time.monotonic()
        while (inst := instances(fleet)[server.name])["engine_config"] is None:
            assert time.monotonic() - t0 < HANG_S, inst   # read at the next scrape
            time.sleep(0.2)
        assert {k: inst["engine_config"][k] for k in said.as_doc()} == said.as_doc()
        # the profile's KV size is vLLM's log line; whatever differs is named, and the
        # router counts the engine's blocks
        assert inst["kv_blocks"] == said.num_gpu_blocks
        differs = [m.split(":")[0] for m in inst["engine_config"]["mismatches"]]
        assert differs == ([] if said.num_gpu_blocks * BLOCK == 524288
                           else ["num_gpu_blocks"])


def test_a_prompt_sent_around_the_router_is_found_where_it_went(fleet: Fleet) -> None:
    prompt = vllm_cpu.prompt(10 * BLOCK + 5, salt=4242)
    body = {"prompt": prompt, "max_tokens": 1}
    first = post(fleet.router_url + "/route", body)[1]
    assert first["action"] == "dispatch", first
    # the other backend gets it straight: only its KV events can tell the router
    other = next(s for s in fleet.servers if s.name != first["instance"])
    direct(other, prompt)
    history = settled(fleet, other.name)
    engine = held(history)
    keys = namer(fleet).keys(prompt)
    assert keys is not None and len(keys) == 10
    assert set(keys.tolist()) <= set(engine)   # the router names blocks as vLLM does
    # the router's index for that backend is what the engine says it holds
    assert instances(fleet)[other.name]["prefix_index_blocks"] == len(engine)
    # and it routes the prompt there now, where 10 of its blocks are cached
    again = post(fleet.router_url + "/route", body)[1]
    assert again["instance"] == other.name, again
    headers, answer = post(fleet.router_url + "/v1/completions",
                           {"model": SERVED, "prompt": prompt, "max_tokens": 1})
    assert headers["x-olproute-instance"] == other.name
    assert answer["usage"]["prompt_tokens"] == 10 * BLOCK + 5


def test_a_gap_in_the_stream_is_replayed_from_the_engine(fleet: Fleet) -> None:
    server = fleet.servers[0]
    ports = fleet.kv_events[server.name]
    frames = asyncio.run(_frames_of(fleet, server, ports, 3))
    assert [seq_of(f[1]) for f in frames] == list(range(seq_of(frames[0][1]),
                                                        seq_of(frames[0][1]) + len(frames)))
    specs = load_config(fleet.config).specs
    index = PrefixIndex(specs)
    g = next(i for i, s in enumerate(specs) if s.name == server.name)
    sub = KvSubscriber(server.name, g, index, ports.endpoint, ports.replay_endpoint,
                       KV_TOPIC, BlockHasher("sha256"), replay_timeout_s=HANG_S)

    async def feed() -> None:
        await sub.on_message(frames[0])    # joins: the history before it is replayed
        for f in frames[2:]:               # frames[1] is lost on the way
            await sub.on_message(f)

    asyncio.run(feed())
    assert sub.mode == "exact" and sub.gaps_replayed == 1 and sub.gaps_lost == 0
    assert sub.last_seq == seq_of(frames[-1][1])
    history = [(s, b) for s, b in replayed(ports) if s <= sub.last_seq]
    assert index.holds(g) == set(held(history))
    assert index.copies(g) == dict(held(history))


async def _frames_of(fleet: Fleet, server: vllm_cpu.VllmServer, ports: KvEventPorts,
                     n: int) -> list[list[bytes]]:
    """The PUB frames of ``n`` new prompts sent straight to ``server``, each one's frames
    awaited before the next is sent, so that there are at least ``n``."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
    sock.connect(ports.endpoint)
    await asyncio.sleep(0.5)    # the subscription reaches the publisher (ZMQ's slow joiner)
    out: list[list[bytes]] = []
    try:
        for i in range(n):
            have = len(out)
            await asyncio.to_thread(direct, server, vllm_cpu.prompt(3 * BLOCK + 1, 5000 + i))
            while len(out) == have:
                assert await sock.poll(int(HANG_S * 1000)), "no KV events came"
                out.append(await sock.recv_multipart())
            while await sock.poll(300):   # the rest of this request's batches
                out.append(await sock.recv_multipart())
    finally:
        sock.close(linger=0)
    for frames in out:
        assert decode_message(frames)[0] == KV_TOPIC.encode()
    return out


@pytest.fixture(autouse=True)
def _fleet_idle(fleet: Fleet) -> None:
    """Each test starts with nothing in flight (a hang guard only)."""
    t0 = time.monotonic()
    while any(i["in_flight"] for i in instances(fleet).values()):
        assert time.monotonic() - t0 < HANG_S
        time.sleep(0.2)
