"""Load-balancing baselines: round robin, random, least outstanding, power of two."""

from __future__ import annotations

import numpy as np

from olproute.policies.base import REGISTRY, Policy, PolicyEnv, check_params, dispatch
from olproute.types import Decision, Outcome, RoutingContext


class _Stateless:
    name = ""

    def observe(self, outcome: Outcome) -> None:
        """Load balancers read the live load in the context; nothing to learn."""


def _least_outstanding(ctx: RoutingContext, candidates: list[int],
                       rng: np.random.Generator) -> int:
    """The candidate with the fewest outstanding requests; ties broken at random."""
    loads = [ctx.instances[i].num_outstanding for i in candidates]
    best = min(loads)
    tied = [c for c, load in zip(candidates, loads, strict=True) if load == best]
    return tied[0] if len(tied) == 1 else tied[int(rng.integers(len(tied)))]


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ())
        self._num = len(env.specs)
        self._next = 0

    def decide(self, ctx: RoutingContext) -> Decision:
        index = self._next
        self._next = (self._next + 1) % self._num
        return dispatch(ctx, index, "next in turn")


class Random(_Stateless):
    name = "random"

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ())
        self._num = len(env.specs)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        return dispatch(ctx, int(self._rng.integers(self._num)), "uniform at random")


class LeastOutstanding(_Stateless):
    """Join the shortest queue, counting requests resident or in flight to the instance."""

    name = "least_outstanding"

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ())
        self._all = list(range(len(env.specs)))
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        index = _least_outstanding(ctx, self._all, self._rng)
        loads = tuple(float(inst.num_outstanding) for inst in ctx.instances)
        return dispatch(ctx, index, "fewest outstanding requests", {"outstanding": loads})


class PowerOfTwo(_Stateless):
    """Two distinct candidates at random; the one with fewer outstanding requests wins."""

    name = "power_of_two"

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ())
        self._num = len(env.specs)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        if self._num == 1:
            return dispatch(ctx, 0, "only instance")
        pair = [int(i) for i in self._rng.choice(self._num, size=2, replace=False)]
        index = _least_outstanding(ctx, pair, self._rng)
        loads = tuple(float(ctx.instances[i].num_outstanding) for i in pair)
        return dispatch(ctx, index, f"fewer outstanding of candidates {pair[0]} and {pair[1]}",
                        {"candidates": (float(pair[0]), float(pair[1])), "outstanding": loads})


def _register(cls: type[RoundRobin | Random | LeastOutstanding | PowerOfTwo]) -> None:
    def factory(env: PolicyEnv) -> Policy:
        return cls(env)
    REGISTRY.register(cls.name)(factory)


for _cls in (RoundRobin, Random, LeastOutstanding, PowerOfTwo):
    _register(_cls)
