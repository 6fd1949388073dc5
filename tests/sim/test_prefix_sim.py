"""The prefix cache in the simulator: requests without block hashes are served exactly as
before, and a cached prefix shortens a request's prefill and its TTFT."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from olproute.config.loader import DEFAULT_CONFIG, LoadedConfig, load_config
from olproute.estimate.bea import BeaEstimator
from olproute.estimate.calibration import InstanceCalibration
from olproute.policies import Policy
from olproute.sim import metrics
from olproute.sim.cluster import Cluster, SimResult
from olproute.sim.scenario import build_timers, make_policy, simulate
from olproute.types import (
    SNAP_COMPUTED,
    Decision,
    EngineSnapshot,
    Outcome,
    Request,
    RoutingContext,
)
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
    # bid_price replays the prefill pool with its cached prefixes (the index's match
    # taken on that pool's instances): the second prompt's prefill is one block there too
    res = simulate(loaded, "bid_price", _twice(2000, np.arange(125, dtype=np.int64)))
    assert res.cached_prompt_tokens.tolist() == [0, 1984]


class _PrefixProbe(Policy):
    """Round robin, recording for each request the router's cached-prefix estimate on
    the instance it goes to and BEA's TTFT there: with that estimate, without it, and
    with it but with nothing cached for the queued requests."""

    needs_snapshots = True

    def __init__(self, loaded: LoadedConfig, bea: BeaEstimator) -> None:
        self._inner = make_policy(loaded, "round_robin")
        self._bea = bea
        self.seen: dict[int, tuple[int, int, float, float, float]] = {}

    def decide(self, ctx: RoutingContext) -> Decision:
        d = self._inner.decide(ctx)
        g = d.instance
        assert g is not None and ctx.prefixes is not None
        assert ctx.snapshots is not None
        blind = replace(ctx, prefixes=None)
        queue_blind = replace(ctx, snapshots=tuple(_nothing_cached_waiting(s)
                                                   for s in ctx.snapshots))
        self.seen[ctx.request.request_id] = (
            g, int(ctx.prefixes.cached_tokens[g]), float(self._bea.estimate(ctx).ttft_s[g]),
            float(self._bea.estimate(blind).ttft_s[g]),
            float(self._bea.estimate(queue_blind).ttft_s[g]))
        return d

    def observe(self, outcome: Outcome) -> None:
        self._inner.observe(outcome)


def _nothing_cached_waiting(snap: EngineSnapshot) -> EngineSnapshot:
    table = snap.table.copy()
    table[snap.num_running:, SNAP_COMPUTED] = 0
    return replace(snap, table=table)


def _documents(rng: np.random.Generator, n: int) -> list[Request]:
    """Requests on 4 shared documents (hash chains of 20 to 120 blocks), each with a
    question of its own (2 to 10 blocks and a partial one), arriving 0.15 s apart on
    average (about a queue of 2 for the instance below)."""
    docs = [np.arange(1000 * (d + 1), 1000 * (d + 1) + rng.integers(20, 121),
                      dtype=np.int64) for d in range(4)]
    out, t = [], 0.0
    for k in range(n):
        doc = docs[int(rng.integers(0, 4))]
        own = np.arange(10**6 + 100 * k, 10**6 + 100 * k + rng.integers(2, 11),
                        dtype=np.int64)
        hashes = np.concatenate([doc, own])
        t += float(rng.exponential(0.015))
        out.append(Request(k, t, 16 * len(hashes) + int(rng.integers(1, 16)),
                           int(rng.integers(5, 60)), 0, 60.0, block_hashes=hashes))
    return [replace(r, predicted_decode_tokens=r.decode_tokens) for r in out]


def test_a_cached_prefix_shortens_the_simulated_ttft_by_what_the_replay_predicts() -> None:
    """Truth = the 4-term model, no noise, true lengths as predictions, live snapshots,
    one instance, requests sharing long document prefixes: where the router's index
    expected exactly the prefix the engine found and no later arrival came before the
    first token, BEA's replay (prefilling only the uncached tokens of the new request,
    and of the queued ones as the snapshot finds them cached) gives the simulated TTFT
    to rounding; without the prefix it would be off."""
    beta = (2e-3, 4e-5, 2e-8, 3e-9)
    loaded = make_config(
        instances=[{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "max_num_seqs": 16,
                    "max_num_batched_tokens": 1024, "kv_capacity_tokens": 60_000}],
        sim={"timing": "linear", "noise_cv": 0.0, "linear_beta": list(beta)})
    cal = InstanceCalibration(beta=beta, prefill_tokens_per_s=20_000.0, tpot_s=0.01,
                              mean_batch_seqs=8.0, service_rate_per_s=10.0, service_scv=1.0)
    probe = _PrefixProbe(loaded, BeaEstimator(loaded.specs, [cal]))
    reqs = _documents(np.random.default_rng(5), 150)
    res = Cluster(loaded.specs, build_timers(loaded), probe, slot_s=0.05).run(reqs)
    ttft = metrics.ttft_s(res)
    arrival = np.array([r.arrival_s for r in reqs])
    exact = hits = queued_hits = 0
    for rid, (_g, cached, est, blind, queue_blind) in probe.seen.items():
        later = (arrival > arrival[rid]) & (arrival < res.first_token_s[rid])
        if later.any() or cached != res.cached_prompt_tokens[rid]:
            continue
        assert est == pytest.approx(ttft[rid], rel=1e-9, abs=1e-12)
        exact += 1
        if cached > 0:
            hits += 1
            assert blind > ttft[rid] * (1 + 1e-6)
        queued_hits += queue_blind > ttft[rid] * (1 + 1e-6)
    # most checked requests found a prefix; some waited behind queued requests that did
    assert exact > 0.4 * len(reqs) and hits > 0.95 * exact and queued_hits > 5
