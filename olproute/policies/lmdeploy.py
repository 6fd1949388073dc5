"""LMDeploy-style load balancing (a BEAR paper baseline).

LMDeploy's proxy, strategy ``min_expected_latency``, sends a request to the node with
the least ``unfinished / speed``: ``unfinished`` is the proxy's own count of requests it
sent the node that have not finished, ``speed`` a per-node throughput (a node without
one gets the mean of the known speeds, 1 when none is known), and nodes are visited in
random order so ties fall at random.

Our rule: ``expected_latency_g = (outstanding_g + 1) / mu_g``, least wins, ties at random
(from the policy's generator). ``outstanding_g`` is the router's count of requests
dispatched to g and not finished (``InstanceLoad.num_outstanding``, never stale, so no
snapshot is needed); the ``+ 1`` counts the new request, as
``olproute.estimate.bea.LmdeployEstimator`` does, so an idle pool prefers the fastest instance
instead of a coin flip. ``mu_g`` is the calibrated request throughput
(``service_rate_per_s``, requests per busy second at saturation); an instance whose
calibration has none gets the mean of the known ones, or 1 when none is known (the
rule then reduces to least outstanding), as LMDeploy does for nodes without a speed.
"""

from __future__ import annotations

import numpy as np

from olproute.policies._common import NoFeedback, figures, pick_best
from olproute.policies.base import REGISTRY, NoParams, PolicyEnv, dispatch
from olproute.types import Decision, RoutingContext


class Lmdeploy(NoFeedback):
    name = "lmdeploy"
    needs_snapshots = False

    def __init__(self, env: PolicyEnv, params: NoParams) -> None:
        known = [c.service_rate_per_s for c in env.calibration()]
        rates = [mu for mu in known if mu is not None and mu > 0]
        fill = float(np.mean(rates)) if rates else 1.0
        self.speed = np.array([mu if mu is not None and mu > 0 else fill for mu in known],
                              dtype=np.float64)
        self._rng = env.rng

    def decide(self, ctx: RoutingContext) -> Decision:
        unfinished = np.array([inst.num_outstanding for inst in ctx.instances],
                              dtype=np.float64)
        latency = (unfinished + 1.0) / self.speed
        g = pick_best(-latency, self._rng)
        return dispatch(ctx, g, "least (unfinished requests + 1) / request throughput",
                        figures(unfinished=unfinished, speed_per_s=self.speed,
                                expected_latency_s=latency))


REGISTRY.register(Lmdeploy.name, NoParams)(Lmdeploy)
