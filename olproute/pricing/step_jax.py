"""The price step (``olproute.pricing.step_ref``, whose NumPy functions are its
reference) in JAX: K steps in one jitted call with fixed shapes (window and mini-batch
are padded), off the request path. JAX is imported inside the functions, only where
prices are learned: importing this module costs nothing more than NumPy. ``run_steps``
runs the K steps of an update on either backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from olproute.pricing.reward import BATCH, COMPUTE, KV, prefill_share
from olproute.pricing.step_ref import (
    ADAGRAD_EPS,
    BoolArray,
    FloatArray,
    IntArray,
    Samples,
    dual_step_numpy,
)

Backend = Literal["jax", "numpy"]


def _jax_cumsum(x: Any) -> Any:
    """Inclusive cumulative sums along axis 1 of (G, H, ...) by blocked triangular matmuls:
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
    # one table of cumulative sums, rows (g, k): P0 batch, P0 kv, P1 kv, P0 compute, so
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

