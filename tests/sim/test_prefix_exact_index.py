"""The simulated routers' prefix index fed by the engines' KV events (``sim.prefix_index:
exact``): on a shared-prefix workload under cache pressure, every router's index ends
holding what each engine's cache holds, and at each dispatch it expected cached exactly
the prefix the engine then found; the approximate index (what the router sent where) is
wrong on some requests of the same workload."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from olproute.config.loader import LoadedConfig
from olproute.routing.prefix_index import PrefixIndex
from olproute.sim.cluster import Cluster, SimResult
from olproute.sim.scenario import build_timers, make_cluster, make_policy
from olproute.types import Request
from tests.conftest import make_config

BLOCK = 16
KV_TOKENS = 2400        # 150 blocks per engine; the documents alone are about 240


def _config(index: str) -> LoadedConfig:
    return make_config(
        instances=[{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                    "max_num_seqs": 16, "max_num_batched_tokens": 1024,
                    "kv_capacity_tokens": KV_TOKENS}],
        sim={"timing": "linear", "noise_cv": 0.0, "prefix_index": index})


def _documents(seed: int, n: int) -> list[Request]:
    """Requests on 6 shared documents (hash chains of 20 to 60 blocks), each with a
    question of its own (2 to 10 blocks and a partial one), a second apart: each finds
    its engines idle (a request takes well under a second here), so the engine looks its
    prefix up the instant it is dispatched."""
    rng = np.random.default_rng(seed)
    docs = [np.arange(1000 * (d + 1), 1000 * (d + 1) + rng.integers(20, 61),
                      dtype=np.int64) for d in range(6)]
    out = []
    for k in range(n):
        own = np.arange(10**6 + 100 * k, 10**6 + 100 * k + rng.integers(2, 11),
                        dtype=np.int64)
        hashes = np.concatenate([docs[int(rng.integers(0, 6))], own])
        decode = int(rng.integers(5, 60))
        out.append(Request(k, 1.0 * k, BLOCK * len(hashes) + int(rng.integers(1, BLOCK)),
                           decode, decode, 60.0, block_hashes=hashes))
    return out


def _run(index: str, policy: str, reqs: list[Request]) -> tuple[Cluster, SimResult]:
    loaded = _config(index)
    cluster = make_cluster(loaded, make_policy(loaded, policy))
    assert cluster.exact_index == (index == "exact")
    return cluster, cluster.run(reqs)


def _evicted_somewhere(res: SimResult, reqs: list[Request]) -> bool:
    """Some engine registered more blocks than it has: entries never outnumber blocks,
    so it evicted."""
    assert res.cached_prompt_tokens is not None
    for g, spec in enumerate(res.specs):
        mine = res.instance == g
        registered = sum(_num_hashes(reqs[i]) for i in np.flatnonzero(mine)) \
            - int(res.cached_prompt_tokens[mine].sum()) // BLOCK
        if registered > spec.num_kv_blocks:
            return True
    return False


def _num_hashes(req: Request) -> int:
    return 0 if req.block_hashes is None else len(req.block_hashes)


def _mismatches(res: SimResult) -> int:
    assert res.expected_cached_tokens is not None and res.cached_prompt_tokens is not None
    return int(np.sum(res.expected_cached_tokens != res.cached_prompt_tokens))


def _assert_indexes_hold_the_caches(cluster: Cluster) -> None:
    assert cluster.prefix_indexes and all(i is not None for i in cluster.prefix_indexes)
    for index in cluster.prefix_indexes:
        assert isinstance(index, PrefixIndex) and all(index.exact)
        for g, engine in enumerate(cluster.engines):
            assert sorted(index.copies(g).items()) == engine.cache_contents()


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_the_exact_index_knows_what_the_engines_hold(policy: str) -> None:
    reqs = _documents(3, 160)
    cluster, res = _run("exact", policy, reqs)
    assert not res.shed.any() and np.isfinite(res.finish_s).all()
    assert _evicted_somewhere(res, reqs)
    assert res.cached_prompt_tokens is not None
    assert (res.cached_prompt_tokens > 0).sum() > 0.3 * len(reqs)
    _assert_indexes_hold_the_caches(cluster)
    assert _mismatches(res) == 0
    # the approximate index, on the same requests: it errs on some of them
    _, approx = _run("approximate", policy, reqs)
    assert _evicted_somewhere(approx, reqs)
    assert _mismatches(approx) > 0


def _busy_at_dispatch(res: SimResult) -> np.ndarray:
    """Per request: a batch was running on its instance when it was dispatched."""
    log = res.batch_log
    busy = np.zeros(len(res.requests), dtype=bool)
    for rid, (g, t) in enumerate(zip(res.instance.tolist(), res.dispatch_s.tolist(),
                                     strict=True)):
        on = log[:, 0] == g
        busy[rid] = bool(np.any((log[on, 1] <= t) & (t < log[on, 1] + log[on, 2])))
    return busy


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_under_load_the_exact_index_errs_only_behind_a_running_batch(policy: str) -> None:
    """Arrivals 50 ms apart: a request dispatched while its engine runs a batch is
    looked up after that batch's events, which the index has not heard yet, and may
    find other blocks; every other request finds exactly what the index expected, and
    the exact index errs on fewer requests than the approximate one."""
    reqs = [replace(r, arrival_s=0.05 * r.arrival_s) for r in _documents(3, 160)]
    cluster, res = _run("exact", policy, reqs)
    _assert_indexes_hold_the_caches(cluster)
    assert res.expected_cached_tokens is not None and res.cached_prompt_tokens is not None
    wrong = res.expected_cached_tokens != res.cached_prompt_tokens
    busy = _busy_at_dispatch(res)
    assert busy.sum() > 0.3 * len(reqs)
    assert not (wrong & ~busy).any()
    _, approx = _run("approximate", policy, reqs)
    assert _mismatches(approx) > int(wrong.sum())


def test_every_router_replica_hears_every_engine() -> None:
    """Two router replicas, each sending half the requests: both indexes hold all of
    both caches, and each replica's expectation at dispatch was the engine's truth."""
    loaded = _config("exact")
    reqs = _documents(4, 120)
    policies = [make_policy(loaded, "cache_aware"), make_policy(loaded, "cache_aware", 1)]
    cluster = Cluster(loaded.specs, build_timers(loaded), policies, slot_s=0.05,
                      snapshot_view="router", prefix_index="exact")
    res = cluster.run(reqs)
    assert len(cluster.prefix_indexes) == 2
    _assert_indexes_hold_the_caches(cluster)
    assert _mismatches(res) == 0 and _evicted_somewhere(res, reqs)


def test_an_overflowing_event_log_is_restored_from_the_cache() -> None:
    """A log too small for one batch's events: the index is rebuilt from the engine's
    contents, and still matches it."""
    loaded = _config("exact")
    reqs = _documents(5, 60)
    cluster = make_cluster(loaded, make_policy(loaded, "round_robin"))
    for engine in cluster.engines:
        engine.core = type(engine.core)(
            engine.spec.num_kv_blocks, BLOCK, engine.spec.max_num_seqs,
            engine.spec.max_num_batched_tokens, kv_events=True, kv_events_capacity=3)
    res = cluster.run(reqs)
    _assert_indexes_hold_the_caches(cluster)
    assert _mismatches(res) == 0


def test_approximate_is_the_default_and_records_its_expectations() -> None:
    loaded = _config("approximate")
    assert make_config().config.sim.prefix_index == "approximate"
    reqs = _documents(3, 40)
    cluster = make_cluster(loaded, make_policy(loaded, "round_robin"))
    assert not cluster.exact_index
    res = cluster.run(reqs)
    assert res.expected_cached_tokens is not None
    (index,) = cluster.prefix_indexes
    assert index is not None and not any(index.exact)
    # round robin alternates: the index expects what it sent to each engine before
    assert res.expected_cached_tokens[:2].tolist() == [0, 0]
    assert (res.expected_cached_tokens > 0).any()
    with pytest.raises(ValueError, match="prefix_index"):
        Cluster(loaded.specs, build_timers(loaded), make_policy(loaded, "round_robin"),
                slot_s=0.05, prefix_index="nearly")  # type: ignore[arg-type]
