"""RouteBalance-style routing (Da and Kalyvianaki 2026, a BEAR paper baseline).

RouteBalance combines predicted quality with cost and latency scores normalised across
the candidate instances. Per request, over the instances g:

    latency_g = tpot_g x pending decode tokens on g / batch size_g
                  (``olproute.estimate.bea.RouteBalanceEstimator``, wait part)
    q, c, l   = min-max normalisation to [0, 1] across instances of acc_g, cost_g,
                latency_g (a figure equal on every instance normalises to 0)
    score_g   = w_quality x q_g - w_cost x c_g - w_latency x l_g

Pending decode tokens are the residents' predicted remaining output (from the snapshot),
the batch size is the calibrated mean number of requests per batch, and accuracy and
cost (micro-USD) come from the request's outlook. The latency is the estimator's wait
(the time to drain the residents' decode work), not its TTFT: the new prompt's own
prefill time would differ between idle instances by milliseconds, and min-max
normalisation would blow that up to a full unit of penalty. The highest score wins;
ties go to the smaller latency, then a coin flip.

Parameters (all >= 0): ``w_quality``, ``w_cost``, ``w_latency``, default 1 each (our
choice: equal weights on the three normalised figures).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from olproute.estimate.bea import RouteBalanceEstimator
from olproute.policies._common import (
    FloatArray,
    NoFeedback,
    decode_per_instance,
    figures,
    pick_best,
)
from olproute.policies.base import REGISTRY, PolicyEnv, PolicyParams, Weight, dispatch
from olproute.types import Decision, RoutingContext


class RouteBalanceParams(PolicyParams):
    """``router.policy_params.route_balance``."""

    w_quality: Weight = Field(default=1.0, description="weight of the normalised quality")
    w_cost: Weight = Field(default=1.0, description="weight of the normalised cost")
    w_latency: Weight = Field(default=1.0, description="weight of the normalised latency")


def min_max(x: FloatArray) -> FloatArray:
    """``x`` scaled to [0, 1] by its minimum and maximum; all zeros when they are equal
    (or when ``x`` is not finite everywhere and its finite part is constant)."""
    finite = np.isfinite(x)
    if not finite.any():
        return np.zeros_like(x)
    lo, hi = float(x[finite].min()), float(x[finite].max())
    scaled = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
    result: FloatArray = np.where(finite, scaled, 1.0)
    return result


class RouteBalance(NoFeedback):
    name = "route_balance"
    needs_snapshots = True

    def __init__(self, env: PolicyEnv, params: RouteBalanceParams) -> None:
        self.w_quality = params.w_quality
        self.w_cost = params.w_cost
        self.w_latency = params.w_latency
        self._estimator = RouteBalanceEstimator(env.calibration())
        self._outlook = env.outlook()
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        outlook = self._outlook(ctx.request)
        latency = self._estimator.estimate(ctx, decode_per_instance(outlook)).wait_s
        q, c, lat = min_max(outlook.quality), min_max(outlook.cost_musd), min_max(latency)
        score = self.w_quality * q - self.w_cost * c - self.w_latency * lat
        g = pick_best(score, self._rng, tie=latency)
        self._estimator.observe_dispatch(g, ctx.now_s)
        return dispatch(
            ctx, g, "highest weighted normalised quality - cost - latency",
            figures(quality=outlook.quality, cost_musd=outlook.cost_musd, latency_s=latency,
                    quality_norm=q, cost_norm=c, latency_norm=lat, score=score))


REGISTRY.register(RouteBalance.name, RouteBalanceParams)(RouteBalance)
