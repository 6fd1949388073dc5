"""Shadow prices p[g, k, r] >= 0 for batch slots and KV cache (capacity fractions) per
instance g and future slot k, learned online by projected mini-batch steps on the SAA
dual (DESIGN.md section 1):

    grad = c - (N_H / |S|) * sum_{i in S} a_i(x_i(p));   p <- max(0, p - eta * grad)

``c`` is the free capacity from the current snapshots, ``x_i(p)`` sends sample i to its
best instance if its margin r_ig - a_ig . p_g is positive (else nowhere), each sample is
placed at a random start offset in the horizon (a sample of the future), and N_H is the
expected number of arrivals in the horizon. Prices start from the last prices, shifted
by the slots elapsed since (warm start).

The step never builds dense (samples x instances x slots) tensors: a column is an
interval of ones and a linear ramp, so a_ig . p_g costs O(1) from prefix sums of p, and
the chosen columns are summed through difference arrays in O(H) per instance. The JAX
version runs K steps in one jitted call with fixed shapes (window and mini-batch are
padded), off the request path; ``dual_step_numpy`` is the same step in NumPy, the
reference the tests compare it with.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from olproute.config_schema import PriceConfig
from olproute.reward import Columns, capacities, column_price, price_prefix
from olproute.types import InstanceSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Backend = Literal["jax", "numpy"]

BATCH, KV = 0, 1
RESOURCES = ("batch", "kv")


@dataclass(frozen=True, slots=True)
class PriceView:
    """Shadow prices as an operator reads them, one row per instance in instance order:
    prices ``p[g, k, r]`` and free capacity ``c[g, k, r]`` (copies; resources
    ``RESOURCES``), each instance's bottleneck, and the learning's state: slot length,
    horizon, updates so far, N_H and the time of price slot 0 (None before the first
    update). A policy with one book per pool reports the state of one of them."""

    slot_s: float
    horizon_slots: int
    num_updates: int
    arrivals_in_horizon: float
    origin_s: float | None
    prices: FloatArray
    free: FloatArray
    bottleneck: tuple[str, ...]


def price_view(rows: Sequence[tuple[PriceBook, int]], state: PriceBook) -> PriceView:
    """The view of instances priced by several books: instance g is row ``rows[g][1]``
    of book ``rows[g][0]``; ``state`` gives the learning's state."""
    tops = {id(b): b.bottleneck() for b, _ in rows}
    return PriceView(
        slot_s=state.slot_s, horizon_slots=state.horizon, num_updates=state.num_updates,
        arrivals_in_horizon=state.arrivals_in_horizon, origin_s=state.origin_s,
        prices=np.stack([b.p[i] for b, i in rows]), free=np.stack([b.c[i] for b, i in rows]),
        bottleneck=tuple(tops[id(b)][i] for b, i in rows))


def step_sizes(eta0: float, schedule: str, t0: int, k: int) -> FloatArray:
    """Step sizes of steps t0 .. t0 + k - 1: constant, or eta0 / sqrt(t + 1)."""
    t = np.arange(t0, t0 + k, dtype=np.float64)
    if schedule == "constant":
        return np.full(k, eta0)
    result: FloatArray = eta0 / np.sqrt(t + 1.0)
    return result


def dual_step_numpy(p: FloatArray, c: FloatArray, reward: FloatArray, start: IntArray,
                    end: IntArray, batch_a: FloatArray, kv_a: FloatArray, kv_b: FloatArray,
                    idx: IntArray, mask: npt.NDArray[np.bool_], offset: IntArray,
                    n_h: float, eta: float) -> FloatArray:
    """One projected step. Window arrays are (W, G); idx, mask, offset are (S,)."""
    g_count, h, _ = p.shape
    p0, p1 = price_prefix(p)
    s0 = np.clip(start[idx] + offset[:, None], 0, h)
    s1 = np.clip(end[idx] + offset[:, None], 0, h)
    cols = Columns(start=s0, end=s1, batch_a=batch_a[idx], kv_a=kv_a[idx], kv_b=kv_b[idx])
    g = np.arange(g_count)[None, :]
    cost = (cols.batch_a * (p0[g, s1, 0] - p0[g, s0, 0])
            + (cols.kv_a - cols.kv_b * s0) * (p0[g, s1, 1] - p0[g, s0, 1])
            + cols.kv_b * (p1[g, s1, 1] - p1[g, s0, 1]))
    margin = reward[idx] - cost
    best = np.argmax(margin, axis=1)
    rows = np.arange(len(idx))
    take = mask & (margin[rows, best] > 0)
    w = take.astype(np.float64)
    b0, b1 = s0[rows, best], s1[rows, best]
    ba, ka, kb = cols.batch_a[rows, best], cols.kv_a[rows, best], cols.kv_b[rows, best]
    d0 = np.zeros((g_count, h + 1, 2))
    d1 = np.zeros((g_count, h + 1))
    np.add.at(d0[:, :, 0], (best, b0), w * ba)
    np.add.at(d0[:, :, 0], (best, b1), -w * ba)
    const = ka - kb * b0
    np.add.at(d0[:, :, 1], (best, b0), w * const)
    np.add.at(d0[:, :, 1], (best, b1), -w * const)
    np.add.at(d1, (best, b0), w * kb)
    np.add.at(d1, (best, b1), -w * kb)
    k = np.arange(h, dtype=np.float64)[None, :]
    usage = np.empty((g_count, h, 2))
    usage[:, :, 0] = np.cumsum(d0[:, :h, 0], axis=1)
    usage[:, :, 1] = np.cumsum(d0[:, :h, 1], axis=1) + k * np.cumsum(d1[:, :h], axis=1)
    n_valid = max(int(mask.sum()), 1)
    grad = c - (n_h / n_valid) * usage
    result: FloatArray = np.maximum(p - eta * grad, 0.0)
    return result


@functools.cache
def _build_jax_steps() -> Callable[..., Any]:
    """The jitted K-step update; imported and compiled only where prices are learned.
    One per process: every price book shares it, so JAX compiles each shape once (a new
    closure per book recompiled the same program, about 0.6 s of CPU each)."""
    import jax
    import jax.numpy as jnp

    def cumsum(x: Any) -> Any:
        """Inclusive prefix sums along axis 1 of (G, H, ...) by blocked triangular
        matmuls: XLA's own cumsum on CPU costs about twice as much at H = 600."""
        h = x.shape[1]
        block = next(b for b in (25, 24, 20, 16, 15, 12, 10, 8, 6, 5, 4, 3, 2, 1)
                     if h % b == 0)
        nb = h // block
        tri = jnp.triu(jnp.ones((block, block), x.dtype))
        low = jnp.triu(jnp.ones((nb, nb), x.dtype), 1)
        y = jnp.moveaxis(x, 1, -1)
        lead = y.shape[:-1]
        y = y.reshape(*lead, nb, block)
        within = y @ tri
        out = within + (within[..., -1] @ low)[..., None]
        return jnp.moveaxis(out.reshape(*lead, h), -1, 1)

    def one(p: Any, c: Any, reward: Any, start: Any, end: Any, batch_a: Any, kv_a: Any,
            kv_b: Any, idx: Any, mask: Any, offset: Any, n_h: Any, eta: Any) -> Any:
        """One step on the mini-batch ``idx`` of the window arrays (W, G)."""
        g_count, h, _ = p.shape
        kk = jnp.arange(h, dtype=p.dtype)
        # one table of prefix sums, rows (g, k): P0 batch, P0 kv, P1 kv, so that each
        # (sample, instance) needs two row gathers (XLA's CPU gather pays per index)
        table = cumsum(jnp.stack([p[:, :, 0], p[:, :, 1], p[:, :, 1] * kk[None, :]], axis=-1))
        table = jnp.concatenate([jnp.zeros((g_count, 1, 3), p.dtype), table], axis=1)
        table = table.reshape(g_count * (h + 1), 3)
        s0 = jnp.clip(start[idx] + offset[:, None], 0, h)
        s1 = jnp.clip(end[idx] + offset[:, None], 0, h)
        ba, ka, kb = batch_a[idx], kv_a[idx], kv_b[idx]
        base = (jnp.arange(g_count) * (h + 1))[None, :]
        diff = (table.at[base + s1].get(mode="promise_in_bounds")
                - table.at[base + s0].get(mode="promise_in_bounds"))
        cost = ba * diff[..., 0] + (ka - kb * s0) * diff[..., 1] + kb * diff[..., 2]
        margin = reward[idx] - cost
        best = jnp.argmax(margin, axis=1)
        rows = jnp.arange(idx.shape[0])
        w = jnp.where(mask & (margin[rows, best] > 0), 1.0, 0.0).astype(p.dtype)
        b0, b1 = s0[rows, best], s1[rows, best]
        bba, bka, bkb = ba[rows, best], ka[rows, best], kb[rows, best]
        const = bka - bkb * b0
        d0b = jnp.zeros((g_count, h + 1), p.dtype).at[best, b0].add(w * bba).at[best, b1].add(
            -w * bba)
        d0k = jnp.zeros((g_count, h + 1), p.dtype).at[best, b0].add(w * const).at[
            best, b1].add(-w * const)
        d1k = jnp.zeros((g_count, h + 1), p.dtype).at[best, b0].add(w * bkb).at[
            best, b1].add(-w * bkb)
        sums = cumsum(jnp.stack([d0b[:, :h], d0k[:, :h], d1k[:, :h]], axis=-1))
        usage = jnp.stack([sums[..., 0], sums[..., 1] + kk[None, :] * sums[..., 2]], axis=-1)
        n_valid = jnp.maximum(jnp.sum(mask), 1)
        grad = c - (n_h / n_valid) * usage
        return jnp.maximum(p - eta * grad, 0.0)

    def steps(p: Any, c: Any, reward: Any, start: Any, end: Any, batch_a: Any, kv_a: Any,
              kv_b: Any, idx: Any, mask: Any, offset: Any, n_h: Any, etas: Any) -> Any:
        """K steps; idx, mask, offset are (K, S), etas (K,)."""
        def body(p_in: Any, xs: Any) -> tuple[Any, None]:
            i, m, o, eta = xs
            return one(p_in, c, reward, start, end, batch_a, kv_a, kv_b, i, m, o, n_h,
                       eta), None

        out, _ = jax.lax.scan(body, p, (idx, mask, offset, etas))
        return out

    return jax.jit(steps)


class PriceBook:
    """Owns the prices, the free capacity, the rolling window of recent requests and the
    arrival-rate estimate; hands out prices (``price``) on the request path and learns
    them (``update``) off it. Times in seconds; prices per capacity fraction per slot."""

    def __init__(self, specs: Sequence[InstanceSpec], slot_s: float, horizon: int,
                 cfg: PriceConfig, rng: np.random.Generator, backend: Backend = "jax") -> None:
        self.num_instances = len(specs)
        self.slot_s = slot_s
        self.horizon = horizon
        self.cfg = cfg
        self._rng = rng
        self._backend = backend
        g, w = self.num_instances, cfg.window
        self.p = np.zeros((g, horizon, 2))
        self.c = np.ones((g, horizon, 2))
        self._p0, self._p1 = price_prefix(self.p)
        self._reward = np.zeros((w, g))
        self._start = np.zeros((w, g), dtype=np.int64)
        self._end = np.zeros((w, g), dtype=np.int64)
        batch_cap, _ = capacities(specs)
        self._batch_a = np.tile(1.0 / batch_cap, (w, 1))
        self._kv_a = np.zeros((w, g))
        self._kv_b = np.zeros((w, g))
        self.num_samples = 0
        self._next = 0
        self.num_steps = 0
        self.num_updates = 0
        self._origin_s: float | None = None   # time of price slot 0
        self._decayed_arrivals = 0.0
        self._last_arrival_s: float | None = None
        self._jax_steps: Callable[..., Any] | None = None

    # -- request path ----------------------------------------------------------------
    def price(self, cols: Columns) -> FloatArray:
        """a_jg . p_g for every instance, O(1) each."""
        return column_price(cols, self._p0, self._p1)

    def observe_arrival(self, now_s: float) -> None:
        """Count an arrival for the rate estimate behind N_H (exponential decay)."""
        if self._last_arrival_s is not None:
            gap = max(now_s - self._last_arrival_s, 0.0)  # out-of-order times: no decay
            self._decayed_arrivals *= math.exp(-gap * math.log(2)
                                               / self.cfg.arrival_rate_halflife_s)
        self._decayed_arrivals += 1.0
        self._last_arrival_s = now_s

    def add_sample(self, reward: FloatArray, cols: Columns) -> None:
        """Remember one request's reward and columns (relative to its decision time)."""
        i = self._next
        self._reward[i] = reward
        self._start[i] = cols.start
        self._end[i] = cols.end
        self._batch_a[i] = cols.batch_a
        self._kv_a[i] = cols.kv_a
        self._kv_b[i] = cols.kv_b
        self._next = (i + 1) % self.cfg.window
        self.num_samples = min(self.num_samples + 1, self.cfg.window)

    @property
    def arrival_rate_per_s(self) -> float:
        return self._decayed_arrivals * math.log(2) / self.cfg.arrival_rate_halflife_s

    @property
    def arrivals_in_horizon(self) -> float:
        """N_H: expected arrivals within the horizon, rate x H x Delta."""
        return self.arrival_rate_per_s * self.horizon * self.slot_s

    @property
    def origin_s(self) -> float | None:
        """The time of price slot 0 (None before the first update)."""
        return self._origin_s

    def view(self) -> PriceView:
        """This book's prices, one row per instance."""
        return price_view([(self, g) for g in range(self.num_instances)], self)

    def bottleneck(self) -> list[str]:
        """Per instance, the resource with the higher total price ('none' when free)."""
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
        it), and repeating it over a long gap would inflate every price."""
        if self._origin_s is None:
            self._origin_s = now_s
            return 0
        shift = int((now_s - self._origin_s) // self.slot_s)
        if shift <= 0:
            return 0
        self._origin_s += shift * self.slot_s
        h = self.horizon
        fill = self.p.mean(axis=1, keepdims=True)
        if shift >= h:
            self.p[:] = fill
        else:
            self.p[:, :h - shift] = self.p[:, shift:]
            self.p[:, h - shift:] = fill
        self._p0, self._p1 = price_prefix(self.p)
        return shift

    def update(self, now_s: float) -> None:
        """Shift to now, then K projected mini-batch steps on the window."""
        self.advance(now_s)
        if self.num_samples == 0:
            return
        k, s = self.cfg.steps_per_period, self.cfg.minibatch
        idx = self._rng.integers(0, self.num_samples, size=(k, s))
        mask = np.ones((k, s), dtype=bool)
        if self.num_samples < s:  # fewer samples than the padded batch: use each once
            idx[:, :] = np.arange(s) % self.num_samples
            mask[:, self.num_samples:] = False
        offset = self._rng.integers(0, self.horizon, size=(k, s))
        etas = step_sizes(self.cfg.step_size, self.cfg.schedule, self.num_steps, k)
        n_h = self.arrivals_in_horizon
        if self._backend == "numpy":
            p = self.p
            for j in range(k):
                p = dual_step_numpy(p, self.c, self._reward, self._start, self._end,
                                    self._batch_a, self._kv_a, self._kv_b, idx[j], mask[j],
                                    offset[j], n_h, float(etas[j]))
            self.p = p
        else:
            self.p = self._run_jax(idx, mask, offset, n_h, etas)
        self.num_steps += k
        self.num_updates += 1
        self._p0, self._p1 = price_prefix(self.p)

    def _run_jax(self, idx: IntArray, mask: npt.NDArray[np.bool_], offset: IntArray,
                 n_h: float, etas: FloatArray) -> FloatArray:
        import jax

        if self._jax_steps is None:
            self._jax_steps = _build_jax_steps()
        with jax.enable_x64(True):
            out = self._jax_steps(self.p, self.c, self._reward, self._start, self._end,
                                  self._batch_a, self._kv_a, self._kv_b, idx, mask, offset,
                                  n_h, etas)
            return np.array(out, dtype=np.float64)  # writable: advance() shifts in place
