"""Shadow prices p[g, k, r] >= 0 for batch slots, KV cache and compute (the prefill
token budget), in capacity fractions, per instance g and future slot k, learned online by
projected mini-batch steps on the SAA dual (DESIGN.md section 1):

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

**Averaged prices.** A mini-batch step moves a few slots' prices by what a few random
samples happened to hit (a short prefill interval hits one slot in a hundred): the steps'
own prices are striped with noise. Decisions therefore read an exponential moving average
of them, half-life ``average_halflife_updates`` (Polyak-Ruppert averaging in its
tracking form). On the compute-bound scenario of ``solvers.compare`` (tuning seed 0) the
certificate D(p)/LP* - 1 of the prices decisions read goes from 12.0% (no averaging) to
7.4% (2 updates) and 6.2% (6, the default; 12: 6.2%).

Prices start from the last prices, shifted by the slots elapsed since (warm start).

The step never builds dense (samples x instances x slots) tensors: a column is an
interval of ones, a linear ramp and (compute) another interval, so a_igl . p_g costs O(1)
from prefix sums of p, and the chosen columns are summed through difference arrays in
O(H) per instance. The JAX version runs K steps in one jitted call with fixed shapes
(window and mini-batch are padded), off the request path; ``demand_numpy`` and
``apply_step`` are the same step in NumPy, the reference the tests compare it with.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from olproute.config.schema import PriceConfig
from olproute.pricing.reward import (
    BATCH,
    COMPUTE,
    KV,
    NUM_RESOURCES,
    RESOURCES,
    Columns,
    SampleExtent,
    capacities,
    column_price,
    pack_prefix,
    prefill_share,
    price_prefix,
    shift_columns,
    slots_since,
)
from olproute.types import InstanceSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Backend = Literal["jax", "numpy"]
Rule = Literal["constant", "inverse_sqrt", "adagrad"]

__all__ = ["BATCH", "COMPUTE", "KV", "RESOURCES", "Demand", "PriceBook", "PriceState",
           "PriceView", "Samples"]

ADAGRAD_EPS = 1e-12
SCALE_EVERY = 20   # updates between refreshes of the break-even price (adagrad's scale)
ARRIVALS_KEPT = 65_536   # arrival times kept for other replicas between two drains (latest)


@dataclass(frozen=True, slots=True)
class PriceView:
    """Shadow prices as an operator reads them, one row per instance in instance order:
    prices ``p[g, k, r]`` and free capacity ``c[g, k, r]`` (copies; resources
    ``RESOURCES``), each instance's bottleneck and compute budget (prefill tokens per
    slot), and the learning's state: slot length, horizon, updates so far, N_H and the
    time of price slot 0 (None before the first update). A policy with one book per pool
    reports the state of one of them."""

    slot_s: float
    horizon_slots: int
    num_updates: int
    arrivals_in_horizon: float
    origin_s: float | None
    prices: FloatArray
    free: FloatArray
    bottleneck: tuple[str, ...]
    compute_budget: FloatArray


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand a price book gathered since it was last drained, for other replicas' books
    (``PriceBook.drain_demand``): its new samples' rows, each array of ``Samples.arrays``
    cut to those rows (K first), and its arrival times (seconds, the book's clock)."""

    rows: tuple[npt.NDArray[Any], ...]
    arrivals_s: FloatArray

    @property
    def num_samples(self) -> int:
        return int(self.rows[0].shape[0])


@dataclass(frozen=True, slots=True)
class PriceState:
    """What a book's learning leaves, for replicas that read prices rather than learn
    them (``PriceBook.state`` / ``adopt``): the handed-out prices, the steps' own prices
    and the step rule's accumulator (G, H, R), the time of price slot 0 (the book's clock;
    None before the first update), N_H, the updates and steps so far, the break-even
    price the step is scaled by."""

    p: FloatArray
    iterate: FloatArray
    acc: FloatArray
    origin_s: float | None
    arrivals_in_horizon: float
    num_updates: int
    num_steps: int
    price_scale: float


def price_view(rows: Sequence[tuple[PriceBook, int]], state: PriceBook) -> PriceView:
    """The view of instances priced by several books: instance g is row ``rows[g][1]``
    of book ``rows[g][0]``; ``state`` gives the learning's state."""
    tops = {id(b): b.bottleneck() for b, _ in rows}
    return PriceView(
        slot_s=state.slot_s, horizon_slots=state.horizon, num_updates=state.num_updates,
        arrivals_in_horizon=state.arrivals_in_horizon, origin_s=state.origin_s,
        prices=np.stack([b.p[i] for b, i in rows]), free=np.stack([b.c[i] for b, i in rows]),
        bottleneck=tuple(tops[id(b)][i] for b, i in rows),
        compute_budget=np.array([b.compute_budget[i] for b, i in rows]))


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
    p0, p1 = price_prefix(p)
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


def _jax_cumsum(x: Any) -> Any:
    """Inclusive prefix sums along axis 1 of (G, H, ...) by blocked triangular matmuls:
    XLA's own cumsum on CPU costs about twice as much at H = 600."""
    import jax.numpy as jnp

    h = x.shape[1]
    block = next(b for b in (25, 24, 20, 16, 15, 12, 10, 8, 6, 5, 4, 3, 2, 1) if h % b == 0)
    nb = h // block
    tri = jnp.triu(jnp.ones((block, block), x.dtype))
    low = jnp.triu(jnp.ones((nb, nb), x.dtype), 1)
    y = jnp.moveaxis(x, 1, -1)
    lead = y.shape[:-1]
    y = y.reshape(*lead, nb, block)
    within = y @ tri
    out = within + (within[..., -1] @ low)[..., None]
    return jnp.moveaxis(out.reshape(*lead, h), -1, 1)


def _jax_demand(p: Any, arrays: tuple[Any, ...], delays: Any, idx: Any, mask: Any,
                offset: Any) -> Any:
    """(G, H, 3) capacity the mini-batch takes (``demand_numpy``), traced by JAX."""
    import jax.numpy as jnp

    reward, start, end, batch_a, kv_a, kv_b, pre_lo, pre_hi, work, earliest = arrays
    g_count, h, _ = p.shape
    kk = jnp.arange(h, dtype=p.dtype)
    # one table of prefix sums, rows (g, k): P0 batch, P0 kv, P1 kv, P0 compute, so
    # that each (sample, instance, delay) needs a few row gathers
    table = _jax_cumsum(jnp.stack([p[:, :, BATCH], p[:, :, KV], p[:, :, KV] * kk[None, :],
                                   p[:, :, COMPUTE]], axis=-1))
    table = jnp.concatenate([jnp.zeros((g_count, 1, 4), p.dtype), table], axis=1)
    table = table.reshape(g_count * (h + 1), 4)
    sh = offset[:, None, None] + delays[None, None, :]
    s = start[idx][:, :, None] + sh
    valid = s < h
    s0 = jnp.minimum(s, h)
    s1 = jnp.minimum(end[idx][:, :, None] + sh, h)
    first = jnp.maximum(s - pre_lo[idx][:, :, None], (earliest[idx] + offset)[:, None, None])
    last = s + pre_hi[idx][:, :, None]
    pe = jnp.minimum(last, h)
    ps = jnp.minimum(first, h)
    ca = prefill_share(work[idx][:, :, None], last - first)
    ba, ka, kb = (x[idx][:, :, None] for x in (batch_a, kv_a, kv_b))
    base = (jnp.arange(g_count) * (h + 1))[None, :, None]
    diff = (table.at[base + s1].get(mode="promise_in_bounds")
            - table.at[base + s0].get(mode="promise_in_bounds"))
    pre_diff = (table.at[base + pe, 3].get(mode="promise_in_bounds")
                - table.at[base + ps, 3].get(mode="promise_in_bounds"))
    cost = (ba * diff[..., 0] + (ka - kb * s0) * diff[..., 1] + kb * diff[..., 2]
            + ca * pre_diff)
    inside = jnp.clip((s1 - s0) / jnp.maximum(end[idx] - start[idx], 1)[:, :, None],
                      0.0, 1.0)
    margin = jnp.where(valid, reward[idx] * inside - cost, -jnp.inf).reshape(
        idx.shape[0], -1)
    best = jnp.argmax(margin, axis=1)
    rows = jnp.arange(idx.shape[0])
    n_l = delays.shape[0]
    bg, bl = best // n_l, best % n_l
    w = jnp.where(mask & (margin[rows, best] > 0), 1.0, 0.0).astype(p.dtype)
    b0, b1 = s0[rows, bg, bl], s1[rows, bg, bl]
    c0, c1 = ps[rows, bg, bl], pe[rows, bg, bl]
    bba, bka, bkb = (x[rows, bg, 0] for x in (ba, ka, kb))
    bca = ca[rows, bg, bl]
    const = bka - bkb * b0

    def interval(lo: Any, hi: Any, v: Any) -> Any:
        z = jnp.zeros((g_count, h + 1), p.dtype)
        return z.at[bg, lo].add(w * v).at[bg, hi].add(-w * v)[:, :h]

    sums = _jax_cumsum(jnp.stack([interval(b0, b1, bba), interval(b0, b1, const),
                                  interval(b0, b1, bkb), interval(c0, c1, bca)], axis=-1))
    return jnp.stack([sums[..., 0], sums[..., 1] + kk[None, :] * sums[..., 2],
                      sums[..., 3]], axis=-1)


@functools.cache
def _build_jax_steps(rule: str = "constant") -> Callable[..., Any]:
    """The jitted K-step update for a step rule; imported and compiled only where prices
    are learned. One per process and rule: every price book shares it, so JAX compiles
    each shape once (a new closure per book recompiled the same program, about 0.6 s of
    CPU each)."""
    import jax
    import jax.numpy as jnp

    def steps(p: Any, acc: Any, c: Any, arrays: tuple[Any, ...], delays: Any, idx: Any,
              mask: Any, offset: Any, n_h: Any, etas: Any, decay: Any) -> Any:
        """K steps; idx, mask, offset are (K, S), etas (K,); returns (p, accumulator)."""
        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            p_in, acc_in = carry
            i, m, o, eta = xs
            n_valid = jnp.maximum(jnp.sum(m), 1)
            grad = c - (n_h / n_valid) * _jax_demand(p_in, arrays, delays, i, m, o)
            if rule == "adagrad":
                acc_out = decay * acc_in + grad * grad
                step = eta * grad / (jnp.sqrt(acc_out) + ADAGRAD_EPS)
            else:
                acc_out = acc_in
                step = eta * grad
            return (jnp.maximum(p_in - step, 0.0), acc_out), None

        out, _ = jax.lax.scan(body, (p, acc), (idx, mask, offset, etas))
        return out

    return jax.jit(steps)


class PriceBook:
    """Owns the prices, the free capacity, the rolling window of recent requests and the
    arrival-rate estimate; hands out prices (``price``) on the request path and learns
    them (``update``) off it. Times in seconds; prices per capacity fraction per slot.
    ``compute_budget`` (G,) is each instance's prefill tokens per slot (what its compute
    row's fractions are of), reported in the view."""

    def __init__(self, specs: Sequence[InstanceSpec], slot_s: float, horizon: int,
                 cfg: PriceConfig, rng: np.random.Generator, backend: Backend = "jax",
                 compute_budget: FloatArray | None = None) -> None:
        self.num_instances = len(specs)
        self.slot_s = slot_s
        self.horizon = horizon
        self.cfg = cfg
        self._rng = rng
        self._backend = backend
        g, w = self.num_instances, cfg.window
        self.compute_budget = (np.full(g, np.inf) if compute_budget is None
                               else np.asarray(compute_budget, dtype=np.float64).copy())
        self.p = np.zeros((g, horizon, NUM_RESOURCES))         # handed out: the average
        self._iterate = np.zeros((g, horizon, NUM_RESOURCES))  # the steps' own prices
        self.c = np.ones((g, horizon, NUM_RESOURCES))
        self._acc = np.zeros((g, horizon, NUM_RESOURCES))
        self.set_prefix()
        self.samples = Samples.empty(w, g, cfg.sample_delays_slots)
        batch_cap, _ = capacities(specs)
        self.samples.batch_a[:] = 1.0 / batch_cap
        self.num_samples = 0
        self._next = 0
        self.num_steps = 0
        self.num_updates = 0
        self.last_price_scale = 0.0
        self._scale_samples = 0
        self._origin_s: float | None = None   # time of price slot 0
        self._decayed_arrivals = 0.0
        self._first_arrival_s: float | None = None
        self._last_arrival_s: float | None = None
        self._n_h = 0.0
        self._schedule: tuple[float, FloatArray] | None = None
        # several router replicas (olproute.server.shared): a follower's book gathers
        # and shares demand but reads its prices from the leader's (``leading`` False:
        # ``update`` learns nothing); the demand kept for ``drain_demand`` when shared
        self.leading = True
        self._outbox: list[tuple[npt.NDArray[Any], ...]] | None = None
        self._outbox_arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)

    @property
    def delays(self) -> IntArray:
        """The delays (slots) each sample's reward is given for, the first 0."""
        return self.samples.delays

    # -- request path ----------------------------------------------------------------
    def price(self, cols: Columns, now_s: float) -> FloatArray:
        """a_jg . p_g for every instance, O(1) each: the columns (slots from now) moved by
        the slots elapsed since the book's slot 0 (its last update), cut at the horizon."""
        shift = 0 if self._origin_s is None else slots_since(now_s, self._origin_s,
                                                             self.slot_s)
        return column_price(shift_columns(cols, shift, self.horizon), self._p0, self._p1)

    def prefix(self, now_s: float) -> tuple[FloatArray, int]:
        """What the compiled decision kernel prices from: the prices' prefix sums packed
        (``reward.pack_prefix``) and the slots elapsed from their slot 0 to now."""
        shift = 0 if self._origin_s is None else slots_since(now_s, self._origin_s,
                                                             self.slot_s)
        return self._packed, shift

    def set_prefix(self) -> None:
        """The prefix sums of ``p`` that ``price`` and ``prefix`` read, after a change of
        ``p`` (each update does this itself)."""
        p0, p1 = price_prefix(self.p)
        self._p0, self._p1, self._packed = p0, p1, pack_prefix(p0, p1)

    def observe_arrival(self, now_s: float) -> None:
        """Count an arrival for the rate estimate behind N_H (exponential decay)."""
        self._count_arrival(now_s)
        if self._outbox is not None:
            self._outbox_arrivals.append(now_s)

    def _count_arrival(self, t_s: float) -> None:
        """One arrival at ``t_s`` in the decayed count; one earlier than the last counted
        (another replica's, learned late) counts decayed by its age then."""
        if self._first_arrival_s is None or t_s < self._first_arrival_s:
            self._first_arrival_s = t_s
        last = self._last_arrival_s
        if last is None or t_s >= last:
            self._decayed_arrivals = self._decayed_at(t_s) + 1.0
            self._last_arrival_s = t_s
        else:
            self._decayed_arrivals += math.exp(-(last - t_s) * math.log(2)
                                               / self.cfg.arrival_rate_halflife_s)

    def _decayed_at(self, now_s: float) -> float:
        """The decayed arrival count as of ``now_s`` (no decay for out-of-order times)."""
        if self._last_arrival_s is None:
            return 0.0
        gap = max(now_s - self._last_arrival_s, 0.0)
        return self._decayed_arrivals * math.exp(-gap * math.log(2)
                                                 / self.cfg.arrival_rate_halflife_s)

    def arrival_rate_per_s(self, now_s: float) -> float:
        """Arrivals per second as of ``now_s``: the decayed count over the decayed length
        of time observed, ``halflife / ln 2 * (1 - 2^(-elapsed / halflife))``. Dividing by
        the time observed rather than by its limit removes the start-up bias (the bare
        decayed count needs several half-lives to reach the rate: 74% of it after 20 s
        at a 10 s half-life), and a pause in arrivals lowers the rate as it lasts. The
        time observed counts as at least half a half-life, so that the first arrivals do
        not read as a burst (the rate is then under-estimated for those first seconds)."""
        if self._first_arrival_s is None:
            return 0.0
        hl = self.cfg.arrival_rate_halflife_s
        # at least half a half-life: one arrival in the first slot is not 20 a second
        elapsed = max(now_s - self._first_arrival_s, hl / 2)
        seen = hl / math.log(2) * -math.expm1(-elapsed * math.log(2) / hl)
        return self._decayed_at(now_s) / seen

    def add_sample(self, reward: FloatArray, cols: Columns, extent: SampleExtent) -> None:
        """Remember one request's reward, (G,) for a start now or (G, L) for each of
        ``delays``, its columns (relative to its decision time) and their extent
        (``Samples.put``)."""
        self.samples.put(self._next, reward, cols, extent)
        self._kept(self._ring(1))
        self._filled(1)

    def add_samples(self, reward: FloatArray, cols: Columns, extent: SampleExtent) -> None:
        """``add_sample`` for K requests in order: rewards (K, G, L), columns and extents
        (K, G); K at most the window."""
        k = reward.shape[0]
        if k > self.cfg.window:
            raise ValueError(f"{k} samples at once; the window holds {self.cfg.window}")
        rows = self._ring(k)
        self.samples.put_many(rows, reward, cols, extent)
        self._kept(rows)
        self._filled(k)

    def _ring(self, k: int) -> IntArray:
        """The window's rows the next ``k`` samples go to (the oldest overwritten)."""
        return (self._next + np.arange(k)) % self.cfg.window

    def _filled(self, k: int) -> None:
        """``k`` samples were written at ``_ring(k)``."""
        self._next = (self._next + k) % self.cfg.window
        self.num_samples = min(self.num_samples + k, self.cfg.window)

    def _kept(self, rows: IntArray) -> None:
        """New samples in ``rows``: kept for other replicas too when demand is shared
        (at most a window's worth waits: older ones would be overwritten there too)."""
        if self._outbox is None:
            return
        self._outbox.append(self.samples.take_rows(rows))
        while sum(len(r[0]) for r in self._outbox) - len(self._outbox[0][0]) >= \
                self.cfg.window:
            self._outbox.pop(0)

    # -- several replicas ----------------------------------------------------------------
    def share_demand(self, on: bool = True) -> None:
        """Keep the demand gathered from now on for ``drain_demand`` (or stop)."""
        self._outbox = [] if on else None
        self._outbox_arrivals.clear()

    def drain_demand(self) -> Demand | None:
        """The samples and arrivals gathered since the last call (at most a window of
        samples and ``ARRIVALS_KEPT`` arrivals, the latest; None when there are none, or
        demand is not shared)."""
        if self._outbox is None or not (self._outbox or self._outbox_arrivals):
            return None
        if self._outbox:
            rows = tuple(np.concatenate(parts)[-self.cfg.window:]
                         for parts in zip(*self._outbox, strict=True))
        else:
            rows = tuple(a[:0].copy() for a in self.samples.arrays)
        demand = Demand(rows, np.array(self._outbox_arrivals, dtype=np.float64))
        self._outbox = []
        self._outbox_arrivals.clear()
        return demand

    def add_demand(self, demand: Demand, shift_s: float = 0.0) -> None:
        """Another replica's demand into this book's window and arrival rate, its times
        moved by ``shift_s`` into this book's clock. Not shared on: it is that replica's
        to share."""
        k = min(demand.num_samples, self.cfg.window)
        if k:
            self.samples.put_rows(self._ring(k), [a[-k:] for a in demand.rows])
            self._filled(k)
        for t in np.sort(demand.arrivals_s):
            self._count_arrival(float(t) + shift_s)

    def state(self) -> PriceState:
        """Copies of what the learning leaves (``PriceState``)."""
        return PriceState(self.p.copy(), self._iterate.copy(), self._acc.copy(),
                          self._origin_s, self._n_h, self.num_updates, self.num_steps,
                          self.last_price_scale)

    def adopt(self, state: PriceState, shift_s: float = 0.0) -> None:
        """Take another book's learned prices (its times moved by ``shift_s`` into this
        book's clock): a follower prices with them, and a new leader learns on from
        them."""
        if state.p.shape != self.p.shape:
            raise ValueError(f"prices of shape {state.p.shape} for a book of {self.p.shape}")
        self.p, self._iterate, self._acc = (state.p.copy(), state.iterate.copy(),
                                            state.acc.copy())
        self._origin_s = None if state.origin_s is None else state.origin_s + shift_s
        self._n_h = state.arrivals_in_horizon
        self.num_updates, self.num_steps = state.num_updates, state.num_steps
        self.last_price_scale = state.price_scale
        self._scale_samples = self.num_samples
        self.set_prefix()

    @property
    def arrivals_in_horizon(self) -> float:
        """N_H at the last update: expected arrivals within the horizon, rate x H x Delta."""
        return self._n_h

    @property
    def origin_s(self) -> float | None:
        """The time of price slot 0 (None before the first update)."""
        return self._origin_s

    def view(self) -> PriceView:
        """This book's prices, one row per instance."""
        return price_view([(self, g) for g in range(self.num_instances)], self)

    def bottleneck(self) -> list[str]:
        """Per instance, the resource with the highest total price ('none' when free)."""
        totals = self.p.sum(axis=1)
        return ["none" if t.max() <= 0 else RESOURCES[int(np.argmax(t))] for t in totals]

    # -- off the request path ------------------------------------------------------------
    def set_free_capacity(self, c: FloatArray) -> None:
        if c.shape != self.c.shape:
            raise ValueError(f"free capacity must have shape {self.c.shape}, got {c.shape}")
        self.c = c

    def advance(self, now_s: float) -> int:
        """Roll the prices forward to now: slot 0 becomes the current slot; returns the
        slots shifted. The newly exposed tail takes each (instance, resource)'s mean price
        over the old horizon: the last slot alone is the least learned (few samples reach
        it), and repeating it over a long gap would inflate every price. The step rule's
        accumulator rolls with the prices."""
        if self._origin_s is None:
            self._origin_s = now_s
            return 0
        shift = slots_since(now_s, self._origin_s, self.slot_s)
        if shift <= 0:
            return 0
        self._origin_s += shift * self.slot_s
        for arr in (self.p, self._iterate, self._acc):
            roll_tail(arr, shift)
        self.set_prefix()
        return shift

    def _minibatches(self) -> tuple[IntArray, BoolArray, IntArray]:
        k, s = self.cfg.steps_per_period, self.cfg.minibatch
        idx = self._rng.integers(0, self.num_samples, size=(k, s))
        mask = np.ones((k, s), dtype=bool)
        if self.num_samples < s:  # fewer samples than the padded batch: use each once
            idx[:, :] = np.arange(s) % self.num_samples
            mask[:, self.num_samples:] = False
        offset = self._rng.integers(0, self.horizon, size=(k, s))
        return idx, mask, offset

    def step_scale(self) -> float:
        """eta0 in price units: adagrad multiplies it by the window's break-even price,
        refreshed every ``SCALE_EVERY`` updates (a median over the window: it moves
        slowly, and costs a quarter of an update) and whenever the window has grown by a
        quarter since (a scale from the first few requests would hold for 10 s)."""
        if self.cfg.schedule != "adagrad":
            return self.cfg.step_size
        if (self.num_updates % SCALE_EVERY == 0 or self.last_price_scale <= 0
                or self.num_samples > 1.25 * self._scale_samples):  # the window fills
            self.last_price_scale = self.samples.price_scale(self.num_samples)
            self._scale_samples = self.num_samples
        return self.cfg.step_size * self.last_price_scale

    def set_schedule(self, t0_s: float, prices: FloatArray) -> None:
        """Replay fixed prices instead of learning them: ``prices`` (G, K, R) are absolute,
        slot k starting at t0_s + k * slot_s (an oracle's, e.g. the duals of a run's
        hindsight LP); each update then reads the horizon from now, 0 past the end."""
        if prices.shape[0] != self.num_instances or prices.shape[2] != NUM_RESOURCES:
            raise ValueError(f"scheduled prices must be (G={self.num_instances}, K, "
                             f"{NUM_RESOURCES}), got {prices.shape}")
        self._schedule = (t0_s, np.asarray(prices, dtype=np.float64))

    def _replay(self, now_s: float) -> None:
        """Prices from the fixed schedule for the horizon starting at price slot 0."""
        assert self._schedule is not None
        t0_s, sched = self._schedule
        first = round(((self._origin_s or now_s) - t0_s) / self.slot_s)
        ks = first + np.arange(self.horizon)
        inside = (ks >= 0) & (ks < sched.shape[1])
        self.p = np.zeros_like(self.p)
        self.p[:, inside] = sched[:, ks[inside]]
        self._iterate = self.p.copy()
        self.num_updates += 1
        self.set_prefix()

    def update(self, now_s: float) -> None:
        """Shift to now, then K projected mini-batch steps on the window (or, with a
        fixed schedule, read its prices); nothing when not ``leading``."""
        if not self.leading:
            return
        self.advance(now_s)
        if self._schedule is not None:
            self._replay(now_s)
            return
        if self.num_samples == 0:
            return
        k = self.cfg.steps_per_period
        self._n_h = self.arrival_rate_per_s(now_s) * self.horizon * self.slot_s
        idx, mask, offset = self._minibatches()
        etas = step_sizes(self.step_scale(), self.cfg.schedule, self.num_steps, k)
        self._iterate, self._acc = run_steps(
            self._iterate, self._acc, self.c, self.samples, idx, mask, offset, self._n_h,
            etas, self.cfg.schedule, adagrad_decay(self.cfg), self._backend)
        keep = average_weight(self.cfg)
        self.p = keep * self.p + (1.0 - keep) * self._iterate
        self.num_steps += k
        self.num_updates += 1
        self.set_prefix()


def roll_tail(arr: FloatArray, shift: int) -> None:
    """Move (G, H, R) ``shift`` slots towards slot 0 in place; the tail takes the mean."""
    h = arr.shape[1]
    fill = arr.mean(axis=1, keepdims=True)
    if shift >= h:
        arr[:] = fill
    else:
        arr[:, :h - shift] = arr[:, shift:]
        arr[:, h - shift:] = fill


def average_weight(cfg: PriceConfig) -> float:
    """The weight of the last handed-out prices in their moving average with the steps'
    latest (its half-life in updates; 0 with no averaging)."""
    hl = cfg.average_halflife_updates
    return float(0.5 ** (1.0 / hl)) if hl > 0 else 0.0


def adagrad_decay(cfg: PriceConfig) -> float:
    """Per-step factor on the adagrad accumulator (its half-life in steps)."""
    return float(0.5 ** (1.0 / cfg.adagrad_halflife_steps))


def run_steps(p: FloatArray, acc: FloatArray, c: FloatArray, smp: Samples, idx: IntArray,
              mask: BoolArray, offset: IntArray, n_h: float, etas: FloatArray, rule: str,
              decay: float, backend: Backend) -> tuple[FloatArray, FloatArray]:
    """K projected steps (idx, mask, offset (K, S), etas (K,)); returns (p, accumulator)."""
    if backend == "numpy":
        for j in range(len(etas)):
            p, acc = dual_step_numpy(p, acc, c, smp, idx[j], mask[j], offset[j], n_h,
                                     float(etas[j]), rule, decay)
        return p, acc
    import jax

    steps = _build_jax_steps(rule)
    with jax.enable_x64(True):
        p_out, acc_out = steps(p, acc, c, smp.arrays, smp.delays, idx, mask, offset, n_h,
                               etas, decay)
        # writable copies: advance() shifts them in place
        return np.array(p_out, dtype=np.float64), np.array(acc_out, dtype=np.float64)
