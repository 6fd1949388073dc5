"""KV events live: a backend whose config names its engine's KV-events stream gets an
exact prefix index, fed by that stream (here a ZMQ publisher in the test, naming the
prompt's blocks as the emulator's engine would: one token per word, vLLM's sha256 block
hashes), shown as such in ``/instances``; routing records nothing there; a tokenizer
that does not load stops the start-up with an error naming the backend's key."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.config.read import ConfigError
from olproute.routing.block_hash import BlockHasher, WordTokenizer
from olproute.routing.kv_events import BlockStored, block_key, encode_batch, encode_message
from olproute.server.app import kv_events
from olproute.server.state import STATE, ServerState
from olproute.sim.scenario import CalibrationSource
from olproute.types import PrefixMatch, RoutingContext
from tests.integration.server_harness import Stack
from tests.integration.test_server import CAL, TOKEN, _config, request

BLOCK = 16
PROMPT = " ".join(f"w{i}" for i in range(400))
MATCHED = (400 - 1) // BLOCK


def _loaded(tmp_path: Path, endpoint: str, tokenizer: str = "words") -> Any:
    return load_config(_config(
        tmp_path, router={"policy": "round_robin", "slot_ms": 20},
        server={"health_period_s": 0.1, "scrape_period_s": 0.2, "admin_token": TOKEN,
                "backends": [
                    {"name": "e-0", "url": "http://127.0.0.1:9",
                     "kv_events": {"endpoint": endpoint, "topic": "kv",
                                   "tokenizer": tokenizer}},
                    {"name": "e-1", "url": "http://127.0.0.1:9"}]},
        instances=[{"name": "e", "model": "llama-2-7b", "gpu": "a100-80gb", "replicas": 2,
                    "block_size": BLOCK}]))


def _instances(s: Stack) -> list[dict[str, Any]]:
    status, _, body = request(s.url, "GET", "/instances")
    assert status == 200
    out: list[dict[str, Any]] = json.loads(body)["instances"]
    return out


def _stored(text: str) -> BlockStored:
    ids = WordTokenizer().encode(text)
    n = len(ids) // BLOCK * BLOCK
    return BlockStored(block_hashes=[block_key(d) for d in
                                     BlockHasher("sha256").digests(ids, BLOCK)],
                       parent_block_hash=None, token_ids=ids[:n], block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None)


def test_an_exact_backend_matches_what_its_engine_says(tmp_path: Path) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    loaded = _loaded(tmp_path, f"tcp://127.0.0.1:{port}")
    s = Stack(loaded, num_fakes=2, calibration=CalibrationSource(loaded, known=[CAL] * 2))
    try:
        st = s.app[STATE]
        modes = [(b["prefix_index"], (b["kv_events"] or {}).get("mode")) for b in _instances(s)]
        assert modes == [("exact", "exact"), ("approximate", None)]
        # PUB/SUB drops what is sent before the subscription holds: send until it lands
        sub = st.kv_subscribers[0]
        seq = 0
        deadline = time.monotonic() + 60
        while s.call(lambda: sub.last_seq) < 0:
            assert time.monotonic() < deadline, "no KV event batch reached the router"
            pub.send_multipart(encode_message("kv", seq, encode_batch([_stored(PROMPT)])))
            seq += 1
            time.sleep(0.05)
        held = s.call(lambda: st.router.prefixes.holds(0))
        assert len(held) == 400 // BLOCK
        seen: list[PrefixMatch | None] = []
        policy = st.router.policy
        decide = policy.decide

        def recording(c: RoutingContext) -> Any:
            seen.append(c.prefixes)
            return decide(c)

        s.call(lambda: setattr(policy, "decide", recording))
        for _ in range(2):
            status, _, raw = request(s.url, "POST", "/v1/completions",
                                     {"prompt": PROMPT, "max_tokens": 2})
            assert status == 200, raw
        first = seen[0]
        assert first is not None and first.matched_blocks.tolist() == [MATCHED, 0]
        # routing recorded the prompt on the approximate backend alone
        assert s.call(lambda: st.router.prefixes.holds(0)) == held
        second = seen[1]
        assert second is not None and second.matched_blocks.tolist()[0] == MATCHED
        status_doc = _instances(s)[0]["kv_events"]
        assert status_doc["batches"] >= 1 and status_doc["age_s"] is not None
        status, _, text = request(s.url, "GET", "/metrics")
        samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
                   for f in text_string_to_metric_families(text.decode()) for m in f.samples}
        assert samples[("olproute_prefix_index_exact", (("instance", "e-0"),))] == 1.0
        assert samples[("olproute_prefix_index_exact", (("instance", "e-1"),))] == 0.0
        assert samples[("olproute_kv_events", (("instance", "e-0"), ("what", "batches")))] \
            >= 1
        assert ("olproute_kv_events_age_seconds", (("instance", "e-0"),)) in samples
    finally:
        s.close()
        pub.close(linger=0)
        ctx.term()


def test_a_tokenizer_that_does_not_load_names_the_backends_key(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, "tcp://127.0.0.1:9", tokenizer="no-such-folder")
    # the start-up step alone (it runs before anything is served or started)
    state = cast(ServerState, SimpleNamespace(loaded=loaded, kv_subscribers=[]))
    with pytest.raises(ConfigError, match=r"server\.backends\[0\]\.kv_events\.tokenizer"
                       r": backend e-0: tokenizer .*no-such-folder does not load"):
        kv_events(state)
