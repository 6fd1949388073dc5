"""Load-balancing baselines: round robin, random, least outstanding, power of two, and
the least-tokens length heuristic.

On disaggregated prefill/decode pools each picks a prefill and a decode instance the
same way, within each pool: round robin keeps one turn per pool, least outstanding
counts a decode instance's requests from dispatch (including those still in prefill or
in transfer towards it) until they finish.
"""

from __future__ import annotations

import numpy as np

from olproute.estimate.bea import remaining_decode_tokens, remaining_prefill_tokens
from olproute.policies.base import REGISTRY, NoParams, Policy, PolicyEnv, dispatch
from olproute.routing.disagg import Pools
from olproute.types import Decision, Outcome, RoutingContext


class _Stateless(Policy):
    def observe(self, outcome: Outcome) -> None:
        """Load balancers read the current load in the context; nothing to learn."""


def _groups(env: PolicyEnv) -> list[list[int]]:
    """The instance groups a decision picks one from: all instances, or the prefill
    pool and then the decode pool."""
    pools = Pools.of(env.specs)
    if pools.disaggregated:
        return [pools.prefill.tolist(), pools.decode.tolist()]
    return [list(range(len(env.specs)))]


def _decide(ctx: RoutingContext, picks: list[int], reason: str,
            explanation: dict[str, tuple[float, ...]] | None = None) -> Decision:
    return dispatch(ctx, picks[0], reason, explanation,
                    decode_index=picks[1] if len(picks) > 1 else None)


def _least_outstanding(ctx: RoutingContext, candidates: list[int],
                       rng: np.random.Generator) -> int:
    """The candidate with the fewest outstanding requests; ties broken at random."""
    loads = [ctx.instances[i].num_outstanding for i in candidates]
    best = min(loads)
    tied = [c for c, load in zip(candidates, loads, strict=True) if load == best]
    return tied[0] if len(tied) == 1 else tied[int(rng.integers(len(tied)))]


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._groups = _groups(env)
        self._next = [0] * len(self._groups)

    def decide(self, ctx: RoutingContext) -> Decision:
        picks = []
        for k, group in enumerate(self._groups):
            picks.append(group[self._next[k]])
            self._next[k] = (self._next[k] + 1) % len(group)
        return _decide(ctx, picks, "next in turn")


class Random(_Stateless):
    name = "random"

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._groups = _groups(env)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        picks = [group[int(self._rng.integers(len(group)))] for group in self._groups]
        return _decide(ctx, picks, "uniform at random")


class LeastOutstanding(_Stateless):
    """Join the shortest queue, counting requests resident or in flight to the instance."""

    name = "least_outstanding"

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._groups = _groups(env)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        picks = [_least_outstanding(ctx, group, self._rng) for group in self._groups]
        loads = tuple(float(inst.num_outstanding) for inst in ctx.instances)
        return _decide(ctx, picks, "fewest outstanding requests", {"outstanding": loads})


class PowerOfTwo(_Stateless):
    """Two distinct candidates at random; the one with fewer outstanding requests wins."""

    name = "power_of_two"

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._groups = _groups(env)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        picks: list[int] = []
        pairs: list[int] = []
        for group in self._groups:
            if len(group) == 1:
                picks.append(group[0])
                continue
            pair = [group[int(i)] for i in self._rng.choice(len(group), size=2, replace=False)]
            pairs.extend(pair)
            picks.append(_least_outstanding(ctx, pair, self._rng))
        if not pairs:
            return _decide(ctx, picks, "only instance")
        loads = tuple(float(ctx.instances[i].num_outstanding) for i in pairs)
        names = " / ".join(f"{a} and {b}" for a, b in zip(pairs[::2], pairs[1::2], strict=True))
        return _decide(ctx, picks, f"fewer outstanding of candidates {names}",
                       {"candidates": tuple(float(i) for i in pairs), "outstanding": loads})


class LeastTokens(_Stateless):
    """Length heuristic: the instance with the fewest tokens of work left, from the
    snapshots and the request lengths they hold. On mixed instances that is the prompt
    tokens still to prefill plus the predicted output tokens still to generate; on
    pools, the prefill instance with the fewest prompt tokens queued and the decode
    instance with the fewest predicted output tokens left, counting the requests bound
    for it that are still in prefill or in transfer (``ctx.inbound``). Ties at random."""

    name = "least_tokens"
    needs_snapshots = True

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._pools = Pools.of(env.specs)
        self._all = list(range(len(env.specs)))
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        snaps = ctx.snapshots
        if snaps is None:
            raise ValueError(f"policy {self.name!r} needs instance snapshots in the context")
        n = len(snaps)
        prefill, decode = np.zeros(n), np.zeros(n)
        for g, snap in enumerate(snaps):
            prefill[g] = float(remaining_prefill_tokens(snap).sum())
            decode[g] = float(remaining_decode_tokens(snap).sum())
            rows = None if ctx.pending is None else ctx.pending[g]
            if rows is not None and rows.shape[0]:
                prefill[g] += float(rows[:, 0].sum())
                decode[g] += float(rows[:, 1].sum())
            inbound = None if ctx.inbound is None else ctx.inbound[g]
            if inbound is not None and inbound.shape[0]:
                decode[g] += float(inbound[:, 1].sum())
        if self._pools.disaggregated:
            picks = [self._least(prefill, self._pools.prefill.tolist()),
                     self._least(decode, self._pools.decode.tolist())]
            reason = "fewest prompt tokens queued / predicted output tokens left"
        else:
            picks = [self._least(prefill + decode, self._all)]
            reason = "fewest tokens of work left"
        return _decide(ctx, picks, reason, {"prefill_tokens": tuple(prefill.tolist()),
                                            "decode_tokens": tuple(decode.tolist())})

    def _least(self, load: np.ndarray, group: list[int]) -> int:
        values = load[group]
        tied = [group[i] for i in np.flatnonzero(values == values.min())]
        return tied[0] if len(tied) == 1 else tied[int(self._rng.integers(len(tied)))]


for _cls in (RoundRobin, Random, LeastOutstanding, PowerOfTwo, LeastTokens):
    REGISTRY.register(_cls.name, NoParams, disaggregated=True)(_cls)
