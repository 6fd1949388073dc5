"""SCORE-style quality-cost-latency routing (Lakha et al. 2025, a BEAR paper baseline).

SCORE balances predicted response quality against weighted cost and latency penalties,
estimating latency as queueing delay plus predicted output length times the model's
per-token time. Per instance g:

    latency_g = pending prefill of g's waiting requests / prefill throughput_g
                + o_g x tpot_g                         (``olproute.estimate.bea.ScoreEstimator``)
    score_g   = w_quality x acc_g - w_cost x cost_g - w_latency x latency_g

with ``o_g`` the request's predicted output length on g's model, the prefill throughput
from calibration, accuracy and cost (micro-USD) from the request's outlook, and
``tpot_g`` g's decode step now: the calibrated beta at g's current decode load (its
residents, the router's dispatches its snapshot does not hold yet, and this request), as
SCORE measures per-token time on the running instance. A frozen profiled TPOT per
instance differs between identical replicas by calibration noise alone and herds every
request onto the replica that happened to profile fastest. The highest score wins; ties
go to the smaller latency, then a coin flip.

Parameters (all >= 0): ``w_quality`` (default 1), ``w_cost`` (default
``reward.cost_lambda``, so the first two terms are the BEAR utility), ``w_latency``
(default ``reward.delta``, per second). With the defaults the latency is SCORE's full
completion-time estimate, whose decode part usually dwarfs the queueing part: SCORE
then leans to the fastest model, which is the baseline's nature, not a bug.
"""

from __future__ import annotations

from pydantic import Field

from olproute.estimate.bea import ScoreEstimator
from olproute.policies._common import NoFeedback, decode_per_instance, figures, pick_best
from olproute.policies.base import REGISTRY, PolicyEnv, PolicyParams, Weight, dispatch
from olproute.types import Decision, RoutingContext


class ScoreParams(PolicyParams):
    """``router.policy_params.score``."""

    w_quality: Weight = Field(default=1.0, description="weight of the predicted quality")
    w_cost: Weight | None = Field(default=None, description="weight of the cost, per "
                                  "micro-USD; null: reward.cost_lambda")
    w_latency: Weight | None = Field(default=None, description="weight of the latency "
                                     "estimate, per second; null: reward.delta")


class Score(NoFeedback):
    name = "score"
    needs_snapshots = True

    def __init__(self, env: PolicyEnv, params: ScoreParams) -> None:
        self.w_quality = params.w_quality
        self.w_cost = env.reward.cost_lambda if params.w_cost is None else params.w_cost
        self.w_latency = env.reward.delta if params.w_latency is None else params.w_latency
        self._estimator = ScoreEstimator(env.calibration(), env.specs)
        self._outlook = env.outlook()
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        outlook = self._outlook(ctx.request)
        latency = self._estimator.estimate(ctx, decode_per_instance(outlook)).ttft_s
        score = (self.w_quality * outlook.quality - self.w_cost * outlook.cost_musd
                 - self.w_latency * latency)
        g = pick_best(score, self._rng, tie=latency)
        self._estimator.observe_dispatch(g, ctx.now_s)
        return dispatch(
            ctx, g, "highest quality - weighted cost - weighted (queue delay + decode time)",
            figures(quality=outlook.quality, cost_musd=outlook.cost_musd, latency_s=latency,
                    score=score))


REGISTRY.register(Score.name, ScoreParams)(Score)
