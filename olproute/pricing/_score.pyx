# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The arithmetic of one bid_price decision, compiled: for N requests on the instances
``idx`` of G, each instance's decode step time, the request's usage column, its reward
term by term, the column's shadow price and the Lagrangian score.

Kernels only, no policy. The plain-NumPy twin is ``olproute.pricing.reward.score_reference``,
built from the functions the price step and the LP use (``usage_columns``,
``reward_terms``, ``column_price``, ``bea.decode_step_times_s``); tests hold the two to the
same numbers. Every operation is the twin's, in the twin's order, so that the results are
the same doubles.

Instances outside ``idx`` are not looked at: their entries read as never started there
(TTFT infinite, score -inf, columns empty at the horizon, price and step time NaN).
"""

import numpy as np
cimport numpy as cnp
from libc.math cimport INFINITY, NAN, ceil, isfinite
from libc.stdint cimport int64_t, uint8_t

cnp.import_array()

# the output's rows and the weights vector, as olproute.pricing.score_fields declares them
from olproute.pricing.score_fields import (
    F_COMPUTE_A, F_EEL_SAVED, F_EEL_SLO, F_FINITE_TTFT, F_KV_A, F_KV_B, F_LAGRANGIAN, F_PRICE,
    F_QPS, F_REWARD, F_THROUGHPUT, F_TPOT, F_TTFT, F_TTFT_SAVED, F_TTFT_SLO, F_UTILITY, I_END,
    I_PRE_END, I_PRE_START, I_START, NUM_F, NUM_I, NUM_W, W_ALPHA, W_BETA, W_DELTA,
    W_EEL_THRESHOLD, W_GAMMA, W_OMEGA, W_SIGMA, W_TOKEN_NORM, W_TTFT_THRESHOLD, W_ZETA1, W_ZETA2)


cdef inline int64_t _first_slot(double ttft, double slot_s, int64_t horizon) noexcept nogil:
    """reward.first_token_slot: ceil(min(TTFT, H slot) / slot - 1e-9) clipped to [0, H]."""
    cdef double cap = horizon * slot_s
    cdef double k = ceil((ttft if ttft < cap else cap) / slot_s - 1e-9)
    if k < 0:
        return 0
    if k > horizon:
        return horizon
    return <int64_t>k


cdef inline int64_t _slots(double x, int64_t horizon) noexcept nogil:
    """max(ceil(x - 1e-9), 1) as slots, at most horizon + 1: every count of slots past the
    horizon reads the same there (ends and starts are cut at it), and NaN or a value
    past int64 must not become a negative index."""
    cdef double d = ceil(x - 1e-9)
    if not (d < horizon + 1):   # NaN too
        return horizon + 1
    return 1 if d < 1 else <int64_t>d


cdef inline int64_t _decode_slots(double decode, double tpot, double slot_s,
                                  int64_t horizon) noexcept nogil:
    """reward.decode_slots: max(ceil(o tpot / slot - 1e-9), 1) (``_slots``)."""
    return _slots(decode * tpot / slot_s, horizon)


cdef class Scorer:
    """The kernel with one policy's per-instance constants bound once (``beta`` (G, 4);
    ``batch_cap``, ``kv_cap``, ``budget`` (G,); the weights ``w`` by ``W_*``, a TTFT
    threshold NaN: each request's target): a decision passes only what changes. ``beta``
    is read where it lies, so a recalibration written into that array in place is seen at
    the next call."""

    cdef const double[:, ::1] beta
    cdef const double[::1] batch_cap
    cdef const double[::1] kv_cap
    cdef const double[::1] budget
    cdef const double[::1] w
    cdef double slot_s
    cdef int64_t horizon

    def __init__(self, const double[:, ::1] beta, const double[::1] batch_cap,
                 const double[::1] kv_cap, const double[::1] budget, const double[::1] w,
                 double slot_s, int64_t horizon):
        cdef Py_ssize_t G = beta.shape[0]
        _check_instances(beta, batch_cap, kv_cap, budget, w, G)
        self.beta, self.w = beta, w
        self.batch_cap, self.kv_cap, self.budget = batch_cap, kv_cap, budget
        self.slot_s, self.horizon = slot_s, horizon

    def score(self, const double[:, ::1] loads, const int64_t[::1] idx,
              const double[::1] prompt, const double[:, :] decode,
              const double[:, :] utility, const double[:, :] ttft,
              const double[::1] waited, const double[::1] target,
              const double[:, :, ::1] pp, int64_t shift, const double[:, :] cached=None):
        """N requests on the d instances ``idx`` of the G: ``prompt``, ``waited`` and
        ``target`` (N,); ``decode``, ``utility`` (weight omega not applied) and ``ttft``
        (N, d) in the order of ``idx``; ``loads`` (d, 2), each instance's residents
        counted and their contexts' sum as ``bea.decode_step_times_s`` counts them
        (``replay_ttft_many`` writes them in its pass); the price prefix sums packed
        (``reward.pack_prefix``: P0 of the three rows, P1 of KV), (G, H + 1, 4), whose slot
        0 is ``shift`` slots before now; ``cached`` (N, d), optional: each request's
        prompt tokens cached on each instance (its prefix-cache hit), which its prefill
        work (compute column) and its KV column leave out: the cache holds those blocks
        whether or not the request goes there. Returns (F (16, N, G) float64 by ``F_*``,
        I (4, N, G) int64 by ``I_*``, on_time (N, G) bool), the rows as
        ``score_fields`` declares them."""
        cdef Py_ssize_t G = self.beta.shape[0]
        _check_idx(idx, G)
        if loads.shape[0] != idx.shape[0] or loads.shape[1] != 2:
            raise ValueError("loads needs shape (len(idx), 2)")
        if cached is not None and (cached.shape[0] != prompt.shape[0]
                                   or cached.shape[1] != idx.shape[0]):
            raise ValueError("cached needs shape (N, len(idx))")
        return _score(prompt, decode, utility, ttft, loads[:, 0], loads[:, 1], self.beta,
                      waited, target, self.batch_cap, self.kv_cap, self.budget,
                      self.slot_s, self.horizon, self.w, pp, shift, idx, G, cached)


cdef void _check_instances(const double[:, ::1] beta, const double[::1] batch_cap,
                           const double[::1] kv_cap, const double[::1] budget,
                           const double[::1] w, Py_ssize_t G) except *:
    if beta.shape[0] != G or beta.shape[1] != 4 or batch_cap.shape[0] != G \
            or kv_cap.shape[0] != G or budget.shape[0] != G:
        raise ValueError("beta, batch_cap, kv_cap and budget need one row per instance")
    if w.shape[0] != NUM_W:
        raise ValueError(f"w needs {NUM_W} weights")


cdef void _check_idx(const int64_t[::1] idx, Py_ssize_t G) except *:
    cdef Py_ssize_t k
    for k in range(idx.shape[0]):
        if idx[k] < 0 or idx[k] >= G:
            raise ValueError("idx out of range")


cdef tuple _score(const double[::1] prompt, const double[:, :] decode,
                  const double[:, :] utility, const double[:, :] ttft,
                  const double[:] num_resident, const double[:] resident_context,
                  const double[:, ::1] beta, const double[::1] waited,
                  const double[::1] target, const double[::1] batch_cap,
                  const double[::1] kv_cap, const double[::1] budget, double slot_s,
                  int64_t horizon, const double[::1] w, const double[:, :, ::1] pp,
                  int64_t shift, const int64_t[::1] idx, Py_ssize_t num_instances,
                  const double[:, :] cached):
    cdef Py_ssize_t N = prompt.shape[0]
    cdef Py_ssize_t d = idx.shape[0]
    cdef Py_ssize_t G = num_instances
    if decode.shape[0] != N or decode.shape[1] != d or utility.shape[0] != N \
            or utility.shape[1] != d or ttft.shape[0] != N or ttft.shape[1] != d:
        raise ValueError("decode, utility and ttft need shape (N, len(idx))")
    if waited.shape[0] != N or target.shape[0] != N:
        raise ValueError("waited and target need one entry per request")
    if num_resident.shape[0] != d or resident_context.shape[0] != d:
        raise ValueError("num_resident and resident_context need one entry per instance")
    if pp.shape[0] != G or pp.shape[1] != horizon + 1 or pp.shape[2] != 4:
        raise ValueError("pp needs shape (G, H + 1, 4)")
    if shift < 0:
        raise ValueError("shift must be >= 0")
    cdef Py_ssize_t k, j
    cdef int64_t g

    f_np = np.empty((NUM_F, N, G), dtype=np.float64)
    i_np = np.empty((NUM_I, N, G), dtype=np.int64)
    on_np = np.zeros((N, G), dtype=np.bool_)
    cdef double[:, :, ::1] f = f_np
    cdef int64_t[:, :, ::1] iv = i_np
    cdef uint8_t[:, ::1] on = on_np.view(np.uint8)
    cdef Py_ssize_t r
    if d < G:   # instances not looked at: never started there
        for j in range(N):
            for g in range(G):
                for r in range(NUM_F):
                    f[r, j, g] = NAN
                f[F_TTFT, j, g] = INFINITY
                f[F_REWARD, j, g] = -INFINITY
                f[F_PRICE, j, g] = 0.0   # reward - price: -inf, not NaN
                f[F_LAGRANGIAN, j, g] = -INFINITY
                f[F_FINITE_TTFT, j, g] = 1e9
                for r in range(NUM_I):
                    iv[r, j, g] = horizon
    cdef double sigma = w[W_SIGMA], alpha = w[W_ALPHA], token_norm = w[W_TOKEN_NORM]
    cdef double wbeta = w[W_BETA], gamma = w[W_GAMMA], zeta1 = w[W_ZETA1]
    cdef double eel_thr = w[W_EEL_THRESHOLD], zeta2 = w[W_ZETA2]
    cdef double ttft_thr = w[W_TTFT_THRESHOLD], omega = w[W_OMEGA], delta = w[W_DELTA]
    cdef double s, o, t, tp, tw, kv_a, kv_b, ca, work, qps, thr, eel_saved, ttft_saved
    cdef double eel_slo, ttft_slo, util, reward, decode_in_h, tokens, eel, t2, price
    cdef double fin, batch_a, fresh
    cdef bint has_cached = cached is not None
    cdef int64_t k0, end, n_slots, ps, pe, kw, dw, kept, s0, e0, ps0, pe0
    for k in range(d):
        g = idx[k]
        batch_a = 1.0 / batch_cap[g]
        for j in range(N):
            s = prompt[j]
            o = decode[j, k]
            t = ttft[j, k]
            # bea.decode_step_times_s
            tp = (beta[g, 0] + beta[g, 1] * (num_resident[k] + 1)) \
                + beta[g, 2] * (resident_context[k] + s)
            # reward.usage_columns (TTFT from now)
            k0 = _first_slot(t, slot_s, horizon)
            end = k0 + _decode_slots(o, tp, slot_s, horizon)
            if end > horizon:
                end = horizon
            # the prompt tokens it computes (and whose KV it adds): its cached prefix left out
            fresh = s - cached[j, k] if has_cached else s
            # reward.prefill_span
            work = fresh / budget[g]
            n_slots = _slots(work, horizon)
            if k0 >= horizon:
                pe = horizon
                ps = horizon
            else:
                pe = k0
                ps = k0 - n_slots
                if ps < 0:
                    ps = 0
                elif ps > horizon:
                    ps = horizon
            kept = pe - ps
            if kept < 1:
                kept = 1
            ca = work / kept
            if ca > 1.0:
                ca = 1.0
            kv_a = (fresh + 1.0) / kv_cap[g]
            kv_b = (slot_s / tp) / kv_cap[g]
            # reward.reward_terms (TTFT from the arrival)
            tw = t + waited[j]
            kw = _first_slot(tw, slot_s, horizon)
            dw = _decode_slots(o, tp, slot_s, horizon)
            decode_in_h = (horizon - kw if horizon - kw > 0 else 0) * slot_s / tp
            if o < decode_in_h:
                decode_in_h = o
            tokens = s + decode_in_h if kw < horizon else 0.0
            eel = tw + o * tp
            t2 = target[j] if ttft_thr != ttft_thr else ttft_thr   # NaN: the target
            qps = sigma
            thr = alpha * tokens / token_norm
            eel_saved = wbeta * <double>(horizon - (kw + dw) if horizon - (kw + dw) > 0 else 0)
            ttft_saved = gamma * <double>(horizon - kw if horizon - kw > 0 else 0)
            eel_slo = zeta1 * (1.0 if eel <= eel_thr else 0.0)
            ttft_slo = zeta2 * (1.0 if tw <= t2 else 0.0)
            util = omega * utility[j, k]
            reward = qps + thr + eel_saved + ttft_saved + eel_slo + ttft_slo + util
            # reward.column_price on the columns moved by the book's shift
            s0 = k0 + shift
            e0 = end + shift
            ps0 = ps + shift
            pe0 = pe + shift
            if s0 > horizon:
                s0 = horizon
            if e0 > horizon:
                e0 = horizon
            if ps0 > horizon:
                ps0 = horizon
            if pe0 > horizon:
                pe0 = horizon
            price = (batch_a * (pp[g, e0, 0] - pp[g, s0, 0])
                     + ((kv_a - kv_b * s0) * (pp[g, e0, 1] - pp[g, s0, 1])
                        + kv_b * (pp[g, e0, 3] - pp[g, s0, 3]))
                     + ca * (pp[g, pe0, 2] - pp[g, ps0, 2]))
            fin = t if isfinite(t) else 1e9
            f[F_TTFT, j, g] = t
            f[F_TPOT, j, g] = tp
            f[F_KV_A, j, g] = kv_a
            f[F_KV_B, j, g] = kv_b
            f[F_COMPUTE_A, j, g] = ca
            f[F_QPS, j, g] = qps
            f[F_THROUGHPUT, j, g] = thr
            f[F_EEL_SAVED, j, g] = eel_saved
            f[F_TTFT_SAVED, j, g] = ttft_saved
            f[F_EEL_SLO, j, g] = eel_slo
            f[F_TTFT_SLO, j, g] = ttft_slo
            f[F_UTILITY, j, g] = util
            f[F_REWARD, j, g] = reward
            f[F_PRICE, j, g] = price
            f[F_LAGRANGIAN, j, g] = reward - delta * fin - price
            f[F_FINITE_TTFT, j, g] = fin
            iv[I_START, j, g] = k0
            iv[I_END, j, g] = end
            iv[I_PRE_START, j, g] = ps
            iv[I_PRE_END, j, g] = pe
            on[j, g] = tw <= target[j]
    return f_np, i_np, on_np


def fits_column(const double[:, ::1] free, int64_t s, int64_t e, double ba, double ka,
                double kb, int64_t ps, int64_t pe, int64_t k, int64_t horizon):
    """``reward.fits_under``, compiled: does the column (start s, end e, batch ba, KV
    ka + kb (slot - start), prefill [ps, pe)) on a capacity curve ``free`` (H, 3)
    computed k slots ago keep every slot it covers at free batch and KV >= 0?"""
    if free.shape[0] < horizon or free.shape[1] != 3:
        raise ValueError("free needs shape (H, 3)")
    cdef int64_t lo, hi, ds, de, t
    lo = (s if e > s else horizon)
    if (ps if pe > ps else horizon) < lo:
        lo = ps if pe > ps else horizon
    lo = lo + k
    if lo < 0:
        lo = 0
    hi = (e if e > s else 0)
    if (pe if pe > ps else 0) > hi:
        hi = pe if pe > ps else 0
    hi = hi + k
    if hi > horizon:
        hi = horizon
    if lo >= hi:
        return True
    ds = s + k
    if ds < lo:
        ds = lo
    if ds > hi:
        ds = hi
    de = e + k
    if de > hi:
        de = hi
    if de < lo:
        de = lo
    for t in range(lo, hi):
        if t >= ds and t < de:
            # written as not (x >= 0) so that NaN does not fit, as in the twin's min()
            if not (free[t, 0] - ba >= 0.0) \
                    or not (free[t, 1] - (ka + kb * <double>(t - (s + k))) >= 0.0):
                return False
        elif not (free[t, 0] >= 0.0) or not (free[t, 1] >= 0.0):
            return False
    return True


def subtract_column(double[:, ::1] free, int64_t s, int64_t e, double ba, double ka, double kb,
                int64_t ps, int64_t pe, double ca, int64_t k, int64_t horizon):
    """``reward.take_column``, compiled: subtract the column, on a curve computed k slots
    ago, from ``free`` (H, 3) in place."""
    if free.shape[0] < horizon or free.shape[1] != 3:
        raise ValueError("free needs shape (H, 3)")
    cdef int64_t ds = s + k, de = e + k, qs = ps + k, qe = pe + k, t
    if ds < 0:
        ds = 0
    if de > horizon:
        de = horizon
    for t in range(ds, de):
        free[t, 0] -= ba
        free[t, 1] -= ka + kb * <double>(t - (s + k))
    if qs < 0:
        qs = 0
    if qe > horizon:
        qe = horizon
    for t in range(qs, qe):
        free[t, 2] -= ca
