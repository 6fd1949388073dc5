"""BEAR (BEAR paper eqs. 5 and 7) and its Prefill-TPS ablation.

Per request, every instance g gets the accuracy-cost utility
``U_g = acc_g - lambda * cost_g`` (eq. 4; ``reward.cost_lambda``, from the request's
outlook) and a TTFT estimate ``T_g``:

- ``bear``: ``T_g`` from the BEA replay of g's snapshot (``olproute.estimate.bea.BeaEstimator``),
  with the request's predicted output length on g's model;
- ``prefill_tps``: ``T_g`` = pending prefill tokens on g, then the prompt, over the
  profiled prefill throughput of g's kind of instance (eq. 8, ``PrefillTpsEstimator``;
  identical replicas share one figure, as a profile per model and GPU would give): the
  paper's ablation.

Parameter ``form``:

- ``constrained`` (default, eq. 5): among the feasible instances ``T_g <= tau_j`` (the
  request's TTFT target) the highest utility; if none is feasible, the least ``T_g``.
- ``lagrangian`` (eq. 7): the highest ``U_g - delta * T_g`` (``reward.delta``, per second).

Ties (equal utility, e.g. replicas of one model) go to the smaller ``T_g``, then to a
coin flip from the policy's generator. The request is always dispatched; holding and
shedding are the bid-price policy's business.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from olproute.estimate.bea import BeaEstimator, PrefillTpsEstimator, TtftEstimator
from olproute.policies._common import NoFeedback, decode_per_instance, figures, pick_best
from olproute.policies.base import REGISTRY, Policy, PolicyEnv, PolicyParams, dispatch
from olproute.types import Decision, RoutingContext

FORMS = ("constrained", "lagrangian")


class BearParams(PolicyParams):
    """``router.policy_params.bear`` (and ``prefill_tps``)."""

    form: Literal["constrained", "lagrangian"] = Field(
        default="constrained", description="constrained (eq. 5): the highest utility among "
        "the instances estimated to meet the TTFT target; lagrangian (eq. 7): the highest "
        "utility - reward.delta x estimated TTFT")


class Bear(NoFeedback):
    """Latency-aware utility maximisation with a TTFT estimator chosen by ``estimator``
    (``bea`` for ``bear``, ``prefill_tps`` for the ablation)."""

    needs_snapshots = True

    def __init__(self, env: PolicyEnv, params: BearParams, estimator: str = "bea") -> None:
        self.name = "bear" if estimator == "bea" else estimator
        self.form = params.form
        cal = env.calibration()
        self._estimator: TtftEstimator
        if estimator == "bea":
            self._estimator = BeaEstimator(env.specs, cal)
        elif estimator == "prefill_tps":
            self._estimator = PrefillTpsEstimator(cal, env.specs)
        else:
            raise ValueError(f"unknown BEAR estimator {estimator!r}")
        self._outlook = env.outlook()
        self._lambda = env.reward.cost_lambda
        self._delta = env.reward.delta
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        outlook = self._outlook(ctx.request)
        utility = outlook.utility(self._lambda)
        ttft = self._estimator.estimate(ctx, decode_per_instance(outlook)).ttft_s
        ttft = np.where(np.isnan(ttft), np.inf, ttft)
        target = ctx.request.ttft_target_s
        feasible = ttft <= target
        why = {"utility": utility, "ttft_s": ttft, "feasible": feasible}
        if self.form == "lagrangian":
            score = utility - self._delta * ttft
            g = pick_best(score, self._rng, tie=ttft)
            reason = f"highest utility - {self._delta:g}/s x estimated TTFT"
            why["score"] = score
        elif feasible.any():
            g = pick_best(utility, self._rng, among=feasible, tie=ttft)
            reason = (f"highest utility of the {int(feasible.sum())} instance(s) whose "
                      f"estimated TTFT meets the {target * 1e3:.0f} ms target")
        else:
            g = pick_best(-ttft, self._rng)
            reason = (f"no instance is estimated to meet the {target * 1e3:.0f} ms TTFT "
                      "target: least estimated TTFT")
        self._estimator.observe_dispatch(g, ctx.now_s)
        return dispatch(ctx, g, reason, figures(**why))


@REGISTRY.register("bear", BearParams)
def _bear(env: PolicyEnv, params: BearParams) -> Policy:
    return Bear(env, params, "bea")


@REGISTRY.register("prefill_tps", BearParams)
def _prefill_tps(env: PolicyEnv, params: BearParams) -> Policy:
    return Bear(env, params, "prefill_tps")
