"""The duality certificate of a set of prices, and the online policy's gap.

For prices p >= 0 on the capacity rows (G, K, 3) of a window's LP (``solvers.problem``;
resources batch, KV, compute),

    D(p) = sum_{g,k,r} p[g,k,r] c[g,k,r] + sum_j max(0, max_{g,d} (r_jgd - a_jgd . p))

is the LP dual's objective with the best y for that p, so D(p) >= LP* for every p >= 0
(weak duality) and D(p*) = LP* for the LP's own prices. ``D(p)/LP* - 1`` certifies how
good online prices are; ``(D(p) - online)/D(p)`` and ``(LP* - online)/LP*`` bound how far
the online policy is from the hindsight optimum of the LP. a . p costs O(1) per column
from cumulative sums of p (``solvers.problem.block_price``), so D(p) of a whole window is
N x G x (max_delay + 1) vectorised evaluations, no LP.

**Rolling to absolute prices** (``absolute_prices``). The PriceBook's prices are relative:
an update at time t rolls them so that slot 0 starts at its origin o (the first update's
time plus whole slots, ``PriceBook.advance``), and p_u[g, i] prices the slot starting at
o + i * slot_s. For the LP's absolute slot k (starting at t0 + k * slot_s) we take the
**freshest price set in force when that slot began**: the last update u with o_u <= t0 +
k * slot_s, at index i = round((t0 + k slot - o_u) / slot); past its horizon (i >= H) the
tail fill ``advance`` itself would use (the mean over the horizon). Slots before the first
update take that update's slot 0. Any p >= 0 gives a valid bound; this mapping only
decides how tight it is for the prices bid_price actually acted on.

**Online reward** (``online_reward``): for each request the online policy served, the
same ``olproute.pricing.reward.reward_terms`` evaluated on its realised times: TTFT = first token
- arrival, the decode time finish - first token spread over the predicted output
(tpot = that time / o_jg, so the completion slot and EEL are the realised ones), the
horizon counted from the arrival, prorated like the LP's columns when the decode runs
past the grid's end; a shed request earns 0. Predicted lengths enter as in
the LP (the throughput term counts o_jg), so the two rewards differ only by when and where
requests ran.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.pricing.reward import NUM_RESOURCES, reward_terms
from olproute.routing.outlook import Outlook
from solvers.problem import (
    ColumnBlock,
    FlatColumns,
    LpProblem,
    block_price,
    column_block,
    flatten,
    price_cumsums,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

CHUNK = 1024
CACHE_LIMIT = 40_000_000   # cache column blocks while N x G x L stays below this


@dataclass(frozen=True, slots=True)
class Priced:
    """One pricing pass: D(p), each request's best margin max(0, max r - a.p), and (for
    column generation) the columns with reduced cost r - a.p - y_j > tol."""

    dual_value: float
    best_margin: FloatArray
    new: FlatColumns


class Pricer:
    """Prices every column of a problem for any p (and y), chunk by chunk; the columns'
    starts, ends and rewards do not depend on p and are cached when they fit."""

    def __init__(self, prob: LpProblem) -> None:
        self.prob = prob
        self._cache: list[ColumnBlock] | None = None
        if prob.num_requests * prob.num_instances * prob.num_delays <= CACHE_LIMIT:
            self._cache = list(self._blocks())

    def _blocks(self) -> Sequence[ColumnBlock] | list[ColumnBlock]:
        n = self.prob.num_requests
        return [column_block(self.prob, np.arange(i, min(i + CHUNK, n), dtype=np.int64))
                for i in range(0, n, CHUNK)]

    def blocks(self) -> Sequence[ColumnBlock]:
        return self._cache if self._cache is not None else self._blocks()

    def price(self, p: FloatArray, y: FloatArray | None = None, tol: float = 1e-9,
              per_request: int = 0, exclude: BoolArray | None = None) -> Priced:
        """D(p) and, with ``per_request`` > 0 and duals y, up to that many columns per
        request of reduced cost > tol (largest first) not in ``exclude`` (N, G, L)."""
        prob = self.prob
        shape = (prob.num_instances, prob.num_slots, NUM_RESOURCES)
        if p.shape != shape:
            raise ValueError(f"p must have shape {shape}, got {p.shape}")
        if np.any(p < 0):
            raise ValueError("prices must be >= 0")
        p0, p1 = price_cumsums(p)
        best = np.zeros(prob.num_requests)
        new: list[FlatColumns] = []
        for blk in self.blocks():
            margin = blk.reward - block_price(prob, blk, p0, p1)
            margin = np.where(blk.valid, margin, -np.inf)
            flat = margin.reshape(len(blk.request), -1)
            best[blk.request] = np.maximum(flat.max(axis=1, initial=-np.inf), 0.0)
            if per_request <= 0 or y is None:
                continue
            rc = margin - y[blk.request][:, None, None]
            if exclude is not None:
                rc = np.where(exclude[blk.request], -np.inf, rc)
            rcf = rc.reshape(len(blk.request), -1)
            m = min(per_request, rcf.shape[1])
            top = np.argpartition(-rcf, m - 1, axis=1)[:, :m]
            chosen = np.zeros_like(rcf, dtype=bool)
            np.put_along_axis(chosen, top, True, axis=1)
            chosen &= rcf > tol
            if chosen.any():
                new.append(flatten(blk, chosen.reshape(rc.shape)))
        value = float(np.sum(p * prob.capacity) + best.sum())
        cols = FlatColumns.concat(new) if new else flatten(
            column_block(prob, np.arange(0, dtype=np.int64)))
        return Priced(dual_value=value, best_margin=best, new=cols)


def dual_value(prob: LpProblem, p: FloatArray) -> float:
    """D(p) >= LP* for any p >= 0 of shape (G, K, 3)."""
    return Pricer(prob).price(p).dual_value


def best_scale(prob: LpProblem, p: FloatArray, hi: float = 4.0, iters: int = 30
               ) -> tuple[float, float]:
    """(lambda, D(lambda p)) minimising D over lambda in [0, hi] (D is convex in lambda;
    golden-section search): whether online prices have the right shape but the wrong
    level. A diagnostic, not a certificate of the prices as they were."""
    pricer = Pricer(prob)
    golden = (np.sqrt(5.0) - 1.0) / 2.0
    lo, up = 0.0, hi
    a, b = up - golden * (up - lo), lo + golden * (up - lo)
    fa, fb = pricer.price(a * p).dual_value, pricer.price(b * p).dual_value
    for _ in range(iters):
        if fa <= fb:
            up, b, fb = b, a, fa
            a = up - golden * (up - lo)
            fa = pricer.price(a * p).dual_value
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (up - lo)
            fb = pricer.price(b * p).dual_value
    return (a, fa) if fa <= fb else (b, fb)


def certificate(d_value: float, lp_value: float) -> float:
    """D(p)/LP* - 1 (>= 0 up to solver tolerance). A window whose LP* is 0 (no request
    in it can earn a reward, e.g. every predicted TPOT 0, so no decode fits a KV row):
    0 if D(p) is 0 too (the prices are exact), else infinite (non-finite figures are
    shown as null)."""
    if lp_value <= 0.0:
        return 0.0 if d_value <= 0.0 else math.inf
    return d_value / lp_value - 1.0


def gap(upper: float, online: float) -> float:
    """How far the online reward is below an upper bound, as a fraction of the bound (0
    for a bound of 0: nothing was there to earn)."""
    if upper <= 0.0:
        return 0.0
    return (upper - online) / upper


@dataclass(frozen=True, slots=True)
class PriceUpdate:
    """The PriceBook's prices after one update: slot i of ``p`` (G, H, 3) starts at
    ``origin_s + i * slot_s``."""

    time_s: float
    origin_s: float
    p: FloatArray


def absolute_prices(updates: Sequence[PriceUpdate], t0_s: float, slot_s: float,
                    num_slots: int) -> FloatArray:
    """Absolute-slot prices (G, K, R) from rolling price updates (G, H, R) (module
    docstring); R = 3 (batch, KV, compute) for prices the LP can price."""
    if not updates:
        raise ValueError("no price updates recorded")
    ups = sorted(updates, key=lambda u: u.origin_s)
    origins = np.array([u.origin_s for u in ups])
    g, h, r = ups[0].p.shape
    start = t0_s + np.arange(num_slots) * slot_s
    which = np.clip(np.searchsorted(origins, start + 1e-9 * slot_s, side="right") - 1, 0,
                    len(ups) - 1)
    out = np.empty((g, num_slots, r))
    for u in np.unique(which):
        ks = np.nonzero(which == u)[0]
        pu = ups[u].p
        i = np.rint((start[ks] - ups[u].origin_s) / slot_s).astype(np.int64)
        i = np.maximum(i, 0)
        inside = i < h
        out[:, ks[inside]] = pu[:, i[inside]]
        if (~inside).any():
            out[:, ks[~inside]] = pu.mean(axis=1, keepdims=True)
    return out


def online_reward(prob: LpProblem, instance: IntArray, first_token_s: FloatArray,
                  finish_s: FloatArray, prorate: bool = True) -> FloatArray:
    """Per request of the window, the reward of what the online policy did (module
    docstring); 0 for a request not served (instance < 0 or no first token). With
    ``prorate`` false the grid's end cuts nothing: the whole realised reward, to compare
    runs that end at different times."""
    out = np.zeros(prob.num_requests)
    w = prob.reward
    for j in range(prob.num_requests):
        g = int(instance[j])
        if g < 0 or not np.isfinite(first_token_s[j]) or not np.isfinite(finish_s[j]):
            continue
        ttft = float(first_token_s[j] - prob.arrival_s[j])
        decode_time = max(float(finish_s[j] - first_token_s[j]), 0.0)
        o = float(prob.decode_tokens[j, g])
        # a prediction of no output token: its decode takes no slot, whatever its TPOT
        tpot = max(decode_time / o, 1e-12) if o > 0 else 1e-12
        look = Outlook(decode_tokens=np.array([o]), quality=np.array([prob.utility[j, g]]),
                       cost_musd=np.zeros(1))
        terms = reward_terms(int(prob.prompt_tokens[j]), float(prob.ttft_target_s[j]), look,
                             np.array([ttft]), np.array([tpot]), w, prob.slot_s,
                             prob.horizon)
        # prorated at the grid's end as the LP's columns are (solvers.problem)
        k = math.ceil((first_token_s[j] - prob.t0_s) / prob.slot_s - 1e-9)
        d = max(math.ceil(decode_time / prob.slot_s - 1e-9), 1)
        share = min(max((prob.num_slots - k) / d, 0.0), 1.0) if prorate else 1.0
        out[j] = float(terms.total[0]) * share
    return out
