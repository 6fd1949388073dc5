"""The multi-objective reward r_jg and the usage columns a_jg (docs/design.md section 1).

Time is cut into slots of ``slot_s`` (Delta); the horizon is ``H`` slots, slot 0 is now.
A request started on instance g produces its first token in slot ``k0 = ceil(TTFT/Delta)``
and then holds one batch slot and a growing KV footprint for ``D = ceil(o_hat * tpot /
Delta)`` slots, tpot the time per output token it is expected to see there over its
decode (``estimate.decode_load.load_aware_tpot``: the step of now or the instance's
steady step under its load once it has one). Its **usage column** is therefore
an interval of ones (batch row) and a linear ramp (KV row) on [k0, k0 + D), stored as a
few numbers, never as a dense vector: on slot k of the interval the batch row uses
``batch_a`` and the KV row ``kv_a + kv_b * (k - k0)``.

The third resource is **compute**: the prefill token budget of an instance, ``b_g`` =
kappa tokens per engine step (``max_num_batched_tokens``) times the engine steps in a
slot at the calibrated time of such a step: the calibrated prefill throughput times the
slot (``compute_budget``). A prompt of s tokens needs
``P = ceil(s / b_g)`` slots of it, the slots its prefill runs in: [k0 - P, k0) (the
first token comes out of slot k0 - 1, where the prefill ends, and its decode holds the
batch from slot k0 on), clipped at 0 (now), using
``compute_a = s / (P b_g)`` of the budget in each (a prefill the clip cuts short spreads
over the slots left, at most the whole budget: ``prefill_share``). On disaggregated
pools the prefill engine's column is this compute row (and its KV); the decode engine's
has no compute row.

All rows are in **capacity fractions** (batch slots over max_num_seqs B, KV tokens over
the KV capacity M, prefill tokens over b_g), so one price scale fits every resource and
every instance.

Reward terms (weights from the ``reward`` section of the YAML), all >= 0 so that not
serving a request is never rewarded:
- ``qps``: sigma, one more request served;
- ``throughput``: alpha * tokens / token_norm, counting the prompt and the predicted
  output tokens generated within the horizon;
- ``eel_saved``: beta * (H - completion slot)+, completion slot = k0 + D;
- ``ttft_saved``: gamma * (H - k0)+;
- ``eel_slo``, ``ttft_slo``: zeta1 / zeta2 when the predicted EEL (TTFT + o_hat * tpot)
  or TTFT meets its threshold (the TTFT threshold defaults to the request's target);
- ``utility``: omega * (quality - lambda * cost), cost in micro-USD (BEAR eq. 4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.config.schema import RewardConfig
from olproute.estimate.bea import (
    decode_step_time,
    remaining_decode_tokens,
    remaining_prefill_tokens,
)
from olproute.estimate.calibration import InstanceCalibration
from olproute.estimate.decode_load import load_aware_tpot
from olproute.pricing import score_fields as sf
from olproute.routing.outlook import Outlook
from olproute.types import SNAP_OUTPUT, SNAP_PROMPT, EngineSnapshot, InstanceSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

RESOURCES = ("batch", "kv", "compute")
BATCH, KV, COMPUTE = 0, 1, 2
NUM_RESOURCES = len(RESOURCES)
# What the admission checks hold a request to: batch slots and KV are hard (past them
# the engine queues or preempts); compute is a rate, and its congestion is already in
# the BEA replay's TTFT and in the compute price (a compute check on top held back
# requests the replay expects to prefill faster than the calibrated budget b_g, with its
# prefill overlapping the residents' at rate b_g: 10.7% less reward compute-bound).
HARD = slice(BATCH, KV + 1)

TERMS = ("qps", "throughput", "eel_saved", "ttft_saved", "eel_slo", "ttft_slo", "utility")


@dataclass(frozen=True, slots=True)
class Columns:
    """Usage columns of one or more requests on G instances (arrays broadcast together):
    on slots [start, end) the batch row uses batch_a and the KV row kv_a + kv_b*(k-start);
    on slots [pre_start, pre_end) the compute row uses compute_a; all in capacity
    fractions. ``end, pre_end <= H``; an empty interval uses nothing."""

    start: IntArray
    end: IntArray
    batch_a: FloatArray
    kv_a: FloatArray
    kv_b: FloatArray
    pre_start: IntArray
    pre_end: IntArray
    compute_a: FloatArray

    def broadcast(self, shape: tuple[int, ...]) -> Columns:
        """Every field broadcast to ``shape`` (read-only views)."""
        return Columns(*(np.broadcast_to(getattr(self, f), shape) for f in COLUMN_FIELDS))


COLUMN_FIELDS = ("start", "end", "batch_a", "kv_a", "kv_b", "pre_start", "pre_end",
                 "compute_a")

# one request's column on one instance: (start, end, batch_a, kv_a, kv_b, pre_start,
# pre_end, compute_a)
Column = tuple[int, int, float, float, float, int, int, float]


def column_at(cols: Columns, i: int | tuple[int, ...]) -> Column:
    """Entry ``i`` of a set of columns, as plain numbers."""
    return (int(cols.start[i]), int(cols.end[i]), float(cols.batch_a[i]),
            float(cols.kv_a[i]), float(cols.kv_b[i]), int(cols.pre_start[i]),
            int(cols.pre_end[i]), float(cols.compute_a[i]))


def shifted_usage(col: Column, k: int, horizon: int) -> tuple[slice, FloatArray] | None:
    """The slots a column covers on a capacity curve computed k slots ago (so it moves
    by k; a negative k for a column placed -k slots ago), and its (batch, KV, compute)
    usage there; None when none of it is within the horizon."""
    s, e, ba, ka, kb, ps, pe, ca = col
    lo = max(min(s if e > s else horizon, ps if pe > ps else horizon) + k, 0)
    hi = min(max(e if e > s else 0, pe if pe > ps else 0) + k, horizon)
    if lo >= hi:
        return None
    slots = np.arange(lo, hi)
    usage = np.zeros((hi - lo, NUM_RESOURCES))
    inside = (slots >= s + k) & (slots < e + k)
    usage[inside, BATCH] = ba
    usage[inside, KV] = ka + kb * (slots[inside] - (s + k))
    usage[(slots >= ps + k) & (slots < pe + k), COMPUTE] = ca
    return slice(lo, hi), usage


def fits_under(free: FloatArray, col: Column, k: int, horizon: int) -> bool:
    """Does a column, on a capacity curve computed k slots ago (``shifted_usage``), fit
    under that curve's free batch slots and KV (``HARD``; ``free`` is one instance's
    (H, 3))? Every slot it covers must keep free >= its use there: the same test as
    ``(free[span, HARD] - usage[:, HARD]).min() >= 0`` over ``shifted_usage``'s slots,
    without building the usage."""
    s, e, ba, ka, kb, ps, pe, _ = col
    lo = max(min(s if e > s else horizon, ps if pe > ps else horizon) + k, 0)
    hi = min(max(e if e > s else 0, pe if pe > ps else 0) + k, horizon)
    if lo >= hi:
        return True
    f = free[lo:hi, HARD]
    ds, de = min(max(s + k, lo), hi), max(min(e + k, hi), lo)
    if ds >= de:
        return bool(f.min() >= 0.0)
    if (ds > lo and f[:ds - lo].min() < 0.0) or (de < hi and f[de - lo:].min() < 0.0):
        return False
    mid = f[ds - lo:de - lo]
    kv = ka + kb * (np.arange(ds, de) - (s + k))
    return bool((mid[:, 0] - ba).min() >= 0.0 and (mid[:, 1] - kv).min() >= 0.0)


def take_column(free: FloatArray, col: Column, k: int, horizon: int) -> None:
    """Subtract a column, on a capacity curve computed k slots ago (``shifted_usage``),
    from that curve in place (one instance's (H, 3)): the same as ``free[span] -= usage``
    over ``shifted_usage``'s slots, without building the usage."""
    s, e, ba, ka, kb, ps, pe, ca = col
    ds, de = max(s + k, 0), min(e + k, horizon)
    if ds < de:
        free[ds:de, BATCH] -= ba
        free[ds:de, KV] -= ka + kb * (np.arange(ds, de) - (s + k))
    qs, qe = max(ps + k, 0), min(pe + k, horizon)
    if qs < qe:
        free[qs:qe, COMPUTE] -= ca


def slots_since(now_s: float, then_s: float, slot_s: float) -> int:
    """Whole slots elapsed from then to now (0 if now is earlier), with a tolerance for
    rounding: 0.5 s is 10 slots of 0.05 s (``0.5 // 0.05`` is 9.0 in floating point)."""
    return max(math.floor((now_s - then_s) / slot_s + 1e-9), 0)


@dataclass(frozen=True, slots=True)
class RewardTerms:
    """Each reward term per instance (already weighted), and their sum."""

    qps: FloatArray
    throughput: FloatArray
    eel_saved: FloatArray
    ttft_saved: FloatArray
    eel_slo: FloatArray
    ttft_slo: FloatArray
    utility: FloatArray

    @property
    def total(self) -> FloatArray:
        result: FloatArray = (self.qps + self.throughput + self.eel_saved + self.ttft_saved
                              + self.eel_slo + self.ttft_slo + self.utility)
        return result

    def as_dict(self) -> dict[str, tuple[float, ...]]:
        return {name: tuple(getattr(self, name).tolist()) for name in TERMS}


def first_token_slot(ttft_s: FloatArray, slot_s: float, horizon: int) -> IntArray:
    """k0 = ceil(TTFT / Delta), clipped to [0, H] (an infinite TTFT is slot H)."""
    k = np.ceil(np.minimum(ttft_s, horizon * slot_s) / slot_s - 1e-9)
    result: IntArray = np.clip(k, 0, horizon).astype(np.int64)
    return result


def decode_slots(decode_tokens: FloatArray, tpot_s: FloatArray, slot_s: float) -> IntArray:
    """D = ceil(o_hat * tpot / Delta), at least one slot."""
    result: IntArray = np.maximum(np.ceil(decode_tokens * tpot_s / slot_s - 1e-9), 1).astype(
        np.int64)
    return result


def capacities(specs: Sequence[InstanceSpec]) -> tuple[FloatArray, FloatArray]:
    """(B, M): batch slots and KV tokens per instance."""
    batch = np.array([s.max_num_seqs for s in specs], dtype=np.float64)
    kv = np.array([s.kv_capacity_tokens for s in specs], dtype=np.float64)
    return batch, kv


def compute_budget(calibrations: Sequence[InstanceCalibration], slot_s: float) -> FloatArray:
    """b_g, prefill tokens per slot per instance: the calibrated prefill throughput (the
    prefill tokens of the batch log over the time of the batches that carried them,
    ``InstanceCalibration.prefill_tokens_per_s``) times the slot, i.e. kappa tokens a step
    times the steps a slot at the calibrated time of such a step, decodes riding along
    included. (The batch-time model alone, kappa Delta / (beta0 + beta1 kappa + beta3
    kappa^2 / 2), says 857 a slot for Llama-2-7B on an A100 where 613 are measured.)"""
    result: FloatArray = np.array([c.prefill_tokens_per_s for c in calibrations],
                                  dtype=np.float64) * slot_s
    return result


def prefill_span(prompt_tokens: float | FloatArray, first_slot: IntArray,
                 budget: FloatArray, horizon: int) -> tuple[IntArray, IntArray, FloatArray]:
    """(pre_start, pre_end, compute_a): the slots [k0 - P, k0) a prompt's prefill runs in
    (clipped at 0, now), P = ceil(s / b) (``prefill_slots``), and its share of the budget
    in each: s / (P b), or when the clip leaves fewer slots (a first token predicted
    sooner than P slots of the calibrated budget allow) the prompt spread over those,
    at most the whole budget (module docstring). A first token at or past the horizon
    (an instance that never starts it) has no prefill in it."""
    s = np.asarray(prompt_tokens, dtype=np.float64)
    n_slots = prefill_slots(s, budget)
    beyond = first_slot >= horizon
    end = np.where(beyond, horizon, first_slot)
    start = np.where(beyond, horizon, np.clip(first_slot - n_slots, 0, horizon))
    share = prefill_share(s / budget, end - start)
    return start.astype(np.int64), end.astype(np.int64), share


def prefill_share(work: Any, kept: Any) -> Any:
    """The budget share a prefill of ``work`` = s / b slots' worth of budget takes on each
    of the ``kept`` slots left of its P after a clip (at now, or at the arrival): s / (P b)
    when none is cut, else the prompt spread over the kept slots, at most the whole
    budget (a first token predicted sooner than the calibrated budget allows). NumPy or
    JAX arrays alike."""
    return (work / kept.clip(1, None)).clip(None, 1.0)


def prefill_slots(prompt_tokens: float | FloatArray, budget: FloatArray) -> IntArray:
    """P = ceil(s / b), at least one slot: the slots a prompt's prefill runs in."""
    result: IntArray = np.maximum(np.ceil(np.asarray(prompt_tokens, dtype=np.float64) / budget
                                          - 1e-9), 1.0).astype(np.int64)
    return result


@dataclass(frozen=True, slots=True)
class SampleExtent:
    """What a demand sample keeps of a request's columns beyond the columns themselves,
    per instance: the decode's ``end`` (start + D, not cut at the horizon), the ``pre_lo``
    prefill slots before the start (P, not cut at now) and the prefill's ``prefill_work``
    s / b (the step clips the P slots where it places the sample, as the LP clips them
    at the arrival, and takes ``prefill_share`` of the budget on those left)."""

    end: IntArray
    pre_lo: IntArray
    prefill_work: FloatArray

    @staticmethod
    def of_columns(cols: Columns) -> SampleExtent:
        """A column that is its own extent (a prefill engine's: the prefill itself, cut
        at now, which cannot start before)."""
        kept = np.maximum(cols.pre_end - cols.pre_start, 0)
        return SampleExtent(cols.end, np.zeros_like(cols.start), cols.compute_a * kept)


def sample_extent(cols: Columns, prompt_tokens: int | FloatArray, decode_tokens: FloatArray,
                  tpot_s: FloatArray, budget: FloatArray, slot_s: float) -> SampleExtent:
    """A mixed instance's request as a demand sample keeps it (``SampleExtent``): the
    step moves the sample and prorates its reward by the share of its D decode slots
    inside the horizon."""
    p = prefill_slots(prompt_tokens, budget)
    end: IntArray = cols.start + decode_slots(decode_tokens, tpot_s, slot_s)
    return SampleExtent(end, np.broadcast_to(p, end.shape),
                        np.broadcast_to(prompt_tokens / budget, end.shape))


def shift_columns(cols: Columns, k: int, horizon: int) -> Columns:
    """The columns moved k >= 0 slots later, cut at the horizon (a column priced on
    prices k slots older than now)."""
    if k == 0:
        return cols
    return Columns(start=np.minimum(cols.start + k, horizon),
                   end=np.minimum(cols.end + k, horizon), batch_a=cols.batch_a,
                   kv_a=cols.kv_a, kv_b=cols.kv_b,
                   pre_start=np.minimum(cols.pre_start + k, horizon),
                   pre_end=np.minimum(cols.pre_end + k, horizon), compute_a=cols.compute_a)


def usage_columns(prompt_tokens: int | FloatArray, decode_tokens: FloatArray,
                  ttft_s: FloatArray, tpot_s: FloatArray, batch_cap: FloatArray,
                  kv_cap: FloatArray, budget: FloatArray, slot_s: float,
                  horizon: int) -> Columns:
    """The request's column on every instance (docs/design.md, 1: s + theta + 1 KV tokens after
    theta generated tokens, Delta / tpot tokens per slot; its prefill in the slots up to
    its first token's). Several requests at once with ``prompt_tokens`` of shape (N, 1)
    and the rest (N, G)."""
    k0 = first_token_slot(ttft_s, slot_s, horizon)
    end = np.minimum(k0 + decode_slots(decode_tokens, tpot_s, slot_s), horizon)
    ps, pe, ca = prefill_span(np.asarray(prompt_tokens, dtype=np.float64), k0, budget,
                              horizon)
    return Columns(start=k0, end=end, batch_a=1.0 / batch_cap,
                   kv_a=(prompt_tokens + 1.0) / kv_cap, kv_b=(slot_s / tpot_s) / kv_cap,
                   pre_start=ps, pre_end=pe, compute_a=ca)


def column_mass(cols: Columns) -> FloatArray:
    """Each column's whole use, in capacity-fraction slots summed over the resources (its
    price at a price of 1 everywhere): what a request takes from an instance, for ranking
    requests by reward per use."""
    d = np.maximum(cols.end - cols.start, 0).astype(np.float64)
    p = np.maximum(cols.pre_end - cols.pre_start, 0).astype(np.float64)
    result: FloatArray = ((cols.batch_a + cols.kv_a) * d + cols.kv_b * d * (d - 1) / 2
                          + cols.compute_a * p)
    return result


def reward_terms(prompt_tokens: int | FloatArray, ttft_target_s: float | FloatArray,
                 outlook: Outlook, ttft_s: FloatArray, tpot_s: FloatArray, w: RewardConfig,
                 slot_s: float, horizon: int,
                 waited_s: float | FloatArray = 0.0) -> RewardTerms:
    """r_jg term by term for one request on every instance (see the module docstring).
    ``ttft_s`` is counted from now; ``waited_s`` is the time the request has already
    spent in the router's buffer, so latencies (and the SLO indicators) are judged from
    its arrival: a request held past its target no longer earns the on-time bonus.
    Several requests at once with the per-request figures of shape (N, 1) and the
    outlook's and estimates' (N, G)."""
    ttft_s = ttft_s + waited_s
    k0 = first_token_slot(ttft_s, slot_s, horizon)
    d = decode_slots(outlook.decode_tokens, tpot_s, slot_s)
    in_horizon = k0 < horizon
    decode_in_h = np.minimum(outlook.decode_tokens,
                             np.maximum(horizon - k0, 0) * slot_s / tpot_s)
    tokens = np.where(in_horizon, prompt_tokens + decode_in_h, 0.0)
    eel = ttft_s + outlook.decode_tokens * tpot_s
    t2 = ttft_target_s if w.ttft_threshold_s is None else w.ttft_threshold_s
    return RewardTerms(
        qps=np.full(np.shape(ttft_s), w.sigma),
        throughput=w.alpha * tokens / w.token_norm,
        eel_saved=w.beta * np.maximum(horizon - (k0 + d), 0).astype(np.float64),
        ttft_saved=w.gamma * np.maximum(horizon - k0, 0).astype(np.float64),
        eel_slo=w.zeta1 * (eel <= w.eel_threshold_s).astype(np.float64),
        ttft_slo=w.zeta2 * (ttft_s <= t2).astype(np.float64),
        utility=w.omega * outlook.utility(w.cost_lambda),
    )


def dense(cols: Columns, horizon: int) -> FloatArray:
    """(..., H, 3) dense usage of the columns: for tests and plots, never on a hot path."""
    k = np.arange(horizon)
    start, end = cols.start[..., None], cols.end[..., None]
    inside = (k >= start) & (k < end)
    batch = np.where(inside, cols.batch_a[..., None], 0.0)
    kv = np.where(inside, cols.kv_a[..., None] + cols.kv_b[..., None] * (k - start), 0.0)
    pre = (k >= cols.pre_start[..., None]) & (k < cols.pre_end[..., None])
    compute = np.where(pre, cols.compute_a[..., None], 0.0)
    return np.stack(np.broadcast_arrays(batch, kv, compute), axis=-1)


def price_cumsums(p: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Cumulative sums of prices p (G, H, R): P0[g, k] = sum_{i<k} p[g, i] and
    P1[g, k] = sum_{i<k} i * p[g, i], each (G, H + 1, R)."""
    g, h, r = p.shape
    k = np.arange(h, dtype=np.float64)[None, :, None]
    zero = np.zeros((g, 1, r))
    p0 = np.concatenate([zero, np.cumsum(p, axis=1)], axis=1)
    p1 = np.concatenate([zero, np.cumsum(p * k, axis=1)], axis=1)
    return p0, p1


def pack_cumsums(p0: FloatArray, p1: FloatArray) -> FloatArray:
    """(G, H + 1, 4): per slot P0 of the batch, KV and compute rows and P1 of the KV row,
    side by side, so the compiled kernel reads a column's price from a few cache lines
    (``_score``); the same numbers as ``price_cumsums``'s."""
    packed: FloatArray = np.concatenate([p0, p1[:, :, KV:KV + 1]], axis=2)
    return packed


def column_price(cols: Columns, p0: FloatArray, p1: FloatArray) -> FloatArray:
    """a_jg . p_g for every instance g, in O(1) each from the cumulative sums:
    sum_{k in [s, e)} (a + b (k - s)) p_k = (a - b s)(P0[e] - P0[s]) + b (P1[e] - P1[s]),
    plus compute_a (P0[pe] - P0[ps]) for the prefill's slots."""
    g = np.arange(p0.shape[0])
    s, e = cols.start, cols.end
    batch = cols.batch_a * (p0[g, e, BATCH] - p0[g, s, BATCH])
    kv = ((cols.kv_a - cols.kv_b * s) * (p0[g, e, KV] - p0[g, s, KV])
          + cols.kv_b * (p1[g, e, KV] - p1[g, s, KV]))
    compute = cols.compute_a * (p0[g, cols.pre_end, COMPUTE] - p0[g, cols.pre_start, COMPUTE])
    result: FloatArray = batch + kv + compute
    return result


def resident_usage(snap: EngineSnapshot, batch_cap: float, kv_cap: float, tpot_s: float,
                   budget: float, slot_s: float, horizon: int) -> FloatArray:
    """(H, 3) capacity fractions the residents of a snapshot are predicted to hold, from
    now: each holds its slot and its growing context until its predicted output is done,
    and the prompt tokens still to prefill take the budget from now at the full rate.
    Aggregated through difference arrays, O(residents + H)."""
    t = snap.table
    out = np.zeros((horizon, NUM_RESOURCES))
    if t.shape[0] == 0:
        return out
    remaining = remaining_decode_tokens(snap).astype(np.float64)
    end = np.minimum(np.ceil(remaining * tpot_s / slot_s - 1e-9).astype(np.int64), horizon)
    end = np.maximum(end, 1)
    context = (t[:, SNAP_PROMPT] + t[:, SNAP_OUTPUT]).astype(np.float64)
    slope = slot_s / tpot_s
    d_const = np.zeros((horizon + 1, 2))
    d_slope = np.zeros(horizon + 1)
    n = t.shape[0]
    d_const[0, 0] += n / batch_cap
    np.add.at(d_const[:, 0], end, -1.0 / batch_cap)
    d_const[0, 1] += context.sum() / kv_cap
    np.add.at(d_const[:, 1], end, -context / kv_cap)
    d_slope[0] += n * slope / kv_cap
    np.add.at(d_slope, end, -slope / kv_cap)
    k = np.arange(horizon, dtype=np.float64)
    out[:, BATCH] = np.cumsum(d_const[:horizon, 0])
    out[:, KV] = np.cumsum(d_const[:horizon, 1]) + k * np.cumsum(d_slope[:horizon])
    out[:, COMPUTE] = prefill_load(float(remaining_prefill_tokens(snap).sum()), budget,
                                   horizon)
    return out


def prefill_load(tokens: float, budget: float, horizon: int) -> FloatArray:
    """(H,) budget fractions taken by ``tokens`` of prefill run from now at the full
    rate: whole slots, then the remainder."""
    busy = tokens / budget
    out = np.zeros(horizon)
    full = min(math.floor(busy), horizon)
    out[:full] = 1.0
    if full < horizon:
        out[full] = busy - full
    return out


def free_capacity(snapshots: Sequence[EngineSnapshot], specs: Sequence[InstanceSpec],
                  tpot_s: FloatArray, budget: FloatArray, slot_s: float,
                  horizon: int) -> FloatArray:
    """c[g, k, r] = 1 - what the residents of g hold at slot k (capacity fractions),
    clipped at 0 as the exact LP clips its right-hand side: an over-committed slot has
    nothing left to sell, and a negative capacity would only wind the prices up (the
    dual's gradient c - demand could never turn positive there)."""
    batch_cap, kv_cap = capacities(specs)
    free = np.stack([1.0 - resident_usage(s, batch_cap[g], kv_cap[g], float(tpot_s[g]),
                                          float(budget[g]), slot_s, horizon)
                     for g, s in enumerate(snapshots)])
    result: FloatArray = np.maximum(free, 0.0)
    return result


def reward_weights(w: RewardConfig) -> FloatArray:
    """The weights as the compiled decision kernel reads them (``score_fields.W_*``, in
    the order of ``score_fields.WEIGHTS``; no TTFT threshold: NaN, each request's own
    target)."""
    by_name = {"sigma": w.sigma, "alpha": w.alpha, "token_norm": w.token_norm,
               "beta": w.beta, "gamma": w.gamma, "zeta1": w.zeta1,
               "eel_threshold": w.eel_threshold_s, "zeta2": w.zeta2,
               "ttft_threshold": math.nan if w.ttft_threshold_s is None
               else w.ttft_threshold_s,
               "omega": w.omega, "delta": w.delta}
    return np.array([by_name[n] for n in sf.WEIGHTS], dtype=np.float64)


def score_reference(prompt: FloatArray, decode: FloatArray, utility: FloatArray,
                    ttft: FloatArray, num_resident: FloatArray, resident_context: FloatArray,
                    beta: FloatArray, waited: FloatArray, target: FloatArray,
                    batch_cap: FloatArray, kv_cap: FloatArray, budget: FloatArray,
                    slot_s: float, horizon: int, w: RewardConfig, p0: FloatArray,
                    p1: FloatArray, shift: int, idx: IntArray, num_instances: int,
                    cached: FloatArray | None = None, steady: FloatArray | None = None
                    ) -> tuple[FloatArray, IntArray, npt.NDArray[np.bool_]]:
    """The NumPy twin of ``_score.Scorer.score`` (its bound constants and its loads as
    arguments, the weights as a ``RewardConfig``; the same results for finite inputs),
    built from the functions the price step and the LP read: ``bea.decode_step_time``
    and ``decode_load.load_aware_tpot`` (``steady`` (G,): each instance's steady decode
    step, default 0), ``usage_columns``, ``reward_terms`` and ``column_price``. For
    tests; bid_price runs the kernel. Its outputs' rows are as ``score_fields`` declares them."""
    n = prompt.shape[0]
    s = prompt[:, None]
    tpot = decode_step_time(beta[idx], num_resident, resident_context, prompt)
    if steady is not None:
        tpot = load_aware_tpot(tpot, steady[idx])
    fresh = s if cached is None else s - cached   # the prompt tokens it computes
    cols = usage_columns(fresh, decode, ttft, tpot, batch_cap[idx], kv_cap[idx],
                         budget[idx], slot_s, horizon)
    out = Outlook(decode, utility, np.zeros_like(utility))
    terms = reward_terms(s, target[:, None], out, ttft, tpot, w.model_copy(
        update={"cost_lambda": 0.0}), slot_s, horizon, waited_s=waited[:, None])
    price = column_price(shift_columns(cols, shift, horizon), p0[idx], p1[idx])
    finite = np.where(np.isfinite(ttft), ttft, 1e9)
    f = np.full((sf.NUM_F, n, num_instances), np.nan)
    f[sf.F_TTFT], f[sf.F_REWARD], f[sf.F_LAGRANGIAN] = np.inf, -np.inf, -np.inf
    f[sf.F_PRICE] = 0.0
    f[sf.F_FINITE_TTFT] = 1e9
    rows = {sf.F_TTFT: ttft, sf.F_TPOT: tpot, sf.F_KV_A: cols.kv_a, sf.F_KV_B: cols.kv_b,
            sf.F_COMPUTE_A: cols.compute_a, sf.F_QPS: terms.qps,
            sf.F_THROUGHPUT: terms.throughput, sf.F_EEL_SAVED: terms.eel_saved,
            sf.F_TTFT_SAVED: terms.ttft_saved, sf.F_EEL_SLO: terms.eel_slo,
            sf.F_TTFT_SLO: terms.ttft_slo, sf.F_UTILITY: terms.utility,
            sf.F_REWARD: terms.total, sf.F_PRICE: price,
            sf.F_LAGRANGIAN: terms.total - w.delta * finite - price, sf.F_FINITE_TTFT: finite}
    for r, v in rows.items():
        f[r][:, idx] = v
    i = np.full((sf.NUM_I, n, num_instances), horizon, dtype=np.int64)
    for r, v in ((sf.I_START, cols.start), (sf.I_END, cols.end),
                 (sf.I_PRE_START, cols.pre_start), (sf.I_PRE_END, cols.pre_end)):
        i[r][:, idx] = v
    on_time = np.zeros((n, num_instances), dtype=bool)
    on_time[:, idx] = ttft + waited[:, None] <= target[:, None]
    return f, i, on_time
