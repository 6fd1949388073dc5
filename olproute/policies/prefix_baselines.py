"""Prefix-cache-aware baselines, as their authors ship them: SGLang's router policy
``cache_aware`` and the llm-d inference scheduler's default scheduling profile
(``prefix_load``).

Each of them keeps its own approximate index of where prompts went (SGLang a radix tree
of characters per worker, llm-d an LRU of prompt-block hashes per pod); here both match
prompts in the router's index instead (``ctx.prefixes``, ``olproute.routing.prefix_index``: an
LRU of 16-token block hashes per instance, bounded by the instance's KV blocks), so that
they differ from each other, and from our policies, in their rule alone. SGLang's rule
also reads the size of each worker's tree, which ``cache_aware`` keeps as SGLang does
(far larger than a KV cache; see there). A request without
block hashes carries no match (``ctx.prefixes`` is None) and each rule reads it as a
prompt that matches nothing (in the server: a prompt given as a bare token count,
which it cannot hash).

Both route mixed pools only. SGLang's disaggregated mode runs a separate policy per pool
(``--prefill-policy`` / ``--decode-policy``) and llm-d's decides per request whether to
disaggregate at all (its P/D profile handler): neither is this rule run on each pool, so
a P/D configuration is refused by name (the registry's ``disaggregated``).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from olproute.policies._common import FloatArray, IntArray, NoFeedback, figures, pick_best
from olproute.policies.base import REGISTRY, PolicyEnv, PolicyParams, Weight, dispatch
from olproute.types import Decision, RoutingContext


def _hit_fraction(ctx: RoutingContext) -> FloatArray:
    """Per instance, matched blocks / the request's blocks (0 without hashes)."""
    if ctx.prefixes is None:
        return np.zeros(len(ctx.instances))
    return ctx.prefixes.hit_fraction


# -- SGLang ---------------------------------------------------------------------------------
# characters a token stands for in SGLang's tree sizes (it counts text; we have tokens)
CHARS_PER_TOKEN = 4
class CacheAwareParams(PolicyParams):
    """``router.policy_params.cache_aware``. The defaults are those SGLang's router starts
    with: the CLI of its Rust binary (``sgl-router/src/main.rs``, commit 0773f04) and of
    its Python launcher (``RouterArgs`` in ``sgl-router/py_src/sglang_router/
    router_args.py``, commit e46dcd8) both set cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval 120 s,
    max_tree_size 2**26 characters; the bounds are its ``ConfigValidator``'s
    (``sgl-router/src/config/validation.rs``). The library's own
    ``CacheAwareConfig::default()`` (``sgl-router/src/policies/mod.rs``: 0.5, 32, 1.1,
    30 s, 10,000) applies only to a router built without either launcher.
    The two eviction settings bound the size of each worker's tree, which its third
    branch reads (``CacheAware``)."""

    cache_threshold: float = Field(
        default=0.3, ge=0.0, le=1.0, strict=True, allow_inf_nan=False,
        description="a best match rate above this routes to the longest match")
    balance_abs_threshold: int = Field(
        default=64, ge=0, strict=True,
        description="imbalanced when max - min outstanding exceeds this (and the ratio)")
    balance_rel_threshold: float = Field(
        default=1.5, ge=1.0, strict=True, allow_inf_nan=False,
        description="imbalanced when max outstanding exceeds this x min (and the gap)")
    eviction_interval_secs: float = Field(
        default=120.0, gt=0.0, strict=True, allow_inf_nan=False,
        description="how often a tree larger than max_tree_size is cut back to it")
    max_tree_size: int = Field(
        default=2**26, ge=1, strict=True,
        description="characters a worker's tree keeps after an eviction")


class CacheAware(NoFeedback):
    """SGLang's router ``cache_aware`` policy (``sgl-router/src/policies/cache_aware.rs``,
    commit 026f853), in three branches:

    1. load imbalanced, ``max - min > balance_abs_threshold`` and ``max > min x
       balance_rel_threshold`` over the instances' outstanding requests (SGLang's
       ``worker.load()``, the router's count of its requests in flight there): the least
       loaded instance, the first of them on a tie (Rust's ``min_by_key``);
    2. else, when the best match rate exceeds ``cache_threshold``: the instance with the
       longest match;
    3. else the instance whose tree is smallest (fewest characters), the one that "has
       the most cache to spare".

    SGLang's match rate is the characters its radix tree matches over the request's
    characters; ours is the request's matched 16-token blocks over its blocks (the
    index's ``hit_fraction``). SGLang breaks ties in branches 2 and 3 by hash-map
    iteration order (the first tenant of the deepest matched node; the first smallest
    tenant), which is arbitrary: here a draw from the policy's generator.

    A request without hashes matches nothing and goes to branch 3.

    The tree sizes are the policy's own, as SGLang's: each dispatch inserts the prompt
    into the worker's tree, which grows by the part not matched there (all of it without
    hashes), and every ``eviction_interval_secs`` a tree over ``max_tree_size`` is cut
    back to it (SGLang evicts least recently used leaves until it fits). SGLang counts
    characters of text and we have tokens: a token is taken as 4 characters (the usual
    figure for English text under BPE tokenizers). Its tree is far larger than a KV
    cache (2**26 characters, about 16M tokens, against 405k on an H100 serving
    Qwen3-8B), so its third branch sends a request to the worker sent the least
    unmatched text in the last tens of minutes; the router's index, bounded by the KV
    cache, fills on every instance within minutes and would make that branch a coin
    flip. Its matches come from the router's index, which forgets what the engine has
    likely evicted: a better guess than SGLang's larger tree.

    ``score`` in the explanation is what the branch taken ranks by, higher better
    (minus outstanding, the match rate, minus indexed blocks), so that the router's
    health fallback picks by the same rule among the healthy instances."""

    name = "cache_aware"

    def __init__(self, env: PolicyEnv, params: CacheAwareParams) -> None:
        self.params = params
        self._rng = env.rng
        # per worker: characters of its tree, and when trees were last cut back
        self._tree: FloatArray = np.zeros(len(env.specs))
        self._cap_chars = float(params.max_tree_size)
        self._evicted_s: float | None = None

    def decide(self, ctx: RoutingContext) -> Decision:
        load = np.array([inst.num_outstanding for inst in ctx.instances], dtype=np.int64)
        rate = _hit_fraction(ctx)
        self._evict(ctx.now_s)
        sizes = self._tree
        p = self.params
        most, least = int(load.max()), int(load.min())
        if most - least > p.balance_abs_threshold and most > least * p.balance_rel_threshold:
            g, score = int(np.argmin(load)), -load.astype(np.float64)
            reason = (f"load imbalanced (outstanding {least} to {most}): fewest "
                      "outstanding")
        elif rate.max() > p.cache_threshold:
            g, score = pick_best(rate, self._rng), rate
            reason = f"match rate {rate.max():.2f} > {p.cache_threshold:g}: longest match"
        else:
            score = -sizes
            g = pick_best(score, self._rng)
            reason = (f"match rate {rate.max():.2f} <= {p.cache_threshold:g}: smallest "
                      "tree")
        why = figures(score=score.copy(), outstanding=load, hit_fraction=rate,
                      tree_chars=sizes.copy())
        self._insert(ctx, g)
        return dispatch(ctx, g, reason, why)

    def _evict(self, now_s: float) -> None:
        """Every ``eviction_interval_secs``: trees over ``max_tree_size`` cut back to it."""
        if self._evicted_s is None:
            self._evicted_s = now_s
        elif now_s - self._evicted_s >= self.params.eviction_interval_secs:
            np.minimum(self._tree, self._cap_chars, out=self._tree)
            self._evicted_s = now_s

    def _insert(self, ctx: RoutingContext, g: int) -> None:
        """Worker g's tree takes the prompt: its part not matched there."""
        cached = 0 if ctx.prefixes is None else int(ctx.prefixes.cached_tokens[g])
        self._tree[g] += CHARS_PER_TOKEN * max(ctx.request.prompt_tokens - cached, 0)


REGISTRY.register(CacheAware.name, CacheAwareParams)(CacheAware)


# -- llm-d ----------------------------------------------------------------------------------
class PrefixLoadParams(PolicyParams):
    """``router.policy_params.prefix_load``: the weights of llm-d's default scheduling
    profile, the same in its config loader's built-in default
    (``pkg/epp/config/loader/defaults.go``) and in its Helm chart
    (``config/charts/epplib/templates/_config.yaml``), llm-d/llm-d-inference-scheduler
    commit 520af47: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3,
    picked by the max-score picker."""

    prefix_cache_weight: Weight = Field(default=3.0, description="weight of the "
                                        "prefix-cache scorer (matched / request blocks)")
    queue_weight: Weight = Field(default=2.0, description="weight of the queue scorer "
                                 "(waiting requests, min-max normalised, inverted)")
    kv_cache_utilization_weight: Weight = Field(
        default=2.0, description="weight of the KV-cache-utilization scorer "
        "(1 - used / total KV blocks)")


def queue_scores(waiting: IntArray) -> FloatArray:
    """llm-d's queue scorer: ``(max - q) / (max - min)`` of the waiting queues, 1 for
    every instance when they are all equal."""
    most, least = int(waiting.max()), int(waiting.min())
    if most == least:
        return np.ones(len(waiting))
    result: FloatArray = (most - waiting) / float(most - least)
    return result


class PrefixLoad(NoFeedback):
    """llm-d's inference scheduler, default profile: three scorers, each in [0, 1]
    (clipped there, as its scheduler profile's ``enforceScoreRange`` does), summed with
    the profile's weights; the highest sum wins, exact ties at random (its max-score
    picker shuffles the candidates before a stable sort; here a draw from the policy's
    generator). Per instance g:

    - prefix-cache scorer: matched blocks / the request's blocks
      (``scorer/prefix/plugin.go``; 0 without hashes, as with no blocks), from the
      router's index where llm-d uses its approximate-prefix producer's LRU of block
      hashes per pod, whose capacity it likewise infers from the pods' KV cache;
    - queue scorer: g's waiting requests (vLLM's ``num_requests_waiting``), min-max
      normalised over the instances and inverted (``scorer/queuedepth/queue.go``);
    - KV-cache-utilization scorer: ``1 - used / total KV blocks``
      (``scorer/kvcacheutilization/kvcache_utilization.go``), vLLM's
      ``kv_cache_usage_perc``, where a freed block that still caches a prefix counts as
      free.

    llm-d scrapes the two engine figures from each pod's metrics every few tens of
    milliseconds; here they are the instances' state at decision time. ``score`` in the
    explanation is the weighted sum."""

    name = "prefix_load"

    def __init__(self, env: PolicyEnv, params: PrefixLoadParams) -> None:
        self.params = params
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        p = self.params
        prefix = np.clip(_hit_fraction(ctx), 0.0, 1.0)
        queue = queue_scores(np.array([i.num_waiting for i in ctx.instances], dtype=np.int64))
        used = np.array([i.num_kv_blocks_used / max(i.num_kv_blocks, 1)
                         for i in ctx.instances], dtype=np.float64)
        kv = np.clip(1.0 - used, 0.0, 1.0)
        score = (p.prefix_cache_weight * prefix + p.queue_weight * queue
                 + p.kv_cache_utilization_weight * kv)
        g = pick_best(score, self._rng)
        return dispatch(ctx, g, "highest weighted prefix-cache, queue and KV-cache scores",
                        figures(score=score, prefix_cache=prefix, queue=queue,
                                kv_cache_utilization=kv))


REGISTRY.register(PrefixLoad.name, PrefixLoadParams)(PrefixLoad)
