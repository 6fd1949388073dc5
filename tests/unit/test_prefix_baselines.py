"""The prefix-cache-aware baselines on hand-built contexts: SGLang's ``cache_aware`` (each
of its three branches and its thresholds) and llm-d's ``prefix_load`` (its three scorers
and their default weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from olproute.policies import REGISTRY, Policy, PolicyEnv, PolicyError
from olproute.policies.prefix_baselines import queue_scores
from olproute.types import (
    InstanceLoad,
    InstanceSpec,
    PrefixMatch,
    Request,
    Role,
    RoutingContext,
)

KV_BLOCKS = 1000


def _specs(n: int, roles: Sequence[Role] | None = None) -> tuple[InstanceSpec, ...]:
    return tuple(InstanceSpec(name=f"i{i}", model="llama-2-7b", gpu="a100-80gb",
                              tensor_parallel=1, max_num_seqs=256,
                              max_num_batched_tokens=2048, block_size=16,
                              num_kv_blocks=KV_BLOCKS,
                              role="mixed" if roles is None else roles[i])
                 for i in range(n))


def _policy(name: str, n: int, seed: int = 0, **params: Any) -> Policy:
    env = PolicyEnv(specs=_specs(n), rng=np.random.default_rng(seed), params=params)
    return REGISTRY.create(name, env)


def _match(matched: Sequence[int], request_blocks: int,
           index_blocks: Sequence[int] | None = None) -> PrefixMatch:
    blocks = np.array(matched, dtype=np.int64)
    index = np.array(index_blocks if index_blocks is not None else [100] * len(matched),
                     dtype=np.int64)
    return PrefixMatch(cached_tokens=16 * blocks, matched_blocks=blocks,
                       request_blocks=request_blocks, index_blocks=index)


def _ctx(outstanding: Sequence[int], prefixes: PrefixMatch | None = None,
         waiting: Sequence[int] | None = None, kv_used: Sequence[int] | None = None,
         request_id: int = 0) -> RoutingContext:
    """Instance g has outstanding[g] requests, waiting[g] of them waiting (default none)
    and kv_used[g] of its KV blocks in use (default none)."""
    n = len(outstanding)
    specs = _specs(n)
    waits = [0] * n if waiting is None else list(waiting)
    used = [0] * n if kv_used is None else list(kv_used)
    loads = tuple(InstanceLoad(index=g, name=s.name, num_running=outstanding[g] - waits[g],
                               num_waiting=waits[g], num_outstanding=outstanding[g],
                               num_kv_blocks_used=used[g], num_kv_blocks=KV_BLOCKS,
                               max_num_seqs=s.max_num_seqs)
                  for g, s in enumerate(specs))
    req = Request(request_id=request_id, arrival_s=0.1 * request_id, prompt_tokens=16 * 10 + 5,
                  decode_tokens=50, predicted_decode_tokens=50, ttft_target_s=0.5)
    return RoutingContext(request=req, now_s=req.arrival_s, instances=loads, specs=specs,
                          prefixes=prefixes)


# -- cache_aware (SGLang) -------------------------------------------------------------------
@pytest.mark.parametrize(("outstanding", "expected"), [
    ([100, 10, 30], 1),    # gap 90 > 64 and 100 > 1.5 x 10: the fewest outstanding
    ([0, 100, 0], 0),      # tied fewest: the first, as Rust's min_by_key
    ([65, 0, 20], 1),      # gap 65 > 64, 65 > 0
])
def test_cache_aware_sends_to_the_fewest_outstanding_when_imbalanced(
        outstanding: list[int], expected: int) -> None:
    """A full match on instance 0 does not count while the load is imbalanced."""
    d = _policy("cache_aware", 3).decide(_ctx(outstanding, _match([10, 0, 0], 10)))
    assert d.instance == expected
    assert d.reason.startswith("load imbalanced")
    assert d.explanation["score"] == tuple(-float(x) for x in outstanding)


@pytest.mark.parametrize("outstanding", [
    [64, 0, 0],            # gap 64, not > 64
    [200, 134, 150],       # gap 66 > 64, but 200 <= 1.5 x 134 = 201
])
def test_cache_aware_is_balanced_unless_both_thresholds_are_passed(
        outstanding: list[int]) -> None:
    d = _policy("cache_aware", 3).decide(_ctx(outstanding, _match([10, 0, 0], 10)))
    assert d.instance == 0 and d.reason.endswith("longest match")


def test_cache_aware_sends_a_match_above_the_threshold_to_the_longest_match() -> None:
    d = _policy("cache_aware", 3).decide(
        _ctx([5, 0, 0], _match([2, 7, 5], 10, index_blocks=[900, 900, 10])))
    assert d.instance == 1
    assert d.reason == "match rate 0.70 > 0.3: longest match"
    assert d.explanation["score"] == pytest.approx((0.2, 0.7, 0.5))
    assert d.explanation["hit_fraction"] == d.explanation["score"]


PROMPT = 16 * 10 + 5      # _ctx's request: 10 full blocks and 5 tokens


def test_cache_aware_sends_a_match_at_or_below_the_threshold_to_the_smallest_tree() -> None:
    """Its trees grow by what each dispatch did not match there (4 characters a token);
    0.3 is not above the default threshold 0.3: the smallest tree wins."""
    policy = _policy("cache_aware", 3)
    assert policy.decide(_ctx([0, 0, 0], _match([7, 0, 0], 10))).instance == 0
    assert policy.decide(_ctx([1, 0, 0], _match([0, 7, 0], 10))).instance == 1
    d = policy.decide(_ctx([1, 1, 0], _match([3, 0, 0], 10)))
    grown = 4.0 * (PROMPT - 16 * 7)
    assert d.instance == 2
    assert d.reason == "match rate 0.30 <= 0.3: smallest tree"
    assert d.explanation["tree_chars"] == (grown, grown, 0.0)
    assert d.explanation["score"] == (-grown, -grown, -0.0)


def test_cache_aware_without_hashes_inserts_the_whole_prompt() -> None:
    """A request without hashes matches nothing (branch 3) and its whole prompt enters
    the tree it goes to."""
    policy = _policy("cache_aware", 3)
    policy.decide(_ctx([0, 0, 0], _match([7, 0, 0], 10)))
    policy.decide(_ctx([1, 0, 0], _match([0, 7, 0], 10)))
    d = policy.decide(_ctx([1, 1, 0]))
    assert d.instance == 2 and d.explanation["hit_fraction"] == (0.0, 0.0, 0.0)
    d = policy.decide(_ctx([1, 1, 1]))
    grown = 4.0 * (PROMPT - 16 * 7)
    assert d.explanation["tree_chars"] == (grown, grown, 4.0 * PROMPT)
    assert d.instance in (0, 1)


def test_cache_aware_cuts_its_trees_back_every_eviction_interval() -> None:
    """Trees over max_tree_size are cut back to it once per eviction interval, not in
    between (SGLang's eviction thread)."""
    policy = _policy("cache_aware", 3, max_tree_size=300, eviction_interval_secs=1.0)
    for k in range(3):   # at 0.0, 0.1, 0.2 s: 660 characters each to 0, 1, 2
        policy.decide(_ctx([0, 0, 0], _match([0, 0, 0], 10, None), request_id=k))
    d = policy.decide(_ctx([0, 0, 0], _match([0, 0, 0], 10), request_id=5))
    assert sorted(d.explanation["tree_chars"]) == [4.0 * PROMPT] * 3
    d = policy.decide(_ctx([0, 0, 0], _match([0, 0, 0], 10), request_id=10))   # 1.0 s
    assert d.explanation["tree_chars"] == (300.0, 300.0, 300.0)


def test_cache_aware_takes_its_threshold_from_its_parameters() -> None:
    ctx = _ctx([0, 0, 0], _match([2, 7, 5], 10, [50, 80, 20]))
    assert _policy("cache_aware", 3, cache_threshold=0.8).decide(ctx).instance == 2
    loose = _policy("cache_aware", 3, balance_abs_threshold=200, balance_rel_threshold=1.0)
    assert loose.decide(_ctx([150, 0, 0], _match([10, 0, 0], 10))).instance == 0


def test_cache_aware_breaks_match_and_size_ties_with_its_generator() -> None:
    """SGLang's ties fall in hash-map order; here a draw from the policy's generator:
    reproducible from the seed, and each tied instance drawn over seeds."""
    longest = _ctx([0, 0, 0], _match([6, 6, 0], 10))
    smallest = _ctx([0, 0, 0], _match([0, 0, 0], 10))    # every tree empty
    for ctx, tied in ((longest, {0, 1}), (smallest, {0, 1, 2})):
        picks = [_policy("cache_aware", 3, seed=s).decide(ctx).instance for s in range(20)]
        assert set(picks) == tied
        assert picks == [_policy("cache_aware", 3, seed=s).decide(ctx).instance
                         for s in range(20)]


# -- prefix_load (llm-d) --------------------------------------------------------------------
@pytest.mark.parametrize(("waiting", "expected"), [
    ([3, 1, 5], [0.5, 1.0, 0.0]),
    ([2, 2, 2], [1.0, 1.0, 1.0]),
    ([0, 7], [1.0, 0.0]),
])
def test_queue_scores_are_min_max_normalised_and_inverted(
        waiting: list[int], expected: list[float]) -> None:
    assert queue_scores(np.array(waiting, dtype=np.int64)).tolist() == expected


def test_prefix_load_sums_its_scorers_with_llm_ds_default_weights() -> None:
    """Weights 3 (prefix), 2 (queue), 2 (KV free): a 0.9 match on the busiest instance
    (3 x 0.9 + 2 x 0 + 2 x 0.5 = 3.7) loses to an idle one (2 + 2 = 4); a full match with
    less KV in use (3 + 0 + 2 x 0.8 = 4.6) wins."""
    policy = _policy("prefix_load", 3)
    d = policy.decide(_ctx([4, 0, 1], _match([9, 0, 0], 10), waiting=[2, 0, 1],
                           kv_used=[500, 0, 0]))
    assert d.instance == 1
    assert d.explanation["score"] == pytest.approx((3.7, 4.0, 3.0))
    assert d.explanation["prefix_cache"] == pytest.approx((0.9, 0.0, 0.0))
    assert d.explanation["queue"] == (0.0, 1.0, 0.5)
    assert d.explanation["kv_cache_utilization"] == (0.5, 1.0, 1.0)
    d = policy.decide(_ctx([4, 0, 1], _match([10, 0, 0], 10), waiting=[2, 0, 1],
                           kv_used=[200, 0, 0]))
    assert d.instance == 0 and d.explanation["score"] == pytest.approx((4.6, 4.0, 3.0))


def test_prefix_load_takes_its_weights_from_its_parameters() -> None:
    ctx = _ctx([4, 0, 1], _match([10, 0, 0], 10), waiting=[2, 0, 1], kv_used=[200, 0, 0])
    assert _policy("prefix_load", 3, prefix_cache_weight=0.0).decide(ctx).instance == 1
    only_prefix = _policy("prefix_load", 3, queue_weight=0.0, kv_cache_utilization_weight=0)
    assert only_prefix.decide(_ctx([9, 0, 0], _match([3, 0, 0], 10), waiting=[9, 0, 0],
                                    kv_used=[999, 0, 0])).instance == 0


def test_prefix_load_without_hashes_scores_no_prefix() -> None:
    d = _policy("prefix_load", 3).decide(_ctx([3, 1, 2], waiting=[3, 1, 2],
                                              kv_used=[0, 100, 0]))
    assert d.explanation["prefix_cache"] == (0.0, 0.0, 0.0)
    assert d.explanation["score"] == pytest.approx((2.0, 3.8, 3.0))
    assert d.instance == 1


def test_prefix_load_breaks_ties_with_its_generator() -> None:
    """llm-d's max-score picker shuffles before it sorts: ties fall at random."""
    ctx = _ctx([0, 0, 0], _match([5, 5, 0], 10))
    picks = [_policy("prefix_load", 3, seed=s).decide(ctx).instance for s in range(20)]
    assert set(picks) == {0, 1}
    assert picks == [_policy("prefix_load", 3, seed=s).decide(ctx).instance
                     for s in range(20)]


# -- parameters and pools ---------------------------------------------------------------------
@pytest.mark.parametrize(("name", "params", "message"), [
    ("cache_aware", {"x": 1}, "parameter x: unknown key"),
    ("cache_aware", {"eviction_interval_secs": 0.0}, "eviction_interval_secs"),
    ("cache_aware", {"max_tree_size": 0}, "max_tree_size"),
    ("cache_aware", {"cache_threshold": 1.5}, "cache_threshold"),
    ("cache_aware", {"balance_rel_threshold": 0.9}, "balance_rel_threshold"),
    ("cache_aware", {"balance_abs_threshold": True}, "balance_abs_threshold"),
    ("prefix_load", {"x": 1}, "parameter x: unknown key"),
    ("prefix_load", {"queue_weight": -1.0}, "queue_weight"),
])
def test_bad_parameters_are_refused(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=rf"'{name}': .*{message}"):
        _policy(name, 2, **params)


@pytest.mark.parametrize("name", ["cache_aware", "prefix_load"])
def test_defaults_are_the_authors(name: str) -> None:
    params = REGISTRY.entry(name).params()
    expected = ({"cache_threshold": 0.3, "balance_abs_threshold": 64,
                 "balance_rel_threshold": 1.5, "eviction_interval_secs": 120.0,
                 "max_tree_size": 2**26} if name == "cache_aware" else
                {"prefix_cache_weight": 3.0, "queue_weight": 2.0,
                 "kv_cache_utilization_weight": 2.0})
    assert params.model_dump() == expected


@pytest.mark.parametrize("name", ["cache_aware", "prefix_load"])
def test_prefill_decode_pools_are_refused_by_name(name: str) -> None:
    env = PolicyEnv(specs=_specs(2, ["prefill", "decode"]), rng=np.random.default_rng(0))
    with pytest.raises(PolicyError, match=rf"'{name}' cannot route disaggregated"):
        REGISTRY.create(name, env)
