"""The prefix cache in the simulator: requests without block hashes are served exactly as
before, and a cached prefix shortens a request's prefill and its TTFT."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from olproute.config import DEFAULT_CONFIG, LoadedConfig, load_config
from olproute.sim import metrics
from olproute.sim.cluster import SimResult
from olproute.sim.scenario import simulate
from olproute.types import Request
from tests.conftest import make_config

PER_REQUEST = ("instance", "dispatch_s", "first_token_s", "finish_s", "num_preemptions",
               "decode_tokens", "cached_prompt_tokens", "batch_log")


def _caching(loaded: LoadedConfig, on: bool) -> LoadedConfig:
    return loaded.with_updates(instances=tuple(
        inst.model_copy(update={"enable_prefix_caching": on})
        for inst in loaded.config.instances))


def _assert_same_run(a: SimResult, b: SimResult) -> None:
    for name in PER_REQUEST:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("policy", ["bid_price", "round_robin", "least_outstanding"])
def test_without_hashes_the_cache_changes_nothing_on_the_default_scenario(policy: str) -> None:
    """The default scenario, short: prefix caching on (the default) serves every request
    as with it off, to the bit (and each run calibrates on its own profiling run); also on
    a KV cache small enough to preempt."""
    loaded = load_config(DEFAULT_CONFIG)
    loaded = loaded.with_updates(workload=loaded.config.workload.model_copy(
        update={"duration_s": 30}))
    assert all(s.enable_prefix_caching for s in loaded.specs)
    on = simulate(loaded, policy)
    _assert_same_run(on, simulate(_caching(loaded, False), policy))
    assert not on.cached_prompt_tokens.any()
    tiny = loaded.with_updates(instances=(loaded.config.instances[0].model_copy(
        update={"kv_capacity_tokens": 16_000, "replicas": 2}),))
    on = simulate(tiny, policy)
    assert on.num_preemptions.sum() > 0
    _assert_same_run(on, simulate(_caching(tiny, False), policy))


def _one_engine(timing: dict[str, object]) -> LoadedConfig:
    return make_config(instances=[{"name": "one", "model": "llama-2-7b", "gpu": "a100-80gb"}],
                       sim={"timing": "linear", "noise_cv": 0.0} | timing)


def _twice(prompt: int, hashes: np.ndarray | None) -> list[Request]:
    """The same prompt twice, the second long after the first has finished."""
    return [Request(k, 10.0 * k, prompt, 4, 4, 60.0, block_hashes=hashes) for k in range(2)]


def test_a_cached_prompt_prefills_only_its_last_block() -> None:
    beta = (3e-3, 5e-5, 0.0, 0.0)  # fixed overhead + per token: prefill time ~ tokens
    loaded = _one_engine({"linear_beta": beta})
    prompt = 2000  # one chunk (budget 2048), 125 full blocks of 16
    res = simulate(loaded, "round_robin", _twice(prompt, np.arange(125, dtype=np.int64)))
    ttft = res.first_token_s - np.array([0.0, 10.0])
    # the second finds 124 blocks: as vLLM, the prompt's last token (here its whole last
    # block) is computed again
    assert res.cached_prompt_tokens.tolist() == [0, 1984]
    prefill = res.batch_log[res.batch_log[:, 7] > 0]   # num_prefill_tokens
    assert prefill[:, 7].tolist() == [2000, 16]
    assert prefill[:, 10].tolist() == [0, 1984]        # sum_prefill_context
    # each TTFT is one batch: beta0 + beta1 * tokens; beyond the fixed overhead, the
    # second costs what its uncached tokens do
    ratio = 16 / 2000
    assert ttft[1] - beta[0] == pytest.approx((ttft[0] - beta[0]) * ratio, rel=1e-9)
    assert ratio < ttft[1] / ttft[0] <= ratio + beta[0] / ttft[0]
    # without hashes, both prefill the whole prompt
    res = simulate(loaded, "round_robin", _twice(prompt, None))
    assert res.batch_log[res.batch_log[:, 7] > 0][:, 7].tolist() == [2000, 2000]
    assert res.cached_prompt_tokens.tolist() == [0, 0]


def test_a_cached_prompt_is_faster_on_the_roofline_too() -> None:
    loaded = make_config(instances=[{"name": "one", "model": "llama-2-7b",
                                     "gpu": "a100-80gb"}], sim={"noise_cv": 0.0})
    hashes = np.arange(250, dtype=np.int64)
    cached = simulate(loaded, "round_robin", _twice(4000, hashes))
    plain = simulate(loaded, "round_robin", _twice(4000, None))
    ttft = cached.first_token_s - np.array([0.0, 10.0])
    assert ttft[0] == plain.first_token_s[0]
    assert cached.cached_prompt_tokens.tolist() == [0, 3984]
    assert ttft[1] < 0.2 * ttft[0]
    assert ttft[1] >= loaded.config.sim.batch_overhead_ms / 1e3


def test_engines_count_queries_and_hits() -> None:
    from olproute.sim.scenario import make_cluster, make_policy

    loaded = _one_engine({})
    cluster = make_cluster(loaded, make_policy(loaded, "round_robin"))
    res = cluster.run(_twice(2000, np.arange(125, dtype=np.int64)))
    engine = cluster.engines[0]
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (4000, 1984)
    assert res.cached_prompt_tokens.sum() == engine.prefix_cache_hits


def test_hit_rate_is_cached_over_prompt_tokens_of_the_served() -> None:
    loaded = _one_engine({})
    res = simulate(loaded, "round_robin", _twice(2000, np.arange(125, dtype=np.int64)))
    assert metrics.hit_rate(res) == 1984 / 4000
    # a shed request counts in neither sum; nothing served, or no records: NaN
    shed = replace(res, shed=np.array([True, False]))
    assert metrics.hit_rate(shed) == 1984 / 2000
    assert math.isnan(metrics.hit_rate(replace(res, shed=np.array([True, True]))))
    assert math.isnan(metrics.hit_rate(replace(res, cached_prompt_tokens=None)))
    assert metrics.hit_rate(simulate(loaded, "round_robin", _twice(2000, None))) == 0.0


def test_on_pd_pools_the_prefill_instance_caches() -> None:
    """The prefill instance gets the hashes; the decode instance admits the moved KV."""
    loaded = make_config(instances=[
        {"name": "prefill", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill"},
        {"name": "decode", "model": "qwen2.5-3b", "gpu": "a40", "role": "decode"}],
        transfer={"link_gbytes_per_s": 12.5, "latency_ms": 1.0})
    res = simulate(loaded, "round_robin", _twice(2000, np.arange(125, dtype=np.int64)))
    assert res.cached_prompt_tokens.tolist() == [0, 1984]
    assert (res.instance == 0).all() and (res.decode_instance == 1).all()
    prefill = res.batch_log[(res.batch_log[:, 0] == 0) & (res.batch_log[:, 7] > 0)]
    assert prefill[:, 7].tolist() == [2000, 16]
