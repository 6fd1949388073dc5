"""The router's prefix index live, in front of two emulated backends: a proxied prompt
gets its block hashes, the policy's context its prefix as the index finds it on each
backend, a dispatch carried out is recorded where it went (a ``/route`` query is not),
and a backend marked down is forgotten. The emulators name the same blocks (the cache
hits they count are the router's estimate); ``/instances`` and ``/metrics`` show each
backend's indexed blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from olproute.types import PrefixMatch, RoutingContext
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, TOKEN, _config, request

BLOCK = 16
NUM_WORDS = 400
PROMPT = " ".join(f"w{i}" for i in range(NUM_WORDS))
HASHED = NUM_WORDS // BLOCK               # the prompt's full blocks: 25
MATCHED = (NUM_WORDS - 1) // BLOCK        # what a match may count: 24 (the last token is
                                          # computed again)


def _stack(tmp_path: Path) -> Stack:
    loaded = load_config(_config(
        tmp_path, router={"policy": "round_robin", "slot_ms": 20},
        server={"health_period_s": 0.1, "scrape_period_s": 0.2, "admin_token": TOKEN,
                "emulator_time_scale": 0.05, "emulator_exact_lengths": True},
        instances=[{"name": "e", "model": "llama-2-7b", "gpu": "a100-80gb", "replicas": 2,
                    "block_size": BLOCK}]))
    return Stack(loaded, num_fakes=0, calibration=CalibrationSource(loaded, known=[CAL] * 2))


def _record_prefixes(s: Stack) -> list[PrefixMatch | None]:
    """Every context's ``prefixes`` the policy sees, from now on."""
    seen: list[PrefixMatch | None] = []
    policy = s.app[STATE].router.policy
    decide = policy.decide

    def recording(ctx: RoutingContext) -> Any:
        seen.append(ctx.prefixes)
        return decide(ctx)

    s.call(lambda: setattr(policy, "decide", recording))
    return seen


def _instances(s: Stack) -> list[dict[str, Any]]:
    status, _, body = request(s.url, "GET", "/instances")
    assert status == 200
    out: list[dict[str, Any]] = json.loads(body)["instances"]
    return out


def _complete(s: Stack, body: dict[str, Any], chat: bool = False) -> str:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, headers, raw = request(s.url, "POST", path, {**body, "max_tokens": 2})
    assert status == 200, raw
    return headers["x-olproute-instance"]


def test_repeated_prompts_match_where_they_went_and_a_down_backend_is_forgotten(
        tmp_path: Path) -> None:
    s = _stack(tmp_path)
    try:
        seen = _record_prefixes(s)
        emus = s.app[STATE].emulators
        assert [b["prefix_index_blocks"] for b in _instances(s)] == [0, 0]
        # round robin: e-0, e-1, e-0, then a chat of the same words to e-1
        went = [_complete(s, {"prompt": PROMPT}) for _ in range(3)]
        went.append(_complete(s, {"messages": [
            {"role": "system", "content": " ".join(PROMPT.split()[:100])},
            {"role": "user", "content": " ".join(PROMPT.split()[100:])}]}, chat=True))
        assert went == ["e-0", "e-1", "e-0", "e-1"]
        assert all(p is not None and p.request_blocks == HASHED for p in seen)
        matched = [p.matched_blocks.tolist() for p in seen if p is not None]
        assert matched == [[0, 0], [MATCHED, 0], [MATCHED, MATCHED], [MATCHED, MATCHED]]
        assert seen[1] is not None and seen[1].cached_tokens.tolist() == [MATCHED * BLOCK, 0]
        # the emulators hashed the same blocks: each found what the router expected
        assert [e.instance.prefix_cache_hits for e in emus] == [MATCHED * BLOCK] * 2
        assert [b["prefix_index_blocks"] for b in _instances(s)] == [HASHED, HASHED]

        # a /route query is a decision not carried out: it reads the index, adds nothing
        other = " ".join(f"x{i}" for i in range(NUM_WORDS))
        status, _, _ = request(s.url, "POST", "/route", {"prompt": other})
        assert status == 200
        assert seen[-1] is not None and seen[-1].matched_blocks.tolist() == [0, 0]
        assert [b["prefix_index_blocks"] for b in _instances(s)] == [HASHED, HASHED]

        status, _, text = request(s.url, "GET", "/metrics")
        gauges = {sample.labels["instance"]: sample.value
                  for f in text_string_to_metric_families(text.decode())
                  for sample in f.samples if sample.name == "olproute_prefix_index_blocks"}
        assert gauges == {"e-0": HASHED, "e-1": HASHED}

        # e-1 goes away: the health check marks it down, and its index is cleared
        s.run(emus[1].stop())
        assert wait_until(lambda: not _instances(s)[1]["healthy"])
        assert [b["prefix_index_blocks"] for b in _instances(s)] == [HASHED, 0]
        assert _complete(s, {"prompt": PROMPT}) == "e-0"
        assert seen[-1] is not None and seen[-1].matched_blocks.tolist() == [MATCHED, 0]
    finally:
        s.close()


def test_token_id_prompts_are_hashed_alike_by_the_router_and_the_emulators(
        tmp_path: Path) -> None:
    """A prompt given as token ids: the router hashes blocks of ids as the emulators do
    (in a space of their own), so the second of two equal id prompts sent to the same
    backend matches there, and that backend's hits are the router's estimate."""
    s = _stack(tmp_path)
    try:
        seen = _record_prefixes(s)
        ids = list(range(1000, 1000 + NUM_WORDS))
        went = [_complete(s, {"prompt": ids}), _complete(s, {"prompt": PROMPT}),
                _complete(s, {"prompt": ids})]
        assert went == ["e-0", "e-1", "e-0"]
        matched = [p.matched_blocks.tolist() for p in seen if p is not None]
        # the text prompt of other words shares nothing with the id prompt
        assert matched == [[0, 0], [0, 0], [MATCHED, 0]]
        emus = s.app[STATE].emulators
        assert [e.instance.prefix_cache_hits for e in emus] == [MATCHED * BLOCK, 0]
    finally:
        s.close()


def test_a_reload_keeps_the_index(tmp_path: Path) -> None:
    """``POST /admin/reload`` builds a new router over the same backends: what the old
    one indexed stays."""
    s = _stack(tmp_path)
    try:
        _complete(s, {"prompt": PROMPT})
        before = s.app[STATE].router
        status, _, body = request(s.url, "POST", "/admin/reload", {},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, body
        assert s.app[STATE].router is not before
        assert [b["prefix_index_blocks"] for b in _instances(s)] == [HASHED, 0]
    finally:
        s.close()
