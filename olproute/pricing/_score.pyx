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
    threshold NaN: each request's target; ``steady`` (G,), optional: each instance's
    steady decode step, ``decode_load.DecodeLoad``, the least time per output token a
    request is held for there): a decision passes only what changes. ``beta`` and
    ``steady`` are read where they lie, so a recalibration or a tick's new steady step
    written into those arrays in place is seen at the next call."""

    cdef const double[:, ::1] beta
    cdef const double[::1] batch_cap
    cdef const double[::1] kv_cap
    cdef const double[::1] budget
    cdef const double[::1] w
    cdef const double[::1] steady
    cdef double slot_s
    cdef int64_t horizon

    def __init__(self, const double[:, ::1] beta, const double[::1] batch_cap,
                 const double[::1] kv_cap, const double[::1] budget, const double[::1] w,
                 double slot_s, int64_t horizon, const double[::1] steady=None):
        cdef Py_ssize_t G = beta.shape[0]
        _check_instances(beta, batch_cap, kv_cap, budget, w, G)
        if steady is None:
            steady = np.zeros(G)
        elif steady.shape[0] != G:
            raise ValueError("steady needs one entry per instance")
        self.beta, self.w, self.steady = beta, w, steady
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
        (``replay_ttft_many`` writes them in its pass); the prices' cumulative sums packed
        (``reward.pack_cumsums``: P0 of the three rows, P1 of KV), (G, H + 1, 4), whose slot
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
                      self.slot_s, self.horizon, self.w, pp, shift, idx, G, cached,
                      self.steady)


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


cdef struct _Column:
    # reward.usage_columns of one request on one instance, with its decode step time
    double tp, kv_a, kv_b, ca
    int64_t k0, end, ps, pe


cdef struct _Weights:
    double sigma, alpha, token_norm, wbeta, gamma, zeta1, eel_thr, zeta2, ttft_thr, omega
    double delta


cdef struct _Terms:
    # reward.reward_terms of one request on one instance, and their sum
    double qps, thr, eel_saved, ttft_saved, eel_slo, ttft_slo, util, reward


cdef inline _Column _column(double s, double o, double t, double fresh, double b0, double b1,
                            double b2, double num_resident, double resident_context,
                            double budget, double kv_cap, double slot_s,
                            int64_t horizon, double steady) noexcept nogil:
    """The request's usage column (TTFT from now) and decode step time on one instance;
    ``fresh``: the prompt tokens it computes (and whose KV it adds), its cached prefix
    left out; ``steady``: the instance's steady decode step."""
    cdef _Column c
    cdef double work
    cdef int64_t n_slots, kept
    # bea.decode_step_times_s, then decode_load.load_aware_tpot
    c.tp = (b0 + b1 * (num_resident + 1)) + b2 * (resident_context + s)
    if steady > 0.0:
        c.tp = steady
    # reward.usage_columns (TTFT from now)
    c.k0 = _first_slot(t, slot_s, horizon)
    c.end = c.k0 + _decode_slots(o, c.tp, slot_s, horizon)
    if c.end > horizon:
        c.end = horizon
    # reward.prefill_span
    work = fresh / budget
    n_slots = _slots(work, horizon)
    if c.k0 >= horizon:
        c.pe = horizon
        c.ps = horizon
    else:
        c.pe = c.k0
        c.ps = c.k0 - n_slots
        if c.ps < 0:
            c.ps = 0
        elif c.ps > horizon:
            c.ps = horizon
    kept = c.pe - c.ps
    if kept < 1:
        kept = 1
    c.ca = work / kept
    if c.ca > 1.0:
        c.ca = 1.0
    c.kv_a = (fresh + 1.0) / kv_cap
    c.kv_b = (slot_s / c.tp) / kv_cap
    return c


cdef inline _Terms _terms(double s, double o, double tw, double tp, double target,
                          double utility, const _Weights* w, double slot_s,
                          int64_t horizon) noexcept nogil:
    """reward.reward_terms (TTFT ``tw`` from the arrival) and their sum."""
    cdef _Terms r
    cdef int64_t kw = _first_slot(tw, slot_s, horizon)
    cdef int64_t dw = _decode_slots(o, tp, slot_s, horizon)
    cdef double decode_in_h = (horizon - kw if horizon - kw > 0 else 0) * slot_s / tp
    if o < decode_in_h:
        decode_in_h = o
    cdef double tokens = s + decode_in_h if kw < horizon else 0.0
    cdef double eel = tw + o * tp
    cdef double t2 = target if w.ttft_thr != w.ttft_thr else w.ttft_thr   # NaN: the target
    r.qps = w.sigma
    r.thr = w.alpha * tokens / w.token_norm
    r.eel_saved = w.wbeta * <double>(horizon - (kw + dw) if horizon - (kw + dw) > 0 else 0)
    r.ttft_saved = w.gamma * <double>(horizon - kw if horizon - kw > 0 else 0)
    r.eel_slo = w.zeta1 * (1.0 if eel <= w.eel_thr else 0.0)
    r.ttft_slo = w.zeta2 * (1.0 if tw <= t2 else 0.0)
    r.util = w.omega * utility
    r.reward = r.qps + r.thr + r.eel_saved + r.ttft_saved + r.eel_slo + r.ttft_slo + r.util
    return r


cdef inline double _price(const _Column* c, double batch_a, const double* pp, int64_t shift,
                          int64_t horizon) noexcept nogil:
    """reward.column_price of the column moved by the book's shift; ``pp``: the
    instance's packed prefix sums, (H + 1, 4) C-ordered."""
    cdef int64_t s0 = c.k0 + shift
    cdef int64_t e0 = c.end + shift
    cdef int64_t ps0 = c.ps + shift
    cdef int64_t pe0 = c.pe + shift
    if s0 > horizon:
        s0 = horizon
    if e0 > horizon:
        e0 = horizon
    if ps0 > horizon:
        ps0 = horizon
    if pe0 > horizon:
        pe0 = horizon
    return (batch_a * (pp[e0 * 4 + 0] - pp[s0 * 4 + 0])
            + ((c.kv_a - c.kv_b * s0) * (pp[e0 * 4 + 1] - pp[s0 * 4 + 1])
               + c.kv_b * (pp[e0 * 4 + 3] - pp[s0 * 4 + 3]))
            + c.ca * (pp[pe0 * 4 + 2] - pp[ps0 * 4 + 2]))


cdef void _check_shapes(Py_ssize_t N, Py_ssize_t d, Py_ssize_t G, const double[:, :] decode,
                        const double[:, :] utility, const double[:, :] ttft,
                        const double[:] num_resident, const double[:] resident_context,
                        const double[::1] waited, const double[::1] target,
                        const double[:, :, ::1] pp, int64_t horizon, int64_t shift) except *:
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


cdef void _never_started(double[:, :, ::1] f, int64_t[:, :, ::1] iv, Py_ssize_t N,
                         Py_ssize_t G, int64_t horizon) except *:
    """Every entry as an instance not looked at reads: never started there."""
    cdef Py_ssize_t j, r
    cdef int64_t g
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


cdef _Weights _weights(const double[::1] w) except *:
    """The weights vector's entries (``score_fields.W_*``) by name."""
    cdef _Weights out
    out.sigma, out.alpha, out.token_norm = w[W_SIGMA], w[W_ALPHA], w[W_TOKEN_NORM]
    out.wbeta, out.gamma, out.zeta1 = w[W_BETA], w[W_GAMMA], w[W_ZETA1]
    out.eel_thr, out.zeta2 = w[W_EEL_THRESHOLD], w[W_ZETA2]
    out.ttft_thr, out.omega, out.delta = w[W_TTFT_THRESHOLD], w[W_OMEGA], w[W_DELTA]
    return out


cdef tuple _score(const double[::1] prompt, const double[:, :] decode,
                  const double[:, :] utility, const double[:, :] ttft,
                  const double[:] num_resident, const double[:] resident_context,
                  const double[:, ::1] beta, const double[::1] waited,
                  const double[::1] target, const double[::1] batch_cap,
                  const double[::1] kv_cap, const double[::1] budget, double slot_s,
                  int64_t horizon, const double[::1] w, const double[:, :, ::1] pp,
                  int64_t shift, const int64_t[::1] idx, Py_ssize_t num_instances,
                  const double[:, :] cached, const double[::1] steady):
    cdef Py_ssize_t N = prompt.shape[0]
    cdef Py_ssize_t d = idx.shape[0]
    cdef Py_ssize_t G = num_instances
    _check_shapes(N, d, G, decode, utility, ttft, num_resident, resident_context, waited,
                  target, pp, horizon, shift)
    cdef Py_ssize_t k, j
    cdef int64_t g
    f_np = np.empty((NUM_F, N, G), dtype=np.float64)
    i_np = np.empty((NUM_I, N, G), dtype=np.int64)
    on_np = np.zeros((N, G), dtype=np.bool_)
    cdef double[:, :, ::1] f = f_np
    cdef int64_t[:, :, ::1] iv = i_np
    cdef uint8_t[:, ::1] on = on_np.view(np.uint8)
    if d < G:   # instances not looked at: never started there
        _never_started(f, iv, N, G, horizon)
    cdef _Weights wt = _weights(w)
    cdef double s, t, tw, price, fin, batch_a, fresh
    cdef bint has_cached = cached is not None
    cdef _Column c
    cdef _Terms r
    for k in range(d):
        g = idx[k]
        batch_a = 1.0 / batch_cap[g]
        for j in range(N):
            s = prompt[j]
            t = ttft[j, k]
            # the prompt tokens it computes (and whose KV it adds): its cached prefix left out
            fresh = s - cached[j, k] if has_cached else s
            c = _column(s, decode[j, k], t, fresh, beta[g, 0], beta[g, 1], beta[g, 2],
                        num_resident[k], resident_context[k], budget[g], kv_cap[g], slot_s,
                        horizon, steady[g])
            # reward.reward_terms (TTFT from the arrival)
            tw = t + waited[j]
            r = _terms(s, decode[j, k], tw, c.tp, target[j], utility[j, k], &wt, slot_s,
                       horizon)
            price = _price(&c, batch_a, &pp[g, 0, 0], shift, horizon)
            fin = t if isfinite(t) else 1e9
            f[F_TTFT, j, g] = t
            f[F_TPOT, j, g] = c.tp
            f[F_KV_A, j, g] = c.kv_a
            f[F_KV_B, j, g] = c.kv_b
            f[F_COMPUTE_A, j, g] = c.ca
            f[F_QPS, j, g] = r.qps
            f[F_THROUGHPUT, j, g] = r.thr
            f[F_EEL_SAVED, j, g] = r.eel_saved
            f[F_TTFT_SAVED, j, g] = r.ttft_saved
            f[F_EEL_SLO, j, g] = r.eel_slo
            f[F_TTFT_SLO, j, g] = r.ttft_slo
            f[F_UTILITY, j, g] = r.util
            f[F_REWARD, j, g] = r.reward
            f[F_PRICE, j, g] = price
            f[F_LAGRANGIAN, j, g] = r.reward - wt.delta * fin - price
            f[F_FINITE_TTFT, j, g] = fin
            iv[I_START, j, g] = c.k0
            iv[I_END, j, g] = c.end
            iv[I_PRE_START, j, g] = c.ps
            iv[I_PRE_END, j, g] = c.pe
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
