"""The data of the exact LP and its columns (docs/design.md section 1).

A window of N requests on G instances, on an **absolute** grid of K slots of ``slot_s``
(slot 0 starts at ``t0_s``; request j arrives in slot ``a_j``). Variable x_jgk is "j's
first token on g in slot k". A start ``d`` slots later than the earliest possible one has

    TTFT_jgd = exec_jg + d * slot_s,     k = a_j + ceil(TTFT_jgd / slot_s),

with ``exec_jg`` the queue-free TTFT (prefill alone): waiting is modelled by the delay d,
so it is not also inside exec. d runs over 0..max_delay (and k < K). The column is the
usage column of ``olproute.pricing.reward`` moved to k: one batch slot (1/B) and the KV ramp
(s + 1 + theta tokens over M) on [k, min(k + D_jg, K)), D_jg = ceil(o_jg * tpot_jg /
slot_s); and compute, the prefill token budget b_g per slot: the prompt's P_jg =
ceil(s_j / b_g) prefill slots [clip(k - P_jg, a_j, K), min(k, K)), each using
s_j / (P_jg b_g) of the budget. No prefill runs before the request's arrival (clipped
there, as the online column clips it at its slot 0, the decision), and a prefill cut
there spreads over the slots left, at most the whole budget
(``olproute.pricing.reward.prefill_share``).

**The grid's end.** Usage past the grid's end is not constrained, so a column cut there
at its full reward would be nearly free capacity: the late columns would bid the last
slots' duals up to hundreds (the reward of a whole request over one slot's usage), an
artefact of where the window ends. A column's reward therefore counts in proportion to
the share of its decode slots inside the grid, (min(k + D, K) - k) / D, as the online
price samples prorate theirs at the horizon (``olproute.pricing.step_ref``) and as
``solvers.certificate.online_reward`` prorates the online policy's.

The reward r_jgd is ``olproute.pricing.reward.reward_terms`` with TTFT_jgd, measured from the
arrival and with the reward horizon H counted from the arrival: waiting lowers the
TTFT- and EEL-saved terms and can lose the SLO indicators, exactly as for bid_price.
``reward_grid`` evaluates those terms vectorised over (requests, instances, delays);
the tests check it against ``reward_terms`` term by term.

The capacity of (g, k, resource) is the free capacity ``free`` (capacity fractions, 1
minus what the residents at the window start hold; resources ``BATCH, KV, COMPUTE`` of
``olproute.pricing.reward``), clipped at 0: an over-committed slot can take no new request, and
x = 0 stays feasible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from olproute.config.schema import RewardConfig
from olproute.pricing.reward import (
    BATCH,
    COMPUTE,
    KV,
    NUM_RESOURCES,
    decode_slots,
    first_token_slot,
    prefill_share,
    prefill_slots,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class LpProblem:
    """A window of requests, their per-instance predictions and the free capacity.
    Arrays are (N,) per request, (N, G) per request and instance, (G, K, 3) per slot."""

    slot_s: float
    num_slots: int                  # K, the LP grid
    horizon: int                    # H of the reward terms (slots after arrival)
    t0_s: float                     # absolute time of grid slot 0
    arrival_s: FloatArray
    prompt_tokens: FloatArray
    ttft_target_s: FloatArray
    decode_tokens: FloatArray       # predicted output tokens o_jg
    utility: FloatArray             # quality - lambda * cost (unweighted, BEAR eq. 4)
    tpot_s: FloatArray              # time per output token expected on g
    exec_ttft_s: FloatArray         # queue-free TTFT on g
    batch_cap: FloatArray           # B_g, batch slots
    kv_cap: FloatArray              # M_g, KV tokens
    compute_cap: FloatArray         # b_g, prefill tokens per slot
    free: FloatArray                # (G, K, 3) free capacity fractions at the window start
    reward: RewardConfig
    max_delay: int                  # latest start: earliest + max_delay slots
    _derived: dict[str, npt.NDArray[np.generic]] = field(default_factory=dict, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        n, g = self.decode_tokens.shape
        for name in ("utility", "tpot_s", "exec_ttft_s"):
            if getattr(self, name).shape != (n, g):
                raise ValueError(f"{name} must have shape {(n, g)}")
        for name in ("batch_cap", "kv_cap", "compute_cap"):
            if getattr(self, name).shape != (g,):
                raise ValueError(f"{name} must have shape {(g,)}")
        if self.free.shape != (g, self.num_slots, NUM_RESOURCES):
            raise ValueError(f"free must have shape {(g, self.num_slots, NUM_RESOURCES)}, "
                             f"got {self.free.shape}")
        if self.max_delay < 0:
            raise ValueError("max_delay must be >= 0")

    @property
    def num_requests(self) -> int:
        return int(self.decode_tokens.shape[0])

    @property
    def num_instances(self) -> int:
        return int(self.decode_tokens.shape[1])

    @property
    def num_delays(self) -> int:
        return self.max_delay + 1

    @property
    def capacity(self) -> FloatArray:
        """c[g, k, r] >= 0: the right-hand side of the capacity rows."""
        result: FloatArray = np.maximum(self.free, 0.0)
        return result

    def _cached(self, key: str) -> npt.NDArray[np.generic]:
        if key not in self._derived:
            a = np.floor((self.arrival_s - self.t0_s) / self.slot_s + 1e-9).astype(np.int64)
            self._derived["arrival_slot"] = a
            self._derived["duration"] = decode_slots(self.decode_tokens, self.tpot_s,
                                                     self.slot_s)
            self._derived["kv_a"] = (self.prompt_tokens[:, None] + 1.0) / self.kv_cap[None, :]
            self._derived["kv_b"] = (self.slot_s / self.tpot_s) / self.kv_cap[None, :]
            budget = self.compute_cap[None, :]
            slots = prefill_slots(self.prompt_tokens[:, None], budget)
            self._derived["prefill_slots"] = slots
            self._derived["prefill_work"] = self.prompt_tokens[:, None] / budget
        return self._derived[key]

    @property
    def arrival_slot(self) -> IntArray:
        """a_j: the grid slot of each arrival."""
        result: IntArray = self._cached("arrival_slot").astype(np.int64)
        return result

    @property
    def duration(self) -> IntArray:
        """D_jg: slots of decode, at least one."""
        result: IntArray = self._cached("duration").astype(np.int64)
        return result

    @property
    def kv_a(self) -> FloatArray:
        """KV row on the first slot of the column: (s + 1) / M."""
        result: FloatArray = self._cached("kv_a").astype(np.float64)
        return result

    @property
    def kv_b(self) -> FloatArray:
        """KV growth per slot: (slot / tpot) tokens over M."""
        result: FloatArray = self._cached("kv_b").astype(np.float64)
        return result

    @property
    def batch_a(self) -> FloatArray:
        """Batch row on every slot of the column: 1 / B (per instance)."""
        result: FloatArray = 1.0 / self.batch_cap
        return result

    @property
    def prefill_slots(self) -> IntArray:
        """P_jg = ceil(s_j / b_g), at least one: the slots the prefill runs in."""
        result: IntArray = self._cached("prefill_slots").astype(np.int64)
        return result

    @property
    def prefill_work(self) -> FloatArray:
        """s_j / b_g: the prefill's work in slots of the whole budget."""
        result: FloatArray = self._cached("prefill_work").astype(np.float64)
        return result


def prefill_interval(prob: LpProblem, j: IntArray, g: IntArray, start: IntArray
                     ) -> tuple[IntArray, IntArray, FloatArray]:
    """(pre_start, pre_end, share): the prefill slots [clip(k - P, a_j, K), min(k, K)) of
    columns of requests j on instances g with first-token slot k = ``start`` (arrays
    broadcast together), as ``olproute.pricing.reward.prefill_span`` places them: no prefill
    before the request arrives (as the online column has none before its slot 0, its
    decision); and the budget share on each (``prefill_share`` of the slots the arrival
    leaves, not the grid's end)."""
    k = prob.num_slots
    first = np.maximum(start - prob.prefill_slots[j, g], prob.arrival_slot[j])
    lo: IntArray = np.minimum(first, k)
    hi: IntArray = np.minimum(start, k)
    share: FloatArray = prefill_share(prob.prefill_work[j, g], start - first)
    return lo, hi, share


@dataclass(frozen=True, slots=True)
class ColumnBlock:
    """The columns of some requests, as (n, G, L) arrays over delays d = 0..L-1: absolute
    start and end slot, reward, and whether the column exists (start < K)."""

    request: IntArray   # (n,) request index of each row
    start: IntArray
    end: IntArray
    reward: FloatArray
    valid: BoolArray


@dataclass(frozen=True, slots=True)
class FlatColumns:
    """LP columns as flat arrays: request j, instance g, delay d, absolute [start, end),
    reward r."""

    request: IntArray
    instance: IntArray
    delay: IntArray
    start: IntArray
    end: IntArray
    reward: FloatArray

    def __len__(self) -> int:
        return int(self.request.shape[0])

    @staticmethod
    def concat(parts: Sequence[FlatColumns]) -> FlatColumns:
        return FlatColumns(*(np.concatenate([getattr(p, f) for p in parts])
                             for f in ("request", "instance", "delay", "start", "end",
                                       "reward")))


def flatten(blk: ColumnBlock, mask: npt.NDArray[np.bool_] | None = None,
            delays: IntArray | None = None) -> FlatColumns:
    """The columns of a block where ``mask`` (default: every valid one)."""
    m = blk.valid if mask is None else (mask & blk.valid)
    jj, gg, dd = np.nonzero(m)
    d_of = np.arange(blk.start.shape[2]) if delays is None else delays
    return FlatColumns(request=blk.request[jj], instance=gg.astype(np.int64),
                       delay=np.asarray(d_of, dtype=np.int64)[dd], start=blk.start[m],
                       end=blk.end[m], reward=blk.reward[m])


def reward_grid(prob: LpProblem, j: IntArray, ttft_s: FloatArray) -> FloatArray:
    """r for requests ``j`` (n,) on every instance with TTFT ``ttft_s`` (n, G, L): the
    terms of ``olproute.pricing.reward.reward_terms`` with the reward horizon counted from the
    arrival, vectorised."""
    w, h, slot = prob.reward, prob.horizon, prob.slot_s
    decode = prob.decode_tokens[j][:, :, None]
    tpot = prob.tpot_s[j][:, :, None]
    prompt = prob.prompt_tokens[j][:, None, None]
    k0 = first_token_slot(ttft_s, slot, h)
    d = prob.duration[j][:, :, None]
    decode_in_h = np.minimum(decode, np.maximum(h - k0, 0) * slot / tpot)
    tokens = np.where(k0 < h, prompt + decode_in_h, 0.0)
    eel = ttft_s + decode * tpot
    if w.ttft_threshold_s is None:
        t2 = prob.ttft_target_s[j][:, None, None]
    else:
        t2 = np.full((len(j), 1, 1), w.ttft_threshold_s)
    r: FloatArray = (w.sigma
                     + w.alpha * tokens / w.token_norm
                     + w.beta * np.maximum(h - (k0 + d), 0)
                     + w.gamma * np.maximum(h - k0, 0)
                     + w.zeta1 * (eel <= w.eel_threshold_s)
                     + w.zeta2 * (ttft_s <= t2)
                     + w.omega * prob.utility[j][:, :, None])
    return r


def column_block(prob: LpProblem, j: IntArray, delays: IntArray | None = None) -> ColumnBlock:
    """Columns of requests ``j`` for the given delays (default: all 0..max_delay)."""
    dl = np.arange(prob.num_delays) if delays is None else np.asarray(delays, dtype=np.int64)
    ttft = prob.exec_ttft_s[j][:, :, None] + dl[None, None, :] * prob.slot_s
    k0 = first_token_slot(ttft, prob.slot_s, prob.horizon)
    start = prob.arrival_slot[j][:, None, None] + k0
    k = prob.num_slots
    d = prob.duration[j][:, :, None]
    end = np.minimum(start + d, k)
    inside = np.clip((end - start) / d, 0.0, 1.0)
    return ColumnBlock(request=np.asarray(j, dtype=np.int64), start=start, end=end,
                       reward=reward_grid(prob, j, ttft) * inside, valid=start < k)


def price_cumsums(p: FloatArray) -> tuple[FloatArray, FloatArray]:
    """P0[g, k] = sum_{i<k} p[g, i] and P1[g, k] = sum_{i<k} i p[g, i], each (G, K + 1, 3)."""
    g, k, r = p.shape
    idx = np.arange(k, dtype=np.float64)[None, :, None]
    zero = np.zeros((g, 1, r))
    return (np.concatenate([zero, np.cumsum(p, axis=1)], axis=1),
            np.concatenate([zero, np.cumsum(p * idx, axis=1)], axis=1))


def block_price(prob: LpProblem, blk: ColumnBlock, p0: FloatArray, p1: FloatArray) -> FloatArray:
    """a_jgd . p for every column of the block, O(1) each from the cumulative sums:
    sum_{k in [s, e)} (a + b (k - s)) p_k = (a - b s)(P0[e] - P0[s]) + b (P1[e] - P1[s])
    for batch and KV, plus the prefill's share (P0[pe] - P0[ps]) on its slots."""
    g = np.arange(prob.num_instances)[None, :, None]
    s = np.minimum(blk.start, prob.num_slots)
    e = blk.end
    j = blk.request[:, None, None]
    ka = prob.kv_a[blk.request][:, :, None]
    kb = prob.kv_b[blk.request][:, :, None]
    ba = prob.batch_a[None, :, None]
    ps, pe, ca = prefill_interval(prob, j, g, s)
    cost: FloatArray = (ba * (p0[g, e, BATCH] - p0[g, s, BATCH])
                        + (ka - kb * s) * (p0[g, e, KV] - p0[g, s, KV])
                        + kb * (p1[g, e, KV] - p1[g, s, KV])
                        + ca * (p0[g, pe, COMPUTE] - p0[g, ps, COMPUTE]))
    return cost


def random_instance(num_requests: int, num_instances: int, num_slots: int, seed: int = 0,
                    load: float = 1.3, max_delay: int = 100, slot_s: float = 0.05,
                    horizon: int = 600, reward: RewardConfig | None = None,
                    residents: bool = True, compute_load: float | None = None) -> LpProblem:
    """A synthetic window for tests and benchmarks: arrivals uniform over the grid,
    lognormal prompts (mean ~1,000 tokens) and outputs (mean ~200), TPOT 20-40 ms, a
    queue-free TTFT at 20k prompt tokens/s, and capacities B, M and b sized so that the
    mean demand on each resource, if every request were served, is ``load`` times the
    capacity (> 1: the LP must delay or drop requests); ``compute_load`` overrides the
    load for the prefill budget b alone (0: an unlimited budget, compute never binds).
    With ``residents``, the window starts with instances partly full, draining over its
    first 100 slots (initial occupancy). The batch and KV data do not depend on
    ``compute_load`` (same seed, same draws)."""
    rng = np.random.default_rng(seed)
    n, g, k = num_requests, num_instances, num_slots
    arrival = np.sort(rng.uniform(0.0, k * slot_s, n))
    prompt = np.maximum(np.rint(rng.lognormal(np.log(800.0), 0.7, n)), 1.0)
    out = np.maximum(rng.lognormal(np.log(160.0), 0.7, n), 1.0)
    decode = np.maximum(np.rint(out[:, None] * rng.uniform(0.9, 1.1, (n, g))), 1.0)
    tpot = rng.uniform(0.02, 0.04, (n, g))
    exec_ttft = prompt[:, None] / 20_000.0 * rng.uniform(0.9, 1.1, (n, g))
    # mean concurrent requests per instance if every request were served: B = that / load
    span = np.minimum(decode * tpot / slot_s, k).mean()
    conc = n * span / (k * g)
    batch_cap = np.full(g, max(conc / load, 1.0))
    kv_tokens = (prompt[:, None] + decode / 2.0).mean()
    kv_cap = np.full(g, max(conc * kv_tokens / load, 1.0))
    free = np.ones((g, k, NUM_RESOURCES))
    ramp = np.clip(1.0 - np.arange(k) / 100.0, 0.0, 1.0)
    if residents:
        free[:, :, :2] -= rng.uniform(0.2, 0.8, (g, 1, 2)) * ramp[None, :, None]
    quality = rng.uniform(0.5, 0.9, (n, g))
    # prefill tokens per slot and instance if every request were served: b = that / load
    c_load = load if compute_load is None else compute_load
    prefill_rate = n * float(prompt.mean()) / (k * g)
    compute_cap = np.full(g, prefill_rate / c_load if c_load > 0 else np.inf)
    if residents:
        free[:, :, COMPUTE] -= rng.uniform(0.2, 0.8, (g, 1)) * ramp[None, :]
    return LpProblem(
        slot_s=slot_s, num_slots=k, horizon=horizon, t0_s=0.0, arrival_s=arrival,
        prompt_tokens=prompt, ttft_target_s=np.full(n, 0.5), decode_tokens=decode,
        utility=quality, tpot_s=tpot, exec_ttft_s=exec_ttft, batch_cap=batch_cap,
        kv_cap=kv_cap, compute_cap=compute_cap, free=free, reward=reward or RewardConfig(),
        max_delay=max_delay)
