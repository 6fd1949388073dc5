"""Bid-price routing on disaggregated prefill/decode pools (issue 9).

A request is a pair of choices: the prefill instance p that runs its prompt, and the
decode instance d its KV cache moves to, which gives the client its first token and the
rest (``olproute.disagg``). For every pair

    score_pd = r_pd - delta * TTFT_pd - a_p . pi_p - b_pd . mu_d

- ``TTFT_pd = P_p + transfer + tpot_d``: ``P_p`` the BEA replay of p (its residents and
  queue as they stand, the new prompt run to its one token), the KV transfer, and one
  decode step on d for the first token;
- ``tpot_d``: the calibrated time of one decode step of d's residents plus the requests
  bound for it and this one (``beta0 + beta1 n + beta2 sum of contexts``);
- ``r_pd``: the multi-objective reward (``olproute.reward``) with that TTFT and tpot_d;
- ``a_p . pi_p``: the price of p's **prefill token budget** (and its KV) over the slots
  the prompt runs in, ``[k0 - ceil(s / (theta_p Delta)), k0)`` with k0 the slot its
  prefill ends in and theta_p p's calibrated prefill throughput;
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

import numpy as np
import numpy.typing as npt

from olproute.bea import BeaEstimator, decode_step_times_s, remaining_prefill_tokens
from olproute.disagg import Pools
from olproute.outlook import Outlook
from olproute.policies._common import float_param
from olproute.policies.base import PolicyEnv, PolicyError, check_params
from olproute.policies.bid_price import can_start_now, still_patient
from olproute.prices import PriceBook
from olproute.reward import (
    Column,
    Columns,
    capacities,
    column_at,
    first_token_slot,
    free_capacity,
    reward_terms,
    shifted_usage,
    slots_since,
    usage_columns,
)
from olproute.types import (
    Decision,
    EngineSnapshot,
    Outcome,
    RoutingContext,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class _Inbound:
    """A dispatch whose KV has not reached its decode instance: its decode column (as
    of its dispatch) and when it was dispatched."""

    decode: int           # index within the decode pool
    start: int
    end: int
    batch_a: float
    kv_a: float
    kv_b: float
    dispatch_s: float
    expires_s: float      # forget it by then even if never seen (a lost request)


class PoolBidPrice:
    name = "bid_price"
    needs_snapshots = True

    def __init__(self, env: PolicyEnv) -> None:
        check_params(self.name, env.params, ("backend", "decode_slack", "kv_headroom"))
        self._slack = float_param(self.name, env.params, "decode_slack", 0.25)
        self._headroom = float_param(self.name, env.params, "kv_headroom", 0.03)
        backend = env.params.get("backend", "jax")
        if backend not in ("jax", "numpy"):
            raise ValueError(f"bid_price backend must be 'jax' or 'numpy', got {backend!r}")
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
        self._theta = np.array([cal[i].prefill_tokens_per_s for i in self._pre])
        _, self._pre_kv = capacities(self._pre_specs)
        self._dec_batch, self._dec_kv = capacities(self._dec_specs)
        self._dec_block = np.array([s.block_size for s in self._dec_specs]) / self._dec_kv
        self._outlook = env.outlook()
        self._w = env.reward
        self._adm = env.admission
        self._slot_s = env.slot_s
        self._horizon = env.horizon_slots
        self.book_prefill = PriceBook(self._pre_specs, env.slot_s, env.horizon_slots,
                                      env.prices, env.rng, backend=backend)
        self.book_decode = PriceBook(self._dec_specs, env.slot_s, env.horizon_slots,
                                     env.prices, env.rng, backend=backend)
        # the tick refreshes the free capacity the admission checks read even when the
        # prices are not learned (prices.enabled: false keeps them at zero)
        self.tick_s = env.prices.period_slots * env.slot_s
        self._learn = env.prices.enabled
        self._seen: set[int] = set()
        self._inbound: dict[int, _Inbound] = {}
        # free capacity (pool size, H, 2) as of the last tick, less the dispatches since
        self._free_pre: FloatArray | None = None
        self._free_dec: FloatArray | None = None
        self._free_time_s = 0.0

    # -- request path ----------------------------------------------------------------
    def decide(self, ctx: RoutingContext) -> Decision:
        req = ctx.request
        snaps = ctx.snapshots
        if snaps is None:
            raise ValueError("bid_price needs instance snapshots in the context")
        n_pre, n_dec = len(self._pre), len(self._dec)
        out = self._outlook(req)
        o_hat = np.maximum(out.decode_tokens[self._dec], 1.0)          # per decode instance
        pre_ctx = replace(ctx, specs=self._pre_specs,
                          snapshots=tuple(snaps[g] for g in self._pre),
                          pending=None if ctx.pending is None else tuple(
                              ctx.pending[g] for g in self._pre))
        ones = np.ones(n_pre, dtype=np.int64)                            # prefill: 1 token
        ttft_pre = self._bea.estimate(pre_ctx, predicted_decode=ones).ttft_s
        ttft_p = np.where(np.isfinite(ttft_pre), ttft_pre, 1e9)
        xfer = self._transfer(req.prompt_tokens)
        tpot_d = self._decode_step_s(snaps, ctx.inbound, req.prompt_tokens)
        kv_at = ttft_p + xfer                                            # per prefill
        # pairs, prefill-major: index = i * n_dec + j
        pi = np.repeat(np.arange(n_pre), n_dec)
        dj = np.tile(np.arange(n_dec), n_pre)
        dg = self._dec[dj]
        pair_out = Outlook(decode_tokens=out.decode_tokens[dg], quality=out.quality[dg],
                           cost_musd=out.cost_musd[dg])
        waited = ctx.now_s - req.arrival_s
        ttft = kv_at[:, None] + tpot_d[None, :]                          # (n_pre, n_dec)
        terms = reward_terms(req.prompt_tokens, req.ttft_target_s, pair_out, ttft.ravel(),
                             tpot_d[dj], self._w, self._slot_s, self._horizon,
                             waited_s=waited)
        reward = terms.total.reshape(n_pre, n_dec)
        pre_cols = self._prefill_columns(req.prompt_tokens, ttft_p)
        dec_cols = usage_columns(
            req.prompt_tokens, o_hat[None, :], kv_at[:, None],
            tpot_d[None, :], self._dec_batch[None, :], self._dec_kv[None, :],
            self._slot_s, self._horizon)                                  # (n_pre, n_dec)
        shape = (n_pre, n_dec)
        dec_cols = Columns(
            start=np.broadcast_to(dec_cols.start, shape),
            end=np.broadcast_to(dec_cols.end, shape),
            batch_a=np.broadcast_to(dec_cols.batch_a, shape),
            kv_a=np.broadcast_to(dec_cols.kv_a, shape),
            kv_b=np.broadcast_to(dec_cols.kv_b, shape))
        price_pre = self.book_prefill.price(pre_cols)                    # (n_pre,)
        price_dec = self.book_decode.price(dec_cols)                     # (n_pre, n_dec)
        score = reward - self._w.delta * ttft - price_pre[:, None] - price_dec
        tpot_ok = np.ones(n_dec, dtype=bool) if req.tpot_target_s is None else (
            tpot_d <= req.tpot_target_s)
        if req.request_id not in self._seen:  # first sight: a sample of demand per pool
            self._seen.add(req.request_id)
            self._sample(reward, pre_cols, dec_cols, price_pre, price_dec, score, ctx.now_s)
        flat = score.ravel()
        best = int(np.argmax(flat))
        explanation = {
            "prefill_s": tuple(ttft_pre.tolist()),
            "pair_ttft_s": tuple(ttft.ravel().tolist()),
            "pair_prefill": tuple(float(x) for x in self._pre[pi]),
            "pair_decode": tuple(float(x) for x in dg),
            "pair_tpot_s": tuple(tpot_d[dj].tolist()),
            "pair_reward": tuple(reward.ravel().tolist()),
            "pair_prefill_price": tuple(price_pre[pi].tolist()),
            "pair_decode_price": tuple(price_dec.ravel().tolist()),
            "pair_score": tuple(flat.tolist()),
        }
        for k in np.argsort(-flat, kind="stable"):
            k = int(k)
            if flat[k] <= 0:
                break
            i, j = divmod(k, n_dec)
            p, d = int(self._pre[i]), int(self._dec[j])
            pspec = self._specs[p]
            if not tpot_ok[j]:
                continue
            if not can_start_now(snaps[p], req.prompt_tokens, pspec.block_size,
                                 pspec.max_num_seqs, self._adm.max_waiting):
                continue
            if not (self._fits(self._free_pre, i, column_at(pre_cols, i), ctx.now_s)
                    and self._fits(self._free_dec, j, self._padded(dec_cols, (i, j)),
                                   ctx.now_s)):
                continue
            self._admit(req.request_id, i, j, pre_cols, dec_cols, ctx.now_s, kv_at[i])
            rank = "best pair" if k == best else f"best admissible pair (best: {flat[best]:.3f})"
            return Decision(req.request_id, "dispatch", p,
                            f"{rank} {flat[k]:.3f}: prefill on {pspec.name}, decode on "
                            f"{self._specs[d].name}", explanation, decode_instance=d)
        why = (f"best pair score {flat[best]:.3f} <= 0" if flat[best] <= 0
               else "no positive pair can start now with its decode KV and TPOT in reach")
        if still_patient(self._adm, req, waited):
            return Decision(req.request_id, "hold", None, f"held: {why}", explanation)
        self._seen.discard(req.request_id)
        if self._adm.mode == "shed":
            return Decision(req.request_id, "shed", None,
                            f"shed after {waited * 1e3:.0f} ms: {why}", explanation)
        # deferred: the decode instance whose KV fits (else the one it overflows least),
        # TPOT in reach, best score; then the prefill instance that can start it now,
        # best score
        i0 = int(np.argmax(score.max(axis=1)))

        def decode_key(j: int) -> tuple[float, bool, float]:
            margin = self._margin(self._free_dec, j, self._padded(dec_cols, (i0, j)),
                                  ctx.now_s)
            return min(margin, 0.0), bool(tpot_ok[j]), float(score[:, j].max())

        def prefill_key(i: int) -> tuple[bool, float]:
            g = int(self._pre[i])
            spec = self._specs[g]
            return (can_start_now(snaps[g], req.prompt_tokens, spec.block_size,
                                  spec.max_num_seqs, self._adm.max_waiting), float(score[i, j]))

        j = max(range(n_dec), key=decode_key)
        i = max(range(n_pre), key=prefill_key)
        p, d = int(self._pre[i]), int(self._dec[j])
        self._admit(req.request_id, i, j, pre_cols, dec_cols, ctx.now_s, kv_at[i])
        return Decision(req.request_id, "dispatch", p,
                        f"deferred after {waited * 1e3:.0f} ms to prefill on "
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

    def _prefill_columns(self, prompt_tokens: int, ttft_s: FloatArray) -> Columns:
        """The prompt's column on each prefill instance: its share of the prefill token
        budget (theta_p x Delta tokens a slot) over the slots before its first token, and
        its KV there, in capacity fractions."""
        k0 = first_token_slot(ttft_s, self._slot_s, self._horizon)
        length = np.maximum(np.ceil(prompt_tokens / (self._theta * self._slot_s) - 1e-9), 1)
        start = np.maximum(k0 - length.astype(np.int64), 0)
        span = np.maximum(k0 - start, 1)
        end = np.maximum(k0, np.minimum(start + 1, self._horizon))
        share = np.minimum(prompt_tokens / (self._theta * self._slot_s * span), 1.0)
        return Columns(start=start, end=end, batch_a=share,
                       kv_a=prompt_tokens / self._pre_kv, kv_b=np.zeros(len(self._pre)))

    def _sample(self, reward: FloatArray, pre: Columns, dec: Columns, price_pre: FloatArray,
                price_dec: FloatArray, score: FloatArray, now_s: float) -> None:
        """One sample of demand per pool: each pool's reward net of the other pool's
        price at the best completion."""
        i_best = int(np.unravel_index(int(np.argmax(score)), score.shape)[0])
        self.book_prefill.observe_arrival(now_s)
        self.book_prefill.add_sample((reward - price_dec).max(axis=1), pre)
        self.book_decode.observe_arrival(now_s)
        self.book_decode.add_sample(reward[i_best] - price_pre[i_best], Columns(
            start=np.array(dec.start[i_best]), end=np.array(dec.end[i_best]),
            batch_a=np.array(dec.batch_a[i_best]), kv_a=np.array(dec.kv_a[i_best]),
            kv_b=np.array(dec.kv_b[i_best])))

    def _padded(self, cols: Columns, i: tuple[int, int]
                ) -> Column:
        """The decode column as admission checks it: its output running ``decode_slack``
        over the prediction (the ramp goes on growing), a slot early and a slot late, so
        that length and speed errors do not overflow a full KV cache into preemptions."""
        s, e, ba, ka, kb = column_at(cols, i)
        extra = math.ceil(self._slack * (e - s)) + 1
        s0 = max(s - 1, 0)
        # plus its last, partly filled KV block and the headroom kept free
        ka += self._dec_block[i[1]] + self._headroom
        return s0, min(e + extra, self._horizon), ba, ka + kb * (s0 - s), kb

    def _offset(self, now_s: float) -> int:
        return slots_since(now_s, self._free_time_s, self._slot_s)

    def _margin(self, free: FloatArray | None, i: int,
                col: Column, now_s: float) -> float:
        """The least free capacity the column leaves on pool instance i (negative: it
        does not fit); +inf before the first tick or outside the horizon."""
        if free is None:
            return math.inf
        win = shifted_usage(col, self._offset(now_s), self._horizon)
        return math.inf if win is None else float((free[i, win[0]] - win[1]).min())

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

    def _admit(self, request_id: int, i: int, j: int, pre: Columns, dec: Columns,
               now_s: float, arrival_in_s: float) -> None:
        """Immediate accounting of both columns, and the decode column remembered until
        the KV reaches the decode instance (its snapshots then hold the request)."""
        k = self._offset(now_s)
        self._take(self._free_pre, i, column_at(pre, i), k)
        col = column_at(dec, (i, j))
        self._take(self._free_dec, j, col, k)
        self._inbound[request_id] = _Inbound(j, *col, dispatch_s=now_s,
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
        dec = free_capacity(dec_snaps, self._dec_specs, tpot, self._slot_s, self._horizon)
        for _, b in inbound:
            shift = int((b.dispatch_s - now_s) // self._slot_s)  # <= 0: slots since dispatch
            self._take(dec, b.decode, (b.start, b.end, b.batch_a, b.kv_a, b.kv_b), shift)
        self.book_prefill.set_free_capacity(pre)
        self.book_decode.set_free_capacity(dec)
        self._free_pre, self._free_dec = pre.copy(), dec.copy()
        self._free_time_s = now_s
        if self._learn:
            self.book_prefill.update(now_s)
            self.book_decode.update(now_s)

    def _prefill_free(self, snaps: list[EngineSnapshot]) -> FloatArray:
        """c[p, k] of the prefill pool: the token budget is taken while the residents'
        remaining prompt tokens run at theta_p, and so is the KV their prompts hold."""
        h = self._horizon
        c = np.ones((len(snaps), h, 2))
        for i, (snap, spec) in enumerate(zip(snaps, self._pre_specs, strict=True)):
            busy = float(remaining_prefill_tokens(snap).sum()) / (self._theta[i] * self._slot_s)
            full = min(math.floor(busy), h)
            c[i, :full, 0] = 0.0
            if full < h:
                c[i, full, 0] = 1.0 - (busy - full)
            used = 1.0 - snap.num_free_blocks / spec.num_kv_blocks
            c[i, :min(math.ceil(busy), h), 1] = 1.0 - used
        return c

    def set_beta(self, g: int, beta: Sequence[float]) -> None:
        """A recalibrated batch-time model for instance g (global index): the decode-step
        estimate reads it, and the prefill replay when g is a prefill engine."""
        if len(beta) != 4 or min(beta) < 0:
            raise ValueError("beta must be 4 coefficients >= 0")
        self._beta[g] = beta
        local = np.flatnonzero(self._pre == g)
        if local.size:
            self._bea.set_beta(int(local[0]), beta)

    def prices(self) -> dict[str, FloatArray]:
        """The two books' current prices, for the admin endpoint and plots."""
        return {"prefill": self.book_prefill.p.copy(), "decode": self.book_decode.p.copy()}


__all__ = ["PoolBidPrice"]
