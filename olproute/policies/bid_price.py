"""Bid-price routing (DESIGN.md section 1): for each request and instance

    score_jg = r_jg - delta * TTFT_jg - a_jg . p_g

with r_jg the multi-objective reward, TTFT from the BEA replay and a_jg . p_g the shadow
price of the request's usage column. The request goes to the argmax if its score is
positive and that instance can start it now (a free batch slot, KV blocks for its
prompt, and no more than ``admission.max_waiting`` requests queued there); otherwise it
is held in the router's central buffer and re-scored every slot. When its patience runs
out (default: its TTFT target), ``admission: defer`` sends it to the best instance and
``admission: shed`` refuses it.

Against herding on the momentarily cheapest instance: the TTFT term reads live
snapshots that already hold the router's own dispatches (stale ones get the router's
later dispatches added, ``ctx.pending``), and ``admission.candidates`` samples d of the
G instances per decision. Prices are learned off the request path in ``tick``.

Parameter ``form`` (BEAR's two forms, with the prices):

- ``lagrangian`` (default): the score above, TTFT a cost of delta per second;
- ``constrained``: TTFT a constraint, as BEAR's eq. 5: among the instances predicted
  on time (TTFT, counted from the arrival, within the request's target) the highest
  r_jg - a_jg . p_g, ties to the smaller TTFT; with none on time the request is held
  (a later slot may find one) until its patience, then deferred to the best Lagrangian
  score or shed as ``admission`` says. On disaggregated pools the same over pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field

from olproute.bea import BeaEstimator, decode_step_times_s
from olproute.disagg import Pools
from olproute.outlook import Outlook
from olproute.policies.admission import can_start_now, hold_shed_or_defer
from olproute.policies.base import REGISTRY, Policy, PolicyEnv, PolicyError, PolicyParams
from olproute.policies.bid_price_pools import PoolBidPrice
from olproute.prices import PriceBook, PriceView
from olproute.reward import (
    HARD,
    Columns,
    capacities,
    column_at,
    compute_budget,
    free_capacity,
    reward_terms,
    sample_extent,
    shifted_usage,
    slots_since,
    usage_columns,
)
from olproute.types import Decision, EngineSnapshot, Outcome, Request, RoutingContext

FloatArray = npt.NDArray[np.float64]


class BidPriceParams(PolicyParams):
    """``router.policy_params.bid_price``."""

    backend: Literal["jax", "numpy"] = Field(
        default="jax", description="the dual step's implementation (numpy: the reference)")
    decode_slack: float = Field(
        default=0.25, ge=0, strict=True, allow_inf_nan=False,
        description="disaggregated pools only: the decode admission check plans for the "
        "output running this fraction over its prediction")
    kv_headroom: float = Field(
        default=0.03, ge=0, strict=True, allow_inf_nan=False,
        description="disaggregated pools only: fraction of each decode engine's KV kept "
        "free by admission (as vLLM keeps a watermark of free blocks)")
    form: Literal["lagrangian", "constrained"] = Field(
        default="lagrangian", description="lagrangian: the highest reward - "
        "reward.delta x predicted TTFT - price; constrained (BEAR eq. 5): the highest "
        "reward - price among the instances predicted to meet the TTFT target, else hold "
        "until patience")


POOL_ONLY = ("decode_slack", "kv_headroom")


class BidPrice(Policy):
    name = "bid_price"
    needs_snapshots = True
    takes_beta = True

    def __init__(self, env: PolicyEnv, params: BidPriceParams) -> None:
        self._specs = env.specs
        self._cal = env.calibration()
        self._bea = BeaEstimator(env.specs, self._cal)
        self._outlook = env.outlook()
        self._w = env.reward
        self._adm = env.admission
        self._slot_s = env.slot_s
        self._horizon = env.horizon_slots
        self._batch_cap, self._kv_cap = capacities(env.specs)
        self._budget = compute_budget(self._cal, env.slot_s)
        self._theta = np.array([c.prefill_tokens_per_s for c in self._cal])
        self._rng = env.rng
        self.book = PriceBook(env.specs, env.slot_s, env.horizon_slots, env.prices, env.rng,
                              backend=params.backend, compute_budget=self._budget)
        # the tick refreshes the free capacity the admission checks read even when the
        # prices are not learned (prices.enabled: false keeps them at zero)
        self.tick_s = env.prices.period_slots * env.slot_s
        self._learn = env.prices.enabled
        self._form = params.form
        self._seen: set[int] = set()
        # free capacity (G, H, 2) as of the last tick, less the dispatches since
        self._free: FloatArray | None = None
        self._free_time_s = 0.0

    def decide(self, ctx: RoutingContext) -> Decision:
        req = ctx.request
        snaps = ctx.snapshots
        if snaps is None:
            raise ValueError("bid_price needs instance snapshots in the context")
        out = self._outlook(req)
        est = self._bea.estimate(ctx, predicted_decode=np.rint(out.decode_tokens).astype(
            np.int64))
        ttft = est.ttft_s
        # time per output token at each instance's current decode load
        tpot = decode_step_times_s(snaps, self._specs, self._bea.beta, req.prompt_tokens)
        cols = usage_columns(req.prompt_tokens, out.decode_tokens, ttft, tpot,
                             self._batch_cap, self._kv_cap, self._budget, self._slot_s,
                             self._horizon)
        waited = ctx.now_s - req.arrival_s
        terms = reward_terms(req.prompt_tokens, req.ttft_target_s, out, ttft, tpot,
                             self._w, self._slot_s, self._horizon, waited_s=waited)
        reward = terms.total
        price = self.book.price(cols, ctx.now_s)
        finite_ttft = np.where(np.isfinite(ttft), ttft, 1e9)
        lagrangian = reward - self._w.delta * finite_ttft - price
        on_time = ttft + waited <= req.ttft_target_s
        if req.request_id not in self._seen:  # first sight: a sample of demand
            self._seen.add(req.request_id)
            self.book.observe_arrival(ctx.now_s)
            self.book.add_sample(self._delayed_rewards(req, out, ttft, tpot, waited, reward),
                                 cols, sample_extent(cols, req.prompt_tokens,
                                                     out.decode_tokens, tpot, self._budget,
                                                     self._slot_s))
        candidates = self._candidates()
        score, order = self._ranking(candidates, lagrangian, reward - price, on_time,
                                     finite_ttft)
        g = int(order[0])
        explanation = {"ttft_s": tuple(ttft.tolist()), "tpot_s": tuple(tpot.tolist()),
                       "reward": tuple(reward.tolist()), "price_cost": tuple(price.tolist()),
                       "score": tuple(score.tolist()),
                       "on_time": tuple(on_time.astype(np.float64).tolist()),
                       "decode_tokens": tuple(out.decode_tokens.tolist()),
                       "utility": tuple(out.utility(self._w.cost_lambda).tolist()),
                       "exec_ttft_s": tuple((req.prompt_tokens / self._theta).tolist()),
                       "candidates": tuple(float(c) for c in candidates.tolist()),
                       **terms.as_dict()}
        eligible = order[on_time[order]] if self._form == "constrained" else order
        c = self._first_startable(ctx, snaps, eligible, score, cols)
        if c is not None:
            self._account(c, cols, ctx.now_s)
            among = (f" of the {int(on_time[candidates].sum())} on time"
                     if self._form == "constrained" else "")
            rank = ("best score" if c == g else
                    f"best startable score (best: {score[g]:.3f})")
            return Decision(req.request_id, "dispatch", c, f"{rank}{among} {score[c]:.3f} on "
                            f"{self._specs[c].name}, which can start it now", explanation)
        g, why = self._why_held(ctx, snaps, g, score, bool(on_time[candidates].any()),
                                int(candidates[np.argmax(lagrangian[candidates])]))
        spec = self._specs[g]

        def defer(waited_s: float) -> Decision:
            self._account(g, cols, ctx.now_s)
            return Decision(req.request_id, "dispatch", g, f"deferred to {spec.name} after "
                            f"{waited_s * 1e3:.0f} ms: {why}", explanation)

        return hold_shed_or_defer(ctx, self._adm, why, explanation, self._seen.discard, defer)

    def _delayed_rewards(self, req: Request, out: Outlook, ttft: FloatArray,
                         tpot: FloatArray, waited_s: float, now: FloatArray) -> FloatArray:
        """(G, L) the request's reward on each instance if it started each of the book's
        delays later (the first delay is 0: ``now``, the decision's own reward): the
        demand sample prices every start the LP could choose."""
        later = self.book.delays[1:]
        if later.size == 0:
            return now[:, None]
        ttft_later = ttft[None, :] + later[:, None] * self._slot_s
        terms = reward_terms(req.prompt_tokens, req.ttft_target_s, out, ttft_later, tpot,
                             self._w, self._slot_s, self._horizon, waited_s=waited_s)
        result: FloatArray = np.column_stack([now, terms.total.T])
        return result

    def _why_held(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...], g: int,
                  score: FloatArray, any_on_time: bool, best_late: int) -> tuple[int, str]:
        """(the instance a deferral would take, why nothing takes the request now): the
        best-ranked instance ``g``; under the constrained form with none on time, the best
        Lagrangian score ``best_late``."""
        req = ctx.request
        if self._form == "constrained" and not any_on_time:
            return best_late, (f"no instance is predicted to meet its "
                               f"{req.ttft_target_s * 1e3:.0f} ms TTFT target")
        spec = self._specs[g]
        startable = can_start_now(snaps[g], req.prompt_tokens, spec.block_size,
                                  spec.max_num_seqs, self._adm.max_waiting)
        return g, (f"best score {score[g]:.3f} <= 0" if score[g] <= 0
                   else "no instance with a positive score can start it now" if not startable
                   else "its predicted usage fits no instance with a positive score")

    def _ranking(self, candidates: npt.NDArray[np.int64], lagrangian: FloatArray,
                 net: FloatArray, on_time: npt.NDArray[np.bool_], ttft: FloatArray
                 ) -> tuple[FloatArray, npt.NDArray[np.int64]]:
        """(score per instance, candidates best first) of the policy's form: the
        Lagrangian score, or for ``constrained`` the reward net of the price, the
        instances on time first, ties to the smaller TTFT."""
        if self._form == "constrained":
            order = np.lexsort((ttft[candidates], -net[candidates], ~on_time[candidates]))
            return net, candidates[order]
        return lagrangian, candidates[np.argsort(-lagrangian[candidates], kind="stable")]

    def _first_startable(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...],
                         order: npt.NDArray[np.int64], score: FloatArray,
                         cols: Columns) -> int | None:
        """The first instance of ``order`` (best first) with a positive score that can
        start the request now and hold it as predicted: a lower-scoring free instance
        beats waiting for a busy better one."""
        req = ctx.request
        for c in order:
            c = int(c)
            if score[c] <= 0:
                break
            cspec = self._specs[c]
            if (can_start_now(snaps[c], req.prompt_tokens, cspec.block_size,
                              cspec.max_num_seqs, self._adm.max_waiting)
                    and self._fits(c, cols, ctx.now_s)):
                return c
        return None

    def _window(self, g: int, cols: Columns, now_s: float) -> tuple[slice, FloatArray] | None:
        """The slots of g's free-capacity curve the request's column covers (the curve is
        as of the last tick, so the column moves by the slots elapsed since), and its usage
        there; None before the first tick or when the column misses the curve."""
        if self._free is None:
            return None
        return shifted_usage(column_at(cols, g),
                             slots_since(now_s, self._free_time_s, self._slot_s),
                             self._horizon)

    def _fits(self, g: int, cols: Columns, now_s: float) -> bool:
        """Does the request's predicted usage on g fit under g's free batch slots and KV
        (as of the last tick, less the router's own dispatches since; ``reward.HARD``)?"""
        win = self._window(g, cols, now_s)
        if win is None or self._free is None:
            return True
        span, usage = win
        return bool((self._free[g, span, HARD] - usage[:, HARD]).min() >= 0.0)

    def _account(self, g: int, cols: Columns, now_s: float) -> None:
        """Immediate accounting: the dispatch holds capacity before the next snapshot."""
        win = self._window(g, cols, now_s)
        if win is not None and self._free is not None:
            span, usage = win
            self._free[g, span] -= usage

    def _candidates(self) -> npt.NDArray[np.int64]:
        g = len(self._specs)
        d = self._adm.candidates
        if d is None or d >= g:
            return np.arange(g)
        return np.sort(self._rng.choice(g, size=d, replace=False)).astype(np.int64)

    def observe(self, outcome: Outcome) -> None:
        self.forget(outcome.request_id)

    def forget(self, request_id: int) -> None:
        """Drop what is kept for a request until its outcome (its first sight)."""
        self._seen.discard(request_id)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        """Off the request path: free capacity from the snapshots (residents at their
        instance's current decode speed), then K dual steps (when prices are learned)."""
        tpot = decode_step_times_s(snapshots, self._specs, self._bea.beta, 0)
        free = free_capacity(snapshots, self._specs, tpot, self._budget, self._slot_s,
                             self._horizon)
        self.book.set_free_capacity(free)
        self._free = free.copy()
        self._free_time_s = now_s
        if self._learn:
            self.book.update(now_s)


    def set_beta(self, g: int, beta: Sequence[float]) -> bool:
        """A recalibrated batch-time model for instance g: the BEA replay reads it."""
        self._bea.set_beta(g, beta)
        return True

    def price_view(self) -> PriceView:
        return self.book.view()


@REGISTRY.register("bid_price", BidPriceParams, disaggregated=True)
def bid_price(env: PolicyEnv, params: BidPriceParams) -> Policy:
    """The one ``bid_price`` of the registry, for both kinds of pool: on mixed instances
    :class:`BidPrice` (this module), on disaggregated prefill/decode pools
    :class:`~olproute.policies.bid_price_pools.PoolBidPrice`, which prices pairs of a
    prefill and a decode instance and takes the two pool-only parameters."""
    if Pools.of(env.specs).disaggregated:
        return PoolBidPrice(env, backend=params.backend, decode_slack=params.decode_slack,
                            kv_headroom=params.kv_headroom, form=params.form)
    given = sorted(set(params.model_fields_set) & set(POOL_ONLY))
    if given:
        raise PolicyError(f"policy 'bid_price' takes {', '.join(given)} on disaggregated "
                          "prefill/decode pools only")
    return BidPrice(env, params)
