"""Latency-agnostic quality-cost routing (a BEAR paper baseline): the instance with the
highest utility ``acc_g - lambda * cost_g`` (eq. 4, ``reward.cost_lambda``), whatever
its load. Replicas of one model tie; the tie goes to a coin flip from the policy's
generator, so they share the traffic without the policy looking at them."""

from __future__ import annotations

from olproute.policies._common import NoFeedback, figures, pick_best
from olproute.policies.base import REGISTRY, PolicyEnv, check_params, dispatch
from olproute.types import Decision, RoutingContext


class LatencyAgnostic(NoFeedback):
    name = "latency_agnostic"
    needs_snapshots = False

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ())
        self._outlook = env.outlook()
        self._lambda = env.reward.cost_lambda
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        outlook = self._outlook(ctx.request)
        utility = outlook.utility(self._lambda)
        g = pick_best(utility, self._rng)
        return dispatch(ctx, g, "highest predicted utility (quality - lambda x cost)",
                        figures(utility=utility, quality=outlook.quality,
                                cost_musd=outlook.cost_musd))


REGISTRY.register(LatencyAgnostic.name)(LatencyAgnostic)
