"""The price step in NumPy, the reference the JAX steps (``olproute.pricing.step_jax``)
are tested against, and the samples both take. Shadow prices p[g, k, r] >= 0 for batch
slots, KV cache and compute (the prefill token budget), in capacity fractions, per
instance g and future slot k, are learned online by projected mini-batch steps on the SAA
dual (docs/design.md section 1; the book that holds them: ``olproute.pricing.book``):

    grad = c - (N_H / |S|) * sum_{i in S} a_i(x_i(p));   p <- max(0, p - step(grad))

``c`` is the free capacity from the current snapshots (clipped at 0, as the LP's
right-hand side), ``x_i(p)`` sends sample i to its best (instance, delay) if its margin
r_igl - a_igl . p_g is positive (else nowhere), each sample is placed at a random start
offset in the horizon (a sample of the future), and N_H is the expected number of
arrivals in the horizon. A sample has a column per instance and per **delay** l of
``delays`` (slots): started l slots later, its column moves by l and its reward is the
reward of that later start (the LP's columns d = 0..max_delay are exactly this), so the
step is the stochastic subgradient step of the LP's dual D(p) itself.

The step rule (``PriceConfig.schedule``):
- ``constant`` / ``inverse_sqrt``: eta0 or eta0 / sqrt(t + 1) times the gradient, eta0 in
  price units per capacity fraction (it must match the scale of rewards over usage:
  a fixed eta0 that suits one scenario winds up or crawls in another);
- ``adagrad`` (the default): per coordinate, eta0 * price_scale * grad / sqrt(sum of
  squared past gradients). ``price_scale`` is the window's typical break-even price, a
  request's reward over the capacity its column uses (reward per capacity-fraction-slot),
  so eta0 is a dimensionless fraction of it and one value serves every scenario; the
  per-coordinate normaliser makes the first steps move by about eta0 * price_scale and
  later ones shrink where the gradient keeps changing sign (the dual's kinks), as
  subgradient convergence needs. The accumulator forgets with a half-life of
  ``adagrad_halflife_steps`` so that prices keep tracking a load that changes online.

**Prorated reward.** A column cut by the horizon's end uses capacity only inside it, so
at its full reward it would be nearly free capacity: samples (and the LP's columns) late
in the horizon would bid the last slots' prices up without bound, an artefact of where
the horizon ends. A column's reward therefore counts in proportion to the share of its
decode slots inside the horizon (the exact LP, ``solvers.problem``, does the same).

The step never builds dense (samples x instances x slots) tensors: a column is an
interval of ones, a linear ramp and (compute) another interval, so a_igl . p_g costs O(1)
from cumulative sums of p, and the chosen columns are summed through difference arrays in
O(H) per instance. ``demand_numpy`` and ``apply_step`` are the step in NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.pricing.reward import (
    BATCH,
    COMPUTE,
    KV,
    NUM_RESOURCES,
    Columns,
    SampleExtent,
    prefill_share,
    price_cumsums,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

ADAGRAD_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Samples:
    """W samples of demand on G instances with L delay options. ``reward`` (W, G, L):
    the reward of starting the sample on g l delays later (-inf: no such column); the
    delay-0 column (W, G): first-token slot ``start``, ``end`` = start + decode slots (not
    cut at the horizon: the step prorates the reward by the share inside it), batch_a,
    kv_a, kv_b, the prefill's slots [start - pre_lo, start + pre_hi) (a mixed instance's
    P slots before the first token's: pre_lo = P, pre_hi = 0, not cut at now; a
    disaggregated prefill engine's column is its prefill as cut at now: 0, pe - ps) and
    the prefill's work s / b in slots of budget, ``prefill_work`` (where the step places
    a sample it takes ``reward.prefill_share`` of the budget on each prefill slot left);
    ``earliest`` (W,), the first slot a prefill may use (the request's arrival: 0 online,
    where slot 0 is the decision); ``delays`` (L,) in slots, the first 0."""

    reward: FloatArray
    start: IntArray
    end: IntArray
    batch_a: FloatArray
    kv_a: FloatArray
    kv_b: FloatArray
    pre_lo: IntArray
    pre_hi: IntArray
    prefill_work: FloatArray
    earliest: IntArray
    delays: IntArray

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The per-sample arrays in the order the steps take them."""
        return (self.reward, self.start, self.end, self.batch_a, self.kv_a, self.kv_b,
                self.pre_lo, self.pre_hi, self.prefill_work, self.earliest)

    @staticmethod
    def empty(w: int, g: int, delays: Sequence[int]) -> Samples:
        dl = np.asarray(delays, dtype=np.int64)
        return Samples(reward=np.full((w, g, len(dl)), -np.inf), start=np.zeros((w, g),
                       dtype=np.int64), end=np.zeros((w, g), dtype=np.int64),
                       batch_a=np.zeros((w, g)), kv_a=np.zeros((w, g)), kv_b=np.zeros((w, g)),
                       pre_lo=np.zeros((w, g), dtype=np.int64),
                       pre_hi=np.zeros((w, g), dtype=np.int64), prefill_work=np.zeros((w, g)),
                       earliest=np.zeros(w, dtype=np.int64), delays=dl)

    def put(self, i: int, reward: FloatArray, cols: Columns, extent: SampleExtent) -> None:
        """Row i := one request's rewards (G,) (delay 0 only) or (G, L), its columns
        (relative to its decision) and what the sample keeps beyond them (the decode's
        whole extent, the prefill's P slots and share: ``SampleExtent``)."""
        r = np.asarray(reward, dtype=np.float64)
        if r.ndim == 1:
            r = np.concatenate([r[:, None], np.full((r.shape[0], self.reward.shape[2] - 1),
                                                    -np.inf)], axis=1)
        self.put_many(np.array([i]), r[None], cols, extent)

    def put_many(self, rows: IntArray, reward: FloatArray, cols: Columns,
                 extent: SampleExtent) -> None:
        """``put`` for K requests at once: rows (K,) := rewards (K, G, L), columns and
        extents (K, G) (a per-instance-only field (G,) is the same on each row)."""
        self.reward[rows] = reward
        self.start[rows] = cols.start
        self.end[rows] = extent.end
        self.batch_a[rows] = cols.batch_a
        self.kv_a[rows] = cols.kv_a
        self.kv_b[rows] = cols.kv_b
        self.pre_lo[rows] = extent.pre_lo
        # the prefill's slots at or after the column's start (a prefill engine's column)
        self.pre_hi[rows] = np.maximum(cols.pre_end - cols.start, 0)
        self.prefill_work[rows] = extent.prefill_work

    def take_rows(self, rows: IntArray) -> tuple[npt.NDArray[Any], ...]:
        """Copies of ``rows`` of every per-sample array (``arrays``' order)."""
        return tuple(a[rows].copy() for a in self.arrays)

    def put_rows(self, rows: IntArray, values: Sequence[npt.NDArray[Any]]) -> None:
        """Rows := ``values`` as ``take_rows`` gave them (another book's rows: the shapes
        past the first must match this window's)."""
        for a, v in zip(self.arrays, values, strict=True):
            if v.shape[1:] != a.shape[1:] or v.shape[0] != len(rows):
                raise ValueError(f"demand rows of shape {v.shape} do not fit a window of "
                                 f"{a.shape} ({len(rows)} rows)")
            a[rows] = v

    def price_scale(self, n: int) -> float:
        """The typical break-even price of the first n samples: median over samples of
        the best delay-0 reward over the capacity (fraction x slots) its column uses
        there. 0 when there is nothing to go by."""
        if n == 0:
            return 0.0
        r = self.reward[:n, :, 0]
        best = np.argmax(np.where(np.isfinite(r), r, -np.inf), axis=1)
        rows = np.arange(n)
        d = np.maximum(self.end[rows, best] - self.start[rows, best], 1).astype(np.float64)
        mass = (self.batch_a[rows, best] * d + self.kv_a[rows, best] * d
                + self.kv_b[rows, best] * d * (d - 1) / 2.0
                + self.prefill_work[rows, best])
        rb = r[rows, best]
        ok = np.isfinite(rb) & (rb > 0) & (mass > 0)
        return float(np.median(rb[ok] / mass[ok])) if ok.any() else 0.0


def step_sizes(eta0: float, schedule: str, t0: int, k: int) -> FloatArray:
    """Step sizes of steps t0 .. t0 + k - 1: eta0 / sqrt(t + 1) for inverse_sqrt, else
    eta0 (constant; adagrad scales eta0 per coordinate itself)."""
    t = np.arange(t0, t0 + k, dtype=np.float64)
    if schedule == "inverse_sqrt":
        result: FloatArray = eta0 / np.sqrt(t + 1.0)
        return result
    return np.full(k, eta0)


@dataclass(frozen=True, slots=True)
class _Placed:
    """The mini-batch's columns moved by their offsets, (S, G, L): clipped batch/KV
    interval [s0, s1), prefill interval [ps, pe) and its budget share, and each column's
    margin at p (-inf: no such column, its start past the horizon)."""

    s0: IntArray
    s1: IntArray
    ps: IntArray
    pe: IntArray
    share: FloatArray
    margin: FloatArray


def _place(p: FloatArray, smp: Samples, idx: IntArray, offset: IntArray) -> _Placed:
    h = p.shape[1]
    p0, p1 = price_cumsums(p)
    sh = offset[:, None, None] + smp.delays[None, None, :]
    s = smp.start[idx][:, :, None] + sh
    s0 = np.minimum(s, h)
    s1 = np.minimum(smp.end[idx][:, :, None] + sh, h)
    first = np.maximum(s - smp.pre_lo[idx][:, :, None],
                       (smp.earliest[idx] + offset)[:, None, None])
    last = s + smp.pre_hi[idx][:, :, None]
    pe = np.minimum(last, h)
    ps = np.minimum(first, h)
    # the prefill's share on its slots left after the clip at the arrival (not the
    # horizon's: the work goes on past it)
    ca = prefill_share(smp.prefill_work[idx][:, :, None], last - first)
    ba, ka, kb = (x[idx][:, :, None] for x in (smp.batch_a, smp.kv_a, smp.kv_b))
    gi = np.arange(p.shape[0])[None, :, None]
    cost = (ba * (p0[gi, s1, BATCH] - p0[gi, s0, BATCH])
            + (ka - kb * s0) * (p0[gi, s1, KV] - p0[gi, s0, KV])
            + kb * (p1[gi, s1, KV] - p1[gi, s0, KV])
            + ca * (p0[gi, pe, COMPUTE] - p0[gi, ps, COMPUTE]))
    with np.errstate(invalid="ignore"):  # -inf x 0 past the horizon: not selected
        margin = np.where(s < h, smp.reward[idx] * _inside(smp, idx, s0, s1) - cost, -np.inf)
    return _Placed(s0, s1, ps, pe, ca, margin)


def _inside(smp: Samples, idx: IntArray, s0: Any, s1: Any) -> Any:
    """The share of a column's decode slots inside the horizon: its reward counts in
    that proportion (``prorated reward`` in the module docstring)."""
    span = np.maximum(smp.end[idx] - smp.start[idx], 1)[:, :, None]
    return np.clip((s1 - s0) / span, 0.0, 1.0)


def saa_dual_value(p: FloatArray, c: FloatArray, smp: Samples, idx: IntArray,
                   offset: IntArray, n_h: float) -> float:
    """The SAA dual's objective sum p c + (N_H / S) sum_i max(0, best margin_i): with the
    LP's requests as the samples (N_H = N, no offsets) it is the LP dual's D(p)."""
    m = _place(p, smp, idx, offset).margin.reshape(len(idx), -1).max(axis=1)
    return float(np.sum(p * c) + n_h / max(len(idx), 1) * np.maximum(m, 0.0).sum())


def demand_numpy(p: FloatArray, smp: Samples, idx: IntArray, mask: BoolArray,
                 offset: IntArray) -> FloatArray:
    """(G, H, R) capacity the mini-batch ``idx`` takes at prices p, each sample at its
    best (instance, delay) with a positive margin, moved by ``offset`` slots."""
    g_count, h, _ = p.shape
    pl = _place(p, smp, idx, offset)
    margin = pl.margin.reshape(len(idx), -1)
    best = np.argmax(margin, axis=1)
    rows = np.arange(len(idx))
    n_l = len(smp.delays)
    bg, bl = best // n_l, best % n_l
    w = (mask & (margin[rows, best] > 0)).astype(np.float64)
    b0, b1 = pl.s0[rows, bg, bl], pl.s1[rows, bg, bl]
    c0, c1 = pl.ps[rows, bg, bl], pl.pe[rows, bg, bl]
    j = idx[rows]
    bba, bka, bkb = (x[j, bg] for x in (smp.batch_a, smp.kv_a, smp.kv_b))
    bca = pl.share[rows, bg, bl]
    d0 = np.zeros((g_count, h + 1, NUM_RESOURCES))
    d1 = np.zeros((g_count, h + 1))
    const = bka - bkb * b0
    for r, (lo, hi, v) in enumerate(((b0, b1, bba), (b0, b1, const), (c0, c1, bca))):
        np.add.at(d0[:, :, r], (bg, lo), w * v)
        np.add.at(d0[:, :, r], (bg, hi), -w * v)
    np.add.at(d1, (bg, b0), w * bkb)
    np.add.at(d1, (bg, b1), -w * bkb)
    k = np.arange(h, dtype=np.float64)[None, :]
    usage: FloatArray = np.cumsum(d0[:, :h], axis=1)
    usage[:, :, KV] += k * np.cumsum(d1[:, :h], axis=1)
    return usage


def apply_step(p: FloatArray, acc: FloatArray, grad: FloatArray, eta: float, rule: str,
               decay: float) -> tuple[FloatArray, FloatArray]:
    """The projected step of ``rule`` on gradient ``grad``; returns (p, accumulator)."""
    if rule == "adagrad":
        acc = decay * acc + grad * grad
        step = eta * grad / (np.sqrt(acc) + ADAGRAD_EPS)
    else:
        step = eta * grad
    return np.maximum(p - step, 0.0), acc


def dual_step_numpy(p: FloatArray, acc: FloatArray, c: FloatArray, smp: Samples,
                    idx: IntArray, mask: BoolArray, offset: IntArray, n_h: float, eta: float,
                    rule: str = "constant", decay: float = 1.0
                    ) -> tuple[FloatArray, FloatArray]:
    """One projected step: the reference the JAX steps are tested against."""
    n_valid = max(int(mask.sum()), 1)
    grad = c - (n_h / n_valid) * demand_numpy(p, smp, idx, mask, offset)
    return apply_step(p, acc, grad, eta, rule, decay)

