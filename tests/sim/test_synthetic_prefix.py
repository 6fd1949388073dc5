"""Synthetic workloads with their prompts' block hashes (``workload.prefix_hashes``): off
by default (requests carry none, so results stay as they were); on, each request carries
its text's hashes as the router names a live prompt's blocks, and the simulator's
engines and router index find repeated prefixes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from olproute.config.loader import ConfigError
from olproute.routing.prefix_index import text_block_hashes
from olproute.sim.requests import with_block_hashes
from olproute.sim.scenario import build_requests, simulate
from tests.conftest import make_config

POOL = [{"name": "q8b", "model": "qwen3-8b", "gpu": "h100", "replicas": 2}]


def _synthetic(**workload: object) -> list:  # type: ignore[type-arg]
    loaded = make_config(instances=POOL, workload={"kind": "synthetic", "rate_per_s": 20.0,
                                                   "num_requests": 60, **workload})
    return build_requests(loaded, seed=3)


def test_off_by_default_and_on_only_adds_the_hashes() -> None:
    off = _synthetic()
    on = _synthetic(prefix_hashes=True)
    assert all(r.block_hashes is None for r in off)
    assert on == off   # hashes take no part in equality: everything else is the same
    for r in on:
        assert r.text is not None and r.block_hashes is not None
        assert r.block_hashes.tolist() == text_block_hashes(r.text, 16).tolist()
        assert len(r.block_hashes) <= r.prompt_tokens // 16


def test_hashes_are_capped_at_the_prompts_full_blocks() -> None:
    """A request whose token count is below its word count keeps only the hashes of its
    full blocks of tokens."""
    r = replace(_synthetic()[0], text=" ".join(["w"] * 64), prompt_tokens=40)
    (hashed,) = with_block_hashes([r], 16)
    assert hashed.block_hashes is not None and len(hashed.block_hashes) == 2
    assert with_block_hashes([replace(r, text=None)], 16)[0].block_hashes is None


def test_the_block_size_must_be_the_instances() -> None:
    with pytest.raises(ConfigError, match=r"workload\.block_tokens"):
        _synthetic(prefix_hashes=True, block_tokens=8)


def test_a_simulation_with_hashes_finds_repeated_prefixes() -> None:
    """Every prompt twice, the copies long after the originals: without hashes nothing
    is found cached; with them the copies find their prompts' blocks (on the engine
    the original went to, when the copy goes there too)."""
    loaded = make_config(instances=POOL, workload={
        "kind": "synthetic", "rate_per_s": 5.0, "num_requests": 30, "prefix_hashes": True},
        sim={"timing": "linear", "noise_cv": 0.0})
    reqs = build_requests(loaded)
    twice = [replace(r, request_id=i + k * len(reqs), arrival_s=r.arrival_s + k * 100.0)
             for k in range(2) for i, r in enumerate(reqs)]
    bare = [replace(r, block_hashes=None) for r in twice]
    none = simulate(loaded, "round_robin", requests=bare).cached_prompt_tokens
    assert none is not None and not none.any()
    cached = simulate(loaded, "round_robin", requests=twice).cached_prompt_tokens
    assert cached is not None
    first, second = cached[:len(reqs)], cached[len(reqs):]
    # round robin over two engines with an even count: each copy goes where its original went
    # (a prompt's last token is computed again)
    expected = [min(0 if r.block_hashes is None else len(r.block_hashes),
                    (r.prompt_tokens - 1) // 16) * 16
                for r in reqs]
    assert second.tolist() == expected
    assert sum(expected) > 0
    assert (first <= second).all()
