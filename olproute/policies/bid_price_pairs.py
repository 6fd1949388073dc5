"""Pair scoring of bid-price routing on prefill/decode pools (``bid_price_pools``): for a
request and every (prefill p, decode d) pair

    score_pd = r_pd - delta * TTFT_pd - a_p . pi_p - b_pd . mu_d

on arrays, from the prefill replay, the KV transfer time, the decode step time and the
two books' prices, with nothing changed (admission and the books' samples are the
policy's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config.schema import RewardConfig
from olproute.pricing.reward import (
    Columns,
    decode_slots,
    first_token_slot,
    prefill_span,
    reward_terms,
    usage_columns,
)
from olproute.routing.outlook import Outlook
from olproute.types import Request

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """What pair scoring reads of the two pools, fixed for a run: global indices of each
    pool, the prefill engines' compute budget (prefill tokens per slot,
    ``olproute.pricing.reward.compute_budget``) and KV capacity (tokens), the decode engines'
    batch and KV capacities, the slot, the horizon and the reward's weights."""

    pre: IntArray
    dec: IntArray
    budget: FloatArray
    pre_kv: FloatArray
    dec_batch: FloatArray
    dec_kv: FloatArray
    slot_s: float
    horizon: int
    w: RewardConfig

    def prefill_columns(self, prompt_tokens: int, ttft_s: FloatArray) -> Columns:
        """The prompt's column on each prefill instance: its share of the compute budget
        over the slots its prefill runs in (the one definition of ``olproute.pricing.reward``),
        and its KV there, in capacity fractions; no batch row (the engine frees the slot
        as the prefill ends)."""
        k0 = first_token_slot(ttft_s, self.slot_s, self.horizon)
        ps, pe, share = prefill_span(float(prompt_tokens), k0, self.budget, self.horizon)
        n = len(self.pre)
        return Columns(start=ps, end=pe, batch_a=np.zeros(n),
                       kv_a=prompt_tokens / self.pre_kv, kv_b=np.zeros(n), pre_start=ps,
                       pre_end=pe, compute_a=share)


@dataclass(frozen=True, slots=True)
class PairScores:
    """Every (prefill, decode) pair of one request, prefill-major: arrays (n_pre, n_dec)
    unless marked. Times in seconds; columns and prices in capacity fractions."""

    ttft_pre: FloatArray      # (n_pre,) BEA replay of each prefill engine (inf: never)
    kv_at: FloatArray         # (n_pre,) when the KV would reach a decode engine
    tpot_d: FloatArray        # (n_dec,) one decode step of each decode engine
    ttft: FloatArray
    reward: FloatArray
    pre_cols: Columns         # (n_pre,)
    dec_cols: Columns
    price_pre: FloatArray     # (n_pre,)
    price_dec: FloatArray
    score: FloatArray
    tpot_ok: BoolArray        # (n_dec,) within the request's TPOT target
    dec_slots: IntArray       # (n_dec,) decode slots D on each decode engine (not cut)

    def explanation(self, pools: PoolFigures) -> dict[str, tuple[float, ...]]:
        """The decision's per-pair figures (the pair's instances as global indices)."""
        n_pre, n_dec = self.score.shape
        pi = np.repeat(np.arange(n_pre), n_dec)
        dj = np.tile(np.arange(n_dec), n_pre)
        return {
            "prefill_s": tuple(self.ttft_pre.tolist()),
            "pair_ttft_s": tuple(self.ttft.ravel().tolist()),
            "pair_prefill": tuple(float(x) for x in pools.pre[pi]),
            "pair_decode": tuple(float(x) for x in pools.dec[dj]),
            "pair_tpot_s": tuple(self.tpot_d[dj].tolist()),
            "pair_reward": tuple(self.reward.ravel().tolist()),
            "pair_prefill_price": tuple(self.price_pre[pi].tolist()),
            "pair_decode_price": tuple(self.price_dec.ravel().tolist()),
            "pair_score": tuple(self.score.ravel().tolist()),
        }


def score_pairs(pools: PoolFigures, req: Request, waited_s: float, out: Outlook,
                ttft_pre: FloatArray, transfer_s: float, tpot_d: FloatArray,
                price_pre: Callable[[Columns], FloatArray],
                price_dec: Callable[[Columns], FloatArray]) -> PairScores:
    """score_pd = r_pd - delta * TTFT_pd - a_p . pi_p - b_pd . mu_d for every pair, from
    the prefill replay ``ttft_pre``, the KV ``transfer_s`` and the decode step
    ``tpot_d``; ``out`` is the request's outlook on every instance (global)."""
    n_pre, n_dec = len(pools.pre), len(pools.dec)
    o_hat = np.maximum(out.decode_tokens[pools.dec], 1.0)          # per decode instance
    ttft_p = np.where(np.isfinite(ttft_pre), ttft_pre, 1e9)
    kv_at = ttft_p + transfer_s                                      # per prefill
    dj = np.tile(np.arange(n_dec), n_pre)
    dg = pools.dec[dj]
    pair_out = Outlook(decode_tokens=out.decode_tokens[dg], quality=out.quality[dg],
                       cost_musd=out.cost_musd[dg])
    ttft = kv_at[:, None] + tpot_d[None, :]                          # (n_pre, n_dec)
    terms = reward_terms(req.prompt_tokens, req.ttft_target_s, pair_out, ttft.ravel(),
                         tpot_d[dj], pools.w, pools.slot_s, pools.horizon, waited_s=waited_s)
    reward = terms.total.reshape(n_pre, n_dec)
    pre_cols = pools.prefill_columns(req.prompt_tokens, ttft_p)
    dec_cols = usage_columns(
        req.prompt_tokens, o_hat[None, :], kv_at[:, None],
        tpot_d[None, :], pools.dec_batch[None, :], pools.dec_kv[None, :],
        np.full(n_dec, np.inf), pools.slot_s, pools.horizon)  # (n_pre, n_dec); no prefill
    dec_cols = dec_cols.broadcast((n_pre, n_dec))
    p_pre = price_pre(pre_cols)                                      # (n_pre,)
    p_dec = price_dec(dec_cols)                                      # (n_pre, n_dec)
    score = reward - pools.w.delta * ttft - p_pre[:, None] - p_dec
    tpot_ok = np.ones(n_dec, dtype=bool) if req.tpot_target_s is None else (
        tpot_d <= req.tpot_target_s)
    return PairScores(ttft_pre=ttft_pre, kv_at=kv_at, tpot_d=tpot_d, ttft=ttft,
                      reward=reward, pre_cols=pre_cols, dec_cols=dec_cols, price_pre=p_pre,
                      price_dec=p_dec, score=score, tpot_ok=tpot_ok,
                      dec_slots=decode_slots(o_hat, tpot_d, pools.slot_s))
