"""Record what vLLM's CPU build publishes as KV-cache events, as a fixture for the router's
event consumer and block hasher (``tests/data/kv_events/vllm-<version>-<algo>.json``).

Run it with the vLLM virtualenv's interpreter (it imports vllm, zmq and msgspec)::

    ~/.cache/olproute/vllm-cpu/bin/python tests/support/record_kv_events.py \\
        --algo sha256 --out tests/data/kv_events/vllm-0.32.0-sha256.json

It starts one tiny vLLM server (``vllm_cpu.py``'s random-weight model) with ZMQ KV events
on, a replay socket, prefix caching with the given hash algorithm and a KV cache of a few
blocks (``--num-gpu-blocks-override``: the CPU build honours it, so blocks get evicted),
subscribes to the PUB socket, sends a scripted sequence of /v1/completions requests
(repeats, shared prefixes, a prefix-cache hit reported with ``kv_cache_report_mode=full``,
enough distinct prompts to evict, a /reset_prefix_cache), records every frame as it came,
asks the replay socket for everything from seq 0 (and from a later seq), restarts the
server on the same ports and records the first frames after the restart. Block hashes the
requests should produce are computed here with vLLM's own functions. The decoded events
are summarised on stdout.

Endpoints: vLLM's PUB socket *binds* only wildcard, ``::``, ipc and inproc endpoints and
*connects* to any other (``ZmqEventPublisher._is_bind_endpoint``), so ``tcp://*:PORT`` is
given and the subscriber connects to 127.0.0.1:PORT. The replay (ROUTER) socket always
binds, so ``tcp://127.0.0.1:PORT`` is fine for it.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
import vllm
import vllm_cpu
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

TOPIC = "kv-events"
BLOCK = vllm_cpu.BLOCK_SIZE
NUM_BLOCKS = 16          # --num-gpu-blocks-override: a KV cache small enough to evict
MAX_MODEL_LEN = 256      # 8 blocks: what a 16-block cache can admit
QUIET_S = 1.5            # a frame-less pause this long ends a request's events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def words(n_blocks: int, salt: int) -> str:
    return vllm_cpu.prompt(n_blocks * BLOCK, salt)


class Collector:
    """A SUB socket drained on a thread of its own: every frame with the time it came."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(endpoint)
        self.frames: list[tuple[float, list[bytes]]] = []
        self.lock = threading.Lock()
        self.source = "pub"
        self.sources: list[str] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.sock.poll(100):
                parts = self.sock.recv_multipart()
                with self.lock:
                    self.frames.append((time.monotonic(), parts))
                    self.sources.append(self.source)

    def wait_quiet(self, quiet_s: float = QUIET_S, limit_s: float = 30.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            with self.lock:
                last = self.frames[-1][0] if self.frames else t0
            if time.monotonic() - max(last, t0) >= quiet_s:
                return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        self.sock.close(linger=0)


def replay(ctx: zmq.Context[Any], endpoint: str, start: int) -> list[list[bytes]]:
    """[b"", start 8-byte big-endian] from a DEALER; the ROUTER answers one message per
    buffered batch, [b"", topic, seq, payload], then [b"", b"", seq -1, b""]."""
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            if not s.poll(10_000):
                out.append([b"<timeout>"])
                return out
            parts = s.recv_multipart()
            out.append(parts)
            if len(parts) >= 3 and int.from_bytes(parts[2], "big", signed=True) == -1:
                return out
    finally:
        s.close(linger=0)


def http(url: str, body: dict[str, Any] | None = None, method: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def expected_hashes(algo: str, ids: list[int]) -> list[str]:
    """vLLM's own block hashes of the full blocks of ``ids`` (no extra keys)."""
    fn = get_hash_fn_by_name(algo)
    parent = None
    out = []
    for i in range(len(ids) // BLOCK):
        h = kv_cache_utils.hash_block_tokens(fn, parent, ids[i * BLOCK:(i + 1) * BLOCK])
        out.append(bytes(h).hex())
        parent = h
    return out


def _bytes_hashes() -> bool:
    """What ``maybe_convert_block_hash`` publishes: the 32-byte digest, or (the default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) its low 64 bits as an unsigned int."""
    return not kv_cache_utils.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES


def int64(hex_digest: str) -> int:
    return int(hex_digest, 16) & ((1 << 64) - 1)


def hexify(h: Any) -> Any:
    return h.hex() if isinstance(h, bytes) else h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", choices=["sha256", "sha256_cbor"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--bytes-hashes", action="store_true",
                    help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: publish the 32-byte "
                    "digests (the default publishes their low 64 bits as ints)")
    a = ap.parse_args()
    if a.bytes_hashes:   # the server inherits this process's environment
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"

    work = a.workdir or Path(tempfile.mkdtemp(prefix="kvrec-"))
    work.mkdir(parents=True, exist_ok=True)
    model = vllm_cpu.build_tiny_model(work / "model")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))

    fn = get_hash_fn_by_name(a.algo)
    kv_cache_utils.init_none_hash(fn)
    seed = kv_cache_utils.get_none_hash_seed()
    none_hash = bytes(kv_cache_utils.NONE_HASH).hex()

    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    pub_bind = f"tcp://*:{pub_port}"
    replay_ep = f"tcp://127.0.0.1:{replay_port}"
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub_bind,
              "replay_endpoint": replay_ep, "topic": TOPIC}
    args = ("--kv-events-config", json.dumps(kv_cfg), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", a.algo,
            "--num-gpu-blocks-override", str(NUM_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN))
    log = work / "vllm.log"

    def server() -> vllm_cpu.VllmServer:
        return vllm_cpu.VllmServer("tiny", http_port, model, log, args=args,
                                   env=(("VLLM_SERVER_DEV_MODE", "1"),))

    # the script: (label, prompt, extra request fields)
    A, B = words(2, 1), words(2, 2)
    script: list[tuple[str, str, dict[str, Any]]] = [
        ("A: 2 blocks, new", A, {}),
        ("A again: a repeat (only block 1 can hit: the last prompt token is recomputed)",
         A, {}),
        ("A+1: shares A's 2 blocks, adds one", A + " " + words(1, 3), {}),
        ("B: 2 blocks, new", B, {}),
        ("B+1 with kv_cache_report_mode=full: reused blocks reported",
         B + " " + words(1, 4), {"vllm_xargs": {"kv_cache_report_mode": "full"}}),
    ]
    script += [(f"C{i}: 4 new blocks, to evict", words(4, 10 + i), {}) for i in range(5)]
    script += [("RESET", "", {}),
               ("A after reset", A, {})]

    ctx = zmq.Context.instance()
    frames: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    metrics_lines: list[str] = []
    notes: list[str] = []
    srv = server().start()
    col: Collector | None = None
    try:
        srv.wait_ready(900)
        col = Collector(ctx, f"tcp://127.0.0.1:{pub_port}")
        time.sleep(2.0)   # the slow joiner: let the subscription reach the PUB socket
        metrics = http(srv.url + "/metrics")
        metrics_lines = [ln for ln in metrics.splitlines()
                         if ln.startswith("vllm:cache_config_info")]
        for label, text, extra in script:
            first = len(col.frames)
            if label == "RESET":
                r = http(srv.url + "/reset_prefix_cache", {}, method="POST")
                col.wait_quiet()
                requests.append({"label": label, "reset_response": r,
                                 "frames": list(range(first, len(col.frames)))})
                continue
            ids = tok(text, add_special_tokens=True)["input_ids"]
            served = http(srv.url + "/tokenize", {"model": "tiny", "prompt": text})
            body = {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0.0,
                    **extra}
            resp = http(srv.url + "/v1/completions", body)
            col.wait_quiet()
            requests.append({
                "label": label, "prompt": text, "request_extra": extra,
                "token_ids": ids, "server_token_ids": served.get("tokens"),
                "expected_block_hashes_hex": expected_hashes(a.algo, ids),
                "expected_block_hashes_int64": [int64(h) for h in
                                                expected_hashes(a.algo, ids)],
                "completion_tokens": resp.get("usage", {}).get("completion_tokens"),
                "frames": list(range(first, len(col.frames)))})
        # replay: everything from 0, then from a later seq
        n_pub = len(col.frames)
        mid = n_pub // 2
        for start in (0, mid):
            for parts in replay(ctx, replay_ep, start):
                frames.append({"source": "replay", "replay_start": start,
                               "parts_b64": [base64.b64encode(p).decode() for p in parts]})
        # the restart: same ports; the SUB socket stays connected and reconnects
        srv.stop()
        col.source = "after_restart"
        srv = server().start()
        srv.wait_ready(900)
        time.sleep(2.0)
        first = len(col.frames)
        ids = tok(A, add_special_tokens=True)["input_ids"]
        http(srv.url + "/v1/completions",
             {"model": "tiny", "prompt": A, "max_tokens": 1, "temperature": 0.0})
        col.wait_quiet()
        served = http(srv.url + "/tokenize", {"model": "tiny", "prompt": A})
        requests.append({"label": "A after restart", "prompt": A, "request_extra": {},
                         "token_ids": ids, "server_token_ids": served.get("tokens"),
                         "expected_block_hashes_hex": expected_hashes(a.algo, ids),
                         "expected_block_hashes_int64": [int64(h) for h in
                                                         expected_hashes(a.algo, ids)],
                         "frames": list(range(first, len(col.frames)))})
        for parts in replay(ctx, replay_ep, 0):
            frames.append({"source": "replay_after_restart", "replay_start": 0,
                           "parts_b64": [base64.b64encode(p).decode() for p in parts]})
    finally:
        srv.stop()
        if col is not None:
            col.close()

    pub_frames = []
    for (_, parts), source in zip(col.frames, col.sources, strict=True):
        topic, seq, payload = parts
        pub_frames.append({"source": source, "topic_b64": base64.b64encode(topic).decode(),
                           "seq": int.from_bytes(seq, "big", signed=True),
                           "payload_b64": base64.b64encode(payload).decode()})
    # replay frames in the same shape as pub frames ([b"", topic, seq, payload])
    replay_frames = []
    for f in frames:
        parts = [base64.b64decode(p) for p in f["parts_b64"]]
        entry: dict[str, Any] = {"source": f["source"], "replay_start": f["replay_start"],
                                 "nparts": len(parts),
                                 "delimiter_b64": base64.b64encode(parts[0]).decode()}
        if len(parts) == 4:
            entry.update(topic_b64=base64.b64encode(parts[1]).decode(),
                         seq=int.from_bytes(parts[2], "big", signed=True),
                         payload_b64=base64.b64encode(parts[3]).decode())
        else:
            entry["parts_b64"] = f["parts_b64"]
        replay_frames.append(entry)

    summary = summarise(pub_frames, replay_frames, requests, a.algo)
    notes += summary
    doc = {
        "vllm_version": vllm.__version__, "hash_algo": a.algo, "block_size": BLOCK,
        "none_hash_seed": seed, "none_hash_hex": none_hash,
        "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
        "block_hashes_on_wire": "bytes32" if _bytes_hashes() else "int64",
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES":
            os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"),
        "python_version": sys.version,
        "server_args": list(args), "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "kv_events_config": kv_cfg,
        "requests": requests,
        "frames": pub_frames + replay_frames,
        "metrics_cache_config_info": metrics_lines,
        "notes": notes,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(summary))
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes); vLLM log {log}")


def summarise(pub: list[dict[str, Any]], rep: list[dict[str, Any]],
              requests: list[dict[str, Any]], algo: str) -> list[str]:
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[str] = []
    stored_hashes: set[str] = set()
    for f in pub:
        batch = dec.decode(base64.b64decode(f["payload_b64"]))
        evs = []
        for e in batch.events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    stored_hashes.add(hexify(h))
                evs.append(
                    f"BlockStored(n={len(e.block_hashes)} "
                    f"hash_types={sorted({type(h).__name__ + str(len(h) if isinstance(h, bytes) else '') for h in e.block_hashes})} "  # noqa: E501
                    f"first={str(hexify(e.block_hashes[0]))[:16]} "
                    f"parent={str(hexify(e.parent_block_hash))[:16] if e.parent_block_hash is not None else None} "  # noqa: E501
                    f"ntok={len(e.token_ids)} block_size={e.block_size} lora_id={e.lora_id} "
                    f"lora_name={e.lora_name} medium={e.medium} extra_keys={e.extra_keys} "
                    f"group_idx={e.group_idx} spec_kind={e.kv_cache_spec_kind} "
                    f"sw={e.kv_cache_spec_sliding_window} locality={e.locality} "
                    f"ownership={e.ownership} session_id={e.session_id})")
            elif isinstance(e, BlockRemoved):
                evs.append(f"BlockRemoved(n={len(e.block_hashes)} "
                           f"first={str(hexify(e.block_hashes[0]))[:16]} medium={e.medium} "
                           f"group_idx={e.group_idx} locality={e.locality} "
                           f"ownership={e.ownership})")
            elif isinstance(e, AllBlocksCleared):
                evs.append("AllBlocksCleared()")
            else:
                evs.append(repr(e))
        raw = msgspec.msgpack.decode(base64.b64decode(f["payload_b64"]))
        out.append(f"[{f['source']}] seq={f['seq']} topic={base64.b64decode(f['topic_b64'])!r} "
                   f"ts={batch.ts:.3f} dp_rank={batch.data_parallel_rank} events={evs}")
        out.append(f"    raw msgpack: {json.dumps(raw, default=lambda b: b.hex()[:16])[:400]}")
    for r in requests:
        exp = r.get("expected_block_hashes_hex")
        if exp is None:
            out.append(f"request {r['label']!r}: frames {r['frames']}")
            continue
        want = [h if _bytes_hashes() else int(h, 16) & ((1 << 64) - 1) for h in exp]
        ok = all(h in stored_hashes for h in want)
        out.append(f"request {r['label']!r}: frames {r['frames']} ids==server "
                   f"{r['token_ids'] == r['server_token_ids']} expected hashes "
                   f"{[h[:16] for h in exp]} all seen in BlockStored: {ok}")
    by_start: dict[int, list[str]] = {}
    for f in rep:
        key = f"{f['source']}@{f['replay_start']}"
        by_start.setdefault(key, []).append(
            f"seq={f.get('seq')} nparts={f['nparts']}"
            + (" topic=" + repr(base64.b64decode(f['topic_b64'])) if 'topic_b64' in f else ""))
    for key, lst in by_start.items():
        out.append(f"replay {key}: {len(lst)} messages: {lst}")
    pub_payloads = {(f["seq"], f["payload_b64"]) for f in pub if f["source"] == "pub"}
    rep_payloads = {(f["seq"], f["payload_b64"]) for f in rep
                    if f["source"] == "replay" and f["replay_start"] == 0 and "seq" in f
                    and f["seq"] >= 0}
    out.append(f"replay@0 == pub frames (seq, payload): {pub_payloads == rep_payloads} "
               f"(pub {len(pub_payloads)}, replay {len(rep_payloads)})")
    return out


if __name__ == "__main__":
    main()
