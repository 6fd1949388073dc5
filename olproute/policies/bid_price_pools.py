"""Bid-price routing on disaggregated prefill/decode pools (issue 9).

A request is a pair of choices: the prefill instance p that runs its prompt, and the
decode instance d its KV cache moves to, which gives the client its first token and the
rest (``olproute.routing.disagg``). For every pair

    score_pd = r_pd - delta * TTFT_pd - a_p . pi_p - b_pd . mu_d

- ``TTFT_pd = P_p + transfer + tpot_d``: ``P_p`` the BEA replay of p (its residents and
  queue as they stand, the new prompt run to its one token), the KV transfer, and one
  decode step on d for the first token;
- ``tpot_d``: the calibrated time of one decode step of d's residents plus the requests
  bound for it and this one (``beta0 + beta1 n + beta2 sum of contexts``);
- ``r_pd``: the multi-objective reward (``olproute.pricing.reward``) with that TTFT and tpot_d;
- ``a_p . pi_p``: the price of p's **compute** (its prefill token budget b_p, the third
  resource of ``olproute.pricing.reward``, one definition for every pool) and its KV over the
  slots the prompt runs in, ``[k0 - ceil(s / b_p), k0)`` with k0 = ceil(TTFT_p / Delta),
  the slot after the one its prefill ends in;
- ``b_pd . mu_d``: the price of d's **batch slots and KV** over the decode column,
  which starts when the KV arrives (P_p + transfer) and ramps from s + 1 tokens.

Two price books, one per pool, learned off the request path in ``tick``: the prefill
book on samples whose reward for p is the best decode completion net of the decode
prices (max_d r_pd - mu_d), the decode book on samples whose reward for d is net of the
best prefill's price. Each pool's prices thus clear that pool given the other's.

The best pair is dispatched if its score is positive, its prefill instance can start
the prompt now (``admission.max_waiting``), both columns fit under the free capacity
(snapshots as of the last tick, less the router's dispatches since, and on the decode
side less the requests still in prefill or transfer towards it) and d's predicted TPOT
meets the request's TPOT target; the decode check plans for the output running
``decode_slack`` (policy parameter, default 0.25) over its prediction and keeps
``kv_headroom`` (default 0.03) of each decode engine's KV free, as vLLM keeps a
watermark of free blocks. Otherwise the request waits in the router's buffer
and is re-scored every slot: a decode pool at its KV capacity holds admission back
instead of overflowing into preemptions. When its patience runs out (default: its TTFT
target) ``admission: shed`` refuses it and ``defer`` sends it to the decode instance
whose KV fits (else the one it overflows least), TPOT in reach, best score, and to the
prefill instance that can start it now with the best score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from olproute.estimate.bea import BeaEstimator, decode_step_times_s, remaining_prefill_tokens
from olproute.policies.admission import can_start_now, hold_shed_or_defer
from olproute.policies.base import Policy, PolicyEnv, PolicyError
from olproute.policies.bid_price_pairs import PairScores, PoolFigures, score_pairs
from olproute.pricing.book import PriceBook, price_view
from olproute.pricing.reward import (
    COLUMN_FIELDS,
    COMPUTE,
    HARD,
    KV,
    NUM_RESOURCES,
    Column,
    Columns,
    SampleExtent,
    capacities,
    column_at,
    compute_budget,
    free_capacity,
    prefill_load,
    shifted_usage,
    slots_since,
)
from olproute.pricing.step_jax import Backend
from olproute.routing.disagg import Pools
from olproute.types import (
    Decision,
    EngineSnapshot,
    Outcome,
    PriceView,
    RoutingContext,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class _Inbound:
    """A dispatch whose KV has not reached its decode instance: its decode column (as
    of its dispatch) and when it was dispatched."""

    decode: int           # index within the decode pool
    col: Column
    dispatch_s: float
    expires_s: float      # forget it by then even if never seen (a lost request)


class PoolBidPrice(Policy):
    name = "bid_price"
    needs_snapshots = True
    takes_beta = True

    def __init__(self, env: PolicyEnv, *, backend: Backend, decode_slack: float,
                 kv_headroom: float, form: Literal["lagrangian", "constrained"]) -> None:
        """Built by the registry's ``bid_price`` (``olproute.policies.bid_price``) from
        its parameters: the dual step's ``backend``, the decode admission's slack and
        KV headroom (fractions), and the ``form`` (lagrangian or constrained, over
        pairs)."""
        self._form = form
        self._slack = decode_slack
        self._headroom = kv_headroom
        if env.transfer_s is None:
            raise PolicyError("bid_price on disaggregated pools needs the KV transfer time")
        self._transfer: Callable[[int], float] = env.transfer_s
        self._specs = env.specs
        pools = Pools.of(env.specs)
        self._pre, self._dec = pools.prefill, pools.decode
        self._pre_specs = tuple(env.specs[i] for i in self._pre)
        self._dec_specs = tuple(env.specs[i] for i in self._dec)
        cal = env.calibration()
        self._beta = np.array([c.beta for c in cal], dtype=np.float64)
        # the replay runs on the prefill pool only: decode engines never prefill a prompt
        self._bea = BeaEstimator(self._pre_specs, [cal[i] for i in self._pre])
        self._budget = compute_budget([cal[i] for i in self._pre], env.slot_s)
        _, self._pre_kv = capacities(self._pre_specs)
        self._dec_batch, self._dec_kv = capacities(self._dec_specs)
        self._dec_block = np.array([s.block_size for s in self._dec_specs]) / self._dec_kv
        self._pools = PoolFigures(self._pre, self._dec, self._budget, self._pre_kv,
                                  self._dec_batch, self._dec_kv, env.slot_s,
                                  env.horizon_slots, env.reward)
        self._outlook = env.outlook()
        self._adm = env.admission
        self._slot_s = env.slot_s
        self._horizon = env.horizon_slots
        self.book_prefill = PriceBook(self._pre_specs, env.slot_s, env.horizon_slots,
                                      env.prices, env.rng, backend=backend,
                                      compute_budget=self._budget)
        self.book_decode = PriceBook(self._dec_specs, env.slot_s, env.horizon_slots,
                                     env.prices, env.rng, backend=backend)
        # the tick refreshes the free capacity the admission checks read even when the
        # prices are not learned (prices.enabled: false keeps them at zero)
        self.tick_s = env.prices.period_slots * env.slot_s
        self._learn = env.prices.enabled
        self._seen: set[int] = set()
        self._inbound: dict[int, _Inbound] = {}
        # free capacity (pool size, H, 3) as of the last tick, less the dispatches since
        self._free_pre: FloatArray | None = None
        self._free_dec: FloatArray | None = None
        self._free_time_s = 0.0

    # -- request path ----------------------------------------------------------------
    def decide(self, ctx: RoutingContext) -> Decision:
        """Score every pair (``score_pairs``), dispatch the best admissible one
        (``_first_admissible``), else hold, shed or defer (``_defer``)."""
        req = ctx.request
        snaps = ctx.snapshots
        if snaps is None:
            raise ValueError("bid_price needs instance snapshots in the context")
        pairs = self._score(ctx, snaps)
        if req.request_id not in self._seen:  # first sight: a sample of demand per pool
            self._seen.add(req.request_id)
            self._sample(pairs, ctx.now_s)
        score, order, on_time = self._ranking(pairs, ctx.now_s - req.arrival_s,
                                              req.ttft_target_s)
        best = int(order[0]) if len(order) else int(np.argmax(pairs.score))
        explanation = pairs.explanation(self._pools)
        explanation["pair_on_time"] = tuple(on_time.astype(np.float64).tolist())
        k = self._first_admissible(ctx, snaps, pairs, order, score)
        if k is not None:
            i, j = divmod(k, len(self._dec))
            p, d = int(self._pre[i]), int(self._dec[j])
            self._admit(req.request_id, i, j, pairs, ctx.now_s)
            rank = "best pair" if k == best else f"best admissible pair (best: {score[best]:.3f})"
            return Decision(req.request_id, "dispatch", p,
                            f"{rank} {score[k]:.3f}: prefill on {self._specs[p].name}, decode "
                            f"on {self._specs[d].name}", explanation, decode_instance=d)
        why = (f"no pair is predicted to meet its {req.ttft_target_s * 1e3:.0f} ms TTFT target"
               if not len(order) else f"best pair score {score[best]:.3f} <= 0"
               if score[best] <= 0
               else "no positive pair can start now with its decode KV and TPOT in reach")

        def defer(waited_s: float, _: int | None) -> Decision:
            # the best Lagrangian pair; under the constrained form with pairs on time,
            # the best of those (as on mixed instances)
            rank: FloatArray = (np.where(on_time, score, -np.inf).reshape(pairs.score.shape)
                                if self._form == "constrained" and len(order)
                                else pairs.score)
            return self._defer(ctx, snaps, pairs, rank, waited_s, why, explanation)

        return hold_shed_or_defer(ctx, self._adm, why, explanation, self._seen.discard, defer)

    def _score(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...]) -> PairScores:
        """Every pair's score from the prefill pool's replay, the transfer time, the
        decode pool's step time and both books' prices (nothing is changed)."""
        req = ctx.request
        out = self._outlook(req)
        pre_ctx = replace(ctx, specs=self._pre_specs,
                          snapshots=tuple(snaps[g] for g in self._pre),
                          pending=None if ctx.pending is None else tuple(
                              ctx.pending[g] for g in self._pre),
                          prefixes=None if ctx.prefixes is None
                          else ctx.prefixes.of(np.asarray(self._pre, dtype=np.int64)))
        ones = np.ones(len(self._pre), dtype=np.int64)                   # prefill: 1 token
        ttft_pre = self._bea.estimate(pre_ctx, predicted_decode=ones).ttft_s
        xfer = self._transfer(req.prompt_tokens)
        tpot_d = self._decode_step_s(snaps, ctx.inbound, req.prompt_tokens)
        return score_pairs(self._pools, req, ctx.now_s - req.arrival_s, out, ttft_pre, xfer,
                           tpot_d, lambda c: self.book_prefill.price(c, ctx.now_s),
                           lambda c: self.book_decode.price(c, ctx.now_s))

    def _ranking(self, pairs: PairScores, waited_s: float, target_s: float
                 ) -> tuple[FloatArray, IntArray, BoolArray]:
        """(score per pair, the pairs to try best first, on time per pair), flat:
        the Lagrangian score, every pair; or for ``constrained`` the reward net of both
        prices, the pairs predicted on time only, ties to the smaller TTFT."""
        on_time = (pairs.ttft + waited_s <= target_s).ravel()
        if self._form == "constrained":
            net = (pairs.reward - pairs.price_pre[:, None] - pairs.price_dec).ravel()
            order = np.lexsort((pairs.ttft.ravel(), -net))
            return net, order[on_time[order]], on_time
        flat = pairs.score.ravel()
        return flat, np.argsort(-flat, kind="stable"), on_time

    def _first_admissible(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...],
                          pairs: PairScores, order: IntArray, score: FloatArray) -> int | None:
        """The first pair of ``order`` (flat indices, best first) with a positive
        ``score`` whose decode TPOT is in reach, whose prefill engine can start the prompt
        now, and whose two columns fit under the free capacity; None when there is none."""
        req = ctx.request
        for k in order:
            k = int(k)
            if score[k] <= 0:
                break
            i, j = divmod(k, len(self._dec))
            p = int(self._pre[i])
            pspec = self._specs[p]
            if not pairs.tpot_ok[j]:
                continue
            if not can_start_now(snaps[p], req.prompt_tokens, pspec.block_size,
                                 pspec.max_num_seqs, self._adm.max_waiting):
                continue
            if not (self._fits(self._free_pre, i, column_at(pairs.pre_cols, i), ctx.now_s)
                    and self._fits(self._free_dec, j, self._padded(pairs.dec_cols, (i, j)),
                                   ctx.now_s)):
                continue
            return k
        return None

    def _defer(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...],
               pairs: PairScores, score: FloatArray, waited_s: float, why: str,
               explanation: dict[str, tuple[float, ...]]) -> Decision:
        """Patience ran out (``admission: defer``): the decode instance whose KV fits
        (else the one it overflows least), TPOT in reach, best ``score`` (n_pre, n_dec);
        then the prefill instance that can start it now, best score."""
        req = ctx.request
        i0 = int(np.argmax(score.max(axis=1)))

        def decode_key(j: int) -> tuple[float, bool, float]:
            margin = self._margin(self._free_dec, j, self._padded(pairs.dec_cols, (i0, j)),
                                  ctx.now_s)
            return min(margin, 0.0), bool(pairs.tpot_ok[j]), float(score[:, j].max())

        j = max(range(len(self._dec)), key=decode_key)

        def prefill_key(i: int) -> tuple[bool, float]:
            g = int(self._pre[i])
            spec = self._specs[g]
            return (can_start_now(snaps[g], req.prompt_tokens, spec.block_size,
                                  spec.max_num_seqs, self._adm.max_waiting), float(score[i, j]))

        i = max(range(len(self._pre)), key=prefill_key)
        p, d = int(self._pre[i]), int(self._dec[j])
        self._admit(req.request_id, i, j, pairs, ctx.now_s)
        return Decision(req.request_id, "dispatch", p,
                        f"deferred after {waited_s * 1e3:.0f} ms to prefill on "
                        f"{self._specs[p].name}, decode on {self._specs[d].name}: {why}",
                        explanation, decode_instance=d)

    def _decode_step_s(self, snaps: tuple[EngineSnapshot, ...],
                       inbound: tuple[FloatArray | None, ...] | None,
                       prompt_tokens: int) -> FloatArray:
        """Per decode instance, the calibrated time of one decode step of its residents,
        the requests bound for it and the new request (``decode_step_times_s``)."""
        return decode_step_times_s(
            [snaps[g] for g in self._dec], self._dec_specs, self._beta[self._dec],
            prompt_tokens, None if inbound is None else [inbound[g] for g in self._dec])

    def _sample(self, pairs: PairScores, now_s: float) -> None:
        """One sample of demand per pool: each pool's reward net of the other pool's
        price at the best completion."""
        reward, pre, dec = pairs.reward, pairs.pre_cols, pairs.dec_cols
        price_pre, price_dec, score = pairs.price_pre, pairs.price_dec, pairs.score
        i_best = int(np.unravel_index(int(np.argmax(score)), score.shape)[0])
        self.book_prefill.observe_arrival(now_s)
        # the prefill column is cut at now (it cannot start before), and its end is its
        # first token's slot, at most the horizon: it is its own extent
        self.book_prefill.add_sample((reward - price_dec).max(axis=1), pre,
                                     SampleExtent.of_columns(pre))
        self.book_decode.observe_arrival(now_s)
        best = Columns(*(np.array(getattr(dec, f)[i_best]) for f in COLUMN_FIELDS))
        # the decode column is its own extent but for its decode's whole length
        self.book_decode.add_sample(reward[i_best] - price_pre[i_best], best, replace(
            SampleExtent.of_columns(best), end=best.start + pairs.dec_slots))

    def _padded(self, cols: Columns, i: tuple[int, int]
                ) -> Column:
        """The decode column as admission checks it: its output running ``decode_slack``
        over the prediction (the ramp goes on growing), a slot early and a slot late, so
        that length and speed errors do not overflow a full KV cache into preemptions."""
        s, e, ba, ka, kb, ps, pe, ca = column_at(cols, i)
        extra = math.ceil(self._slack * (e - s)) + 1
        s0 = max(s - 1, 0)
        # plus its last, partly filled KV block and the headroom kept free
        ka += self._dec_block[i[1]] + self._headroom
        return s0, min(e + extra, self._horizon), ba, ka + kb * (s0 - s), kb, ps, pe, ca

    def _offset(self, now_s: float) -> int:
        return slots_since(now_s, self._free_time_s, self._slot_s)

    def _margin(self, free: FloatArray | None, i: int,
                col: Column, now_s: float) -> float:
        """The least free batch or KV capacity the column leaves on pool instance i
        (negative: it does not fit; ``reward.HARD``); +inf before the first tick or
        outside the horizon."""
        if free is None:
            return math.inf
        win = shifted_usage(col, self._offset(now_s), self._horizon)
        return math.inf if win is None else float(
            (free[i, win[0], HARD] - win[1][:, HARD]).min())

    def _fits(self, free: FloatArray | None, i: int,
              col: Column, now_s: float) -> bool:
        return self._margin(free, i, col, now_s) >= 0.0

    def _take(self, free: FloatArray | None, i: int,
              col: Column, k: int) -> None:
        if free is None:
            return
        win = shifted_usage(col, k, self._horizon)
        if win is not None:
            free[i, win[0]] -= win[1]

    def _admit(self, request_id: int, i: int, j: int, pairs: PairScores,
               now_s: float) -> None:
        """Immediate accounting of both columns of pair (i, j) (pool indices), and the
        decode column remembered until the KV reaches the decode instance (its snapshots
        then hold the request)."""
        arrival_in_s = pairs.kv_at[i]
        k = self._offset(now_s)
        self._take(self._free_pre, i, column_at(pairs.pre_cols, i), k)
        col = column_at(pairs.dec_cols, (i, j))
        self._take(self._free_dec, j, col, k)
        self._inbound[request_id] = _Inbound(j, col, dispatch_s=now_s,
                                             expires_s=now_s + 2.0 * arrival_in_s + 60.0)

    # -- feedback and learning ---------------------------------------------------------
    def observe(self, outcome: Outcome) -> None:
        self.forget(outcome.request_id)

    def rerouted(self, request_id: int, prefill: int, decode: int) -> None:
        """The router moved a dispatch to other instances (global indices; the first was
        unhealthy): the request's decode column is now held on the new decode instance.
        The capacity taken at once on the old ones comes back at the next tick."""
        b = self._inbound.get(request_id)
        local = np.flatnonzero(self._dec == decode)
        if b is not None and local.size:
            self._inbound[request_id] = replace(b, decode=int(local[0]))

    def forget(self, request_id: int) -> None:
        """Drop what is kept for a request until its outcome."""
        self._seen.discard(request_id)
        self._inbound.pop(request_id, None)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        """Off the request path: each pool's free capacity from the snapshots (the decode
        side less the requests still on their way to it), then K dual steps per book
        (when prices are learned)."""
        resident: set[int] = set()
        for g in self._dec:
            resident.update(snapshots[g].request_ids.tolist())
        # the server runs this in a worker thread while decisions add to and remove from
        # _inbound: copy it in one step (atomic under the GIL) and drop only stale keys,
        # so that a dispatch made meanwhile is neither lost nor iterated half-added
        inbound = list(self._inbound.items())
        for rid, b in inbound:
            if rid in resident or b.expires_s <= now_s:
                self._inbound.pop(rid, None)
        inbound = [(rid, b) for rid, b in inbound if rid not in resident
                   and b.expires_s > now_s]
        pre = self._prefill_free([snapshots[g] for g in self._pre])
        dec_snaps = [snapshots[g] for g in self._dec]
        tpot = self._decode_step_s(snapshots, None, 0)
        dec = free_capacity(dec_snaps, self._dec_specs, tpot,
                            np.full(len(self._dec), np.inf), self._slot_s, self._horizon)
        for _, b in inbound:
            shift = int((b.dispatch_s - now_s) // self._slot_s)  # <= 0: slots since dispatch
            self._take(dec, b.decode, b.col, shift)
        self.book_prefill.set_free_capacity(pre)
        self.book_decode.set_free_capacity(dec)
        self._free_pre, self._free_dec = pre.copy(), dec.copy()
        self._free_time_s = now_s
        if self._learn:
            self.book_prefill.update(now_s)
            self.book_decode.update(now_s)

    def _prefill_free(self, snaps: list[EngineSnapshot]) -> FloatArray:
        """c[p, k] of the prefill pool: the compute budget is taken while the residents'
        remaining prompt tokens run at the full budget (``prefill_load``), and so is the
        KV their prompts hold; the batch row is not priced here (always free)."""
        h = self._horizon
        c = np.ones((len(snaps), h, NUM_RESOURCES))
        for i, (snap, spec) in enumerate(zip(snaps, self._pre_specs, strict=True)):
            load = prefill_load(float(remaining_prefill_tokens(snap).sum()),
                                float(self._budget[i]), h)
            c[i, :, COMPUTE] = 1.0 - load
            used = 1.0 - snap.num_free_blocks / spec.num_kv_blocks
            c[i, :int(np.count_nonzero(load)), KV] = 1.0 - used
        return c

    def set_beta(self, g: int, beta: Sequence[float]) -> bool:
        """A recalibrated batch-time model for instance g (global index): the decode-step
        estimate reads it, and the prefill replay when g is a prefill engine."""
        if len(beta) != 4 or min(beta) < 0:
            raise ValueError("beta must be 4 coefficients >= 0")
        self._beta[g] = beta
        local = np.flatnonzero(self._pre == g)
        if local.size:
            self._bea.set_beta(int(local[0]), beta)
        return True

    def price_books(self) -> tuple[PriceBook, ...]:
        return (self.book_prefill, self.book_decode)

    def price_view(self) -> PriceView:
        """Both books' prices in instance order: a prefill instance's prices are its
        compute budget's (and its KV's), a decode instance's its batch slots' and KV's.
        The learning's state is the decode book's."""
        seen = {"prefill": 0, "decode": 0}
        rows = []
        for s in self._specs:
            rows.append((self.book_prefill if s.role == "prefill" else self.book_decode,
                         seen[s.role]))
            seen[s.role] += 1
        return price_view(rows, self.book_decode)


__all__ = ["PoolBidPrice"]
