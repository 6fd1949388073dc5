"""Latency-agnostic quality-cost routing (a BEAR paper baseline): the model with the
highest utility ``acc_g - lambda * cost_g`` (eq. 4, ``reward.cost_lambda``), whatever
its load.

The paper's setting has a quality-cost router choose the model and "separate
system-level load balancers based on policies such as join-the-shortest-queue"
distribute queries across the replicas of each model. So replicas of the chosen model
(which tie on utility: same quality, same prices) are told apart by the fewest
outstanding requests, as join-the-shortest-queue does, then by a coin flip from the
policy's generator. On a pool of one model every instance ties on utility, and the
policy is ``least_outstanding``.
"""

from __future__ import annotations

import numpy as np

from olproute.policies._common import NoFeedback, figures, pick_best
from olproute.policies.base import REGISTRY, NoParams, PolicyEnv, dispatch
from olproute.types import Decision, RoutingContext


class LatencyAgnostic(NoFeedback):
    name = "latency_agnostic"
    needs_snapshots = False

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        self._outlook = env.outlook()
        self._lambda = env.reward.cost_lambda
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        outlook = self._outlook(ctx.request)
        utility = outlook.utility(self._lambda)
        outstanding = np.array([i.num_outstanding for i in ctx.instances], dtype=np.float64)
        g = pick_best(utility, self._rng, tie=outstanding)
        return dispatch(ctx, g, "highest predicted utility (quality - lambda x cost); "
                        "among replicas, fewest outstanding",
                        figures(utility=utility, quality=outlook.quality,
                                cost_musd=outlook.cost_musd, outstanding=outstanding))


REGISTRY.register(LatencyAgnostic.name, NoParams)(LatencyAgnostic)
