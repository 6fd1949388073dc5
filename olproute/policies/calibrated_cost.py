"""Calibrate-then-Route cost (arXiv 2609.16206): send the request where it adds the
least estimated completion cost. Per instance g:

    cost_g = w_backlog x backlog_g x size
           + w_service x o_g x tpot_g x (1 + rho x press_g) x size
           + w_queue x queue_g

- ``backlog_g`` (s): prefill tokens still to run on g (the snapshot's residents plus the
  router's own dispatches the snapshot does not hold yet) over g's calibrated prefill
  throughput.
- ``o_g x tpot_g`` (s): the request's predicted output length on g's model times g's
  time per output token now: one decode step of g's residents, the router's requests on
  their way to g (dispatches its snapshot does not hold yet, and on a decode instance
  those still in prefill or transfer) and this one, timed by g's batch-time
  coefficients calibrated from batch logs (``decode_step_times_s``). Calibrated, not
  taken from simulator constants (the paper's point is that calibration matters), and
  kept current: a profiled mean TPOT is a constant that differs between identical replicas by
  calibration noise alone, and a least-cost rule over it piles traffic onto the replica
  that happened to profile fastest.
- ``press_g``: KV pressure after admission, ``(blocks in use + blocks of the pending
  dispatches + blocks of this request at its predicted peak, prompt + o_g) / total
  blocks - kv_threshold``, positive part.
- ``queue_g``: requests waiting on g (not yet running), pending dispatches included.
- ``size`` = s / s_ref, the prompt's length relative to a reference: ``size_ref_tokens``
  when given, else the running mean prompt length of the requests this policy has
  routed (this one included). It makes long prompts weigh time more than queue counts.

The least cost wins; ties go to a coin flip from the policy's generator.

The abstract names the inputs (exact prompt length, predicted output length,
post-admission KV pressure, SLO class) and the objective (additional completion time),
not the formula. What we chose where it is silent: the weighted sum above with
w_backlog = w_service = w_queue = 1, rho = 1 and kv_threshold = 0.8 (all parameters);
"post-admission" pressure counts the request at its peak footprint; the size factor is
relative to the mean prompt; the SLO class does not enter (one weight profile for all
classes; per-class weights would be the natural extension). On mixed instances, which
serve both phases, the backlog term stands for the prefill pool and the service term for
the decode pool. On disaggregated pools (as in the paper) the prefill instance is the
least ``w_backlog x backlog x size + w_queue x queue`` of the prefill pool and the decode
instance the least ``w_service x service x size + w_queue x queue`` of the decode pool,
whose queue and KV blocks count the requests bound for it still in prefill or transfer
(``ctx.inbound``). Its warning
about greedy herding under scarcity applies: the policy sees its own dispatches at once
(fresh snapshots, or the pending dispatches with stale ones), which damps but does not
remove it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from olproute.estimate.bea import decode_step_times_s, remaining_prefill_tokens
from olproute.policies._common import (
    FloatArray,
    NoFeedback,
    decode_per_instance,
    figures,
    pick_best,
)
from olproute.policies.base import REGISTRY, PolicyEnv, PolicyParams, Weight, dispatch
from olproute.routing.disagg import Pools
from olproute.types import Decision, EngineSnapshot, InstanceSpec, RoutingContext


class CalibratedCostParams(PolicyParams):
    """``router.policy_params.calibrated_cost``."""

    w_backlog: Weight = Field(default=1.0, description="weight of the prefill backlog "
                              "term, per second")
    w_service: Weight = Field(default=1.0, description="weight of the KV-pressured decode "
                              "time term, per second")
    w_queue: Weight = Field(default=1.0, description="weight per request waiting")
    rho: Weight = Field(default=1.0, description="how much KV pressure stretches the "
                        "decode time")
    kv_threshold: Weight = Field(default=0.8, le=1, description="KV use (fraction of the "
                                 "blocks) past which pressure counts")
    size_ref_tokens: Weight | None = Field(
        default=None, gt=0, description="the reference prompt length of the size factor; "
        "null: the running mean prompt length")


def _blocks(tokens: FloatArray, block_size: int) -> FloatArray:
    result: FloatArray = np.ceil(tokens / block_size)
    return result


def instance_state(snaps: Sequence[EngineSnapshot], specs: Sequence[InstanceSpec],
                   pending: Sequence[FloatArray | None] | None,
                   inbound: Sequence[FloatArray | None] | None = None,
                   ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per instance: prefill tokens still to run, requests waiting, KV blocks in use,
    counting the router's dispatches after a stale snapshot (``ctx.pending`` rows of
    prompt, predicted decode, dispatch time) as waiting with their prompt's blocks, and
    on a decode instance the requests bound for it (``ctx.inbound``) likewise, without
    prefill tokens (their prompt is computed elsewhere)."""
    n = len(snaps)
    prefill, waiting, used = np.zeros(n), np.zeros(n), np.zeros(n)
    for g, (snap, spec) in enumerate(zip(snaps, specs, strict=True)):
        prefill[g] = float(remaining_prefill_tokens(snap).sum())
        waiting[g] = float(snap.num_resident - snap.num_running)
        used[g] = float(spec.num_kv_blocks - snap.num_free_blocks)
        rows = None if pending is None else pending[g]
        if rows is not None and rows.shape[0] > 0:
            if spec.role != "decode":
                prefill[g] += float(rows[:, 0].sum())
            waiting[g] += rows.shape[0]
            used[g] += float(_blocks(rows[:, 0], spec.block_size).sum())
        rows = None if inbound is None else inbound[g]
        if rows is not None and rows.shape[0] > 0:
            waiting[g] += rows.shape[0]
            used[g] += float(_blocks(rows[:, 0], spec.block_size).sum())
    return prefill, waiting, used


def _on_their_way(num_instances: int, *sources: Sequence[FloatArray | None] | None
                  ) -> list[FloatArray | None]:
    """Per instance, the rows (prompt first) of requests the router sent there that its
    snapshot does not show yet: ``ctx.pending`` and ``ctx.inbound`` rows together."""
    out: list[FloatArray | None] = []
    for g in range(num_instances):
        parts = [rows for src in sources if src is not None
                 for rows in (src[g],) if rows is not None and rows.shape[0] > 0]
        out.append(np.concatenate(parts) if parts else None)
    return out


class CalibratedCost(NoFeedback):
    name = "calibrated_cost"
    needs_snapshots = True

    def __init__(self, env: PolicyEnv, params: CalibratedCostParams) -> None:
        self.w_backlog = params.w_backlog
        self.w_service = params.w_service
        self.w_queue = params.w_queue
        self.rho = params.rho
        self.kv_threshold = params.kv_threshold
        self.size_ref_tokens = params.size_ref_tokens
        cal = env.calibration()
        self._prefill_tps = np.array([c.prefill_tokens_per_s for c in cal], dtype=np.float64)
        self._beta = np.array([c.beta for c in cal], dtype=np.float64)
        self._total_blocks = np.array([s.num_kv_blocks for s in env.specs], dtype=np.float64)
        self._block_size = np.array([s.block_size for s in env.specs], dtype=np.float64)
        self._outlook = env.outlook()
        self._rng = env.rng
        self._pools = Pools.of(env.specs)
        self._prompt_sum = 0.0
        self._num_routed = 0

    def _size(self, prompt_tokens: int) -> float:
        if self.size_ref_tokens is not None:
            return prompt_tokens / self.size_ref_tokens
        self._prompt_sum += prompt_tokens
        self._num_routed += 1
        return prompt_tokens / (self._prompt_sum / self._num_routed)

    def decide(self, ctx: RoutingContext) -> Decision:
        if ctx.snapshots is None:
            raise ValueError(f"policy {self.name!r} needs instance snapshots in the context")
        req = ctx.request
        outlook = self._outlook(req)
        decode = decode_per_instance(outlook).astype(np.float64)
        prefill, queue, used = instance_state(ctx.snapshots, ctx.specs, ctx.pending,
                                              ctx.inbound)
        own = np.ceil((req.prompt_tokens + decode) / self._block_size)
        press = np.maximum((used + own) / self._total_blocks - self.kv_threshold, 0.0)
        size = self._size(req.prompt_tokens)
        backlog = prefill / self._prefill_tps
        tpot = decode_step_times_s(ctx.snapshots, ctx.specs, self._beta, req.prompt_tokens,
                                   _on_their_way(len(ctx.specs), ctx.pending, ctx.inbound))
        service = decode * tpot * (1.0 + self.rho * press)
        explain = dict(backlog_s=backlog, service_s=service, tpot_s=tpot, kv_pressure=press,
                       queue=queue, size=np.full(len(backlog), size))
        if self._pools.disaggregated:
            pre = self.w_backlog * backlog * size + self.w_queue * queue
            dec = self.w_service * service * size + self.w_queue * queue
            cost = np.where(self._pools.role_mask("prefill"), pre, dec)
            g = pick_best(-pre, self._rng, among=self._pools.role_mask("prefill"))
            d = pick_best(-dec, self._rng, among=self._pools.role_mask("decode"))
            return dispatch(ctx, g, "least calibrated cost: prefill backlog + queue on the "
                            "prefill pool, KV-pressured decode time + queue on the decode pool",
                            figures(cost=cost, **explain), decode_index=d)
        cost = (self.w_backlog * backlog * size + self.w_service * service * size
                + self.w_queue * queue)
        g = pick_best(-cost, self._rng)
        return dispatch(
            ctx, g, "least calibrated cost (prefill backlog + KV-pressured decode time "
            "+ queue)", figures(cost=cost, **explain))


REGISTRY.register(CalibratedCost.name, CalibratedCostParams, disaggregated=True)(CalibratedCost)
