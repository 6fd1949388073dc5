"""The exact LP of a window (``solvers.problem``) in HiGHS: one sparse matrix, one
``passModel`` call, and the primal, the prices, the status and the timings back.

    max  sum r_jgk x_jgk
    s.t. sum_{g,k} x_jgk <= 1                                   (request rows, duals y_j)
         sum_j a_jgk[l, r] x_jgk <= c[g, l, r]  for every (g, slot l, resource r)
                                                                 (capacity, duals p[g, l, r])
         x >= 0

HiGHS minimises -r.x; its duals are flipped once, in ``_duals``, into the prices of the
maximisation above (p, y >= 0).

**Structure used** (each choice and what it does to the answer):

- *Difference form* (``form="difference"``, default). A usage column is an interval of
  ones (batch), a linear ramp (KV) and a second, shorter interval (compute, the prefill
  slots): the first difference of an interval has 2 nonzeros and the second difference
  of the ramp 4. With load variables u (batch), v (KV), z (compute) and slope w (KV)
  per (g, slot) and the equalities u_l - u_{l-1} = sum dA x, z_l - z_{l-1} = sum dC x,
  w_l - w_{l-1} = sum d2A x, v_l - v_{l-1} = w_l, the capacity rows become the bounds
  u <= c_batch, v <= c_kv, z <= c_compute: 9 nonzeros per column instead of
  2 D + P + 1 (D ~ 100 slots). The LP is the same (x-feasible sets equal), so LP* and x
  are unchanged; the capacity prices are the reduced costs of u, v and z, exactly the
  duals of the dense rows.
- *Column generation* (``strategy="colgen"``). Most requests start at their earliest
  slot in an optimum; the master LP starts with that column per (request, instance),
  then adds the columns of positive reduced cost r - a.p - y_j (priced for all delays
  in O(1) each from cumulative sums of p) and re-solves with dual simplex warm-started
  from the last basis. It stops when no column prices out (the full LP's optimum, to
  ``tol``) or when the duality gap D(p) - master <= ``gap_tol`` x master: every
  iteration's D(p) is an upper bound on LP* (weak duality), so the answer always
  comes with a valid bound, exact at gap_tol = 0.
- *Interior point without crossover* (``method="ipm"``, ``crossover=False``): duals and
  bounds without a vertex; the objective is within HiGHS's IPM tolerance (1e-8
  relative) of LP* and D(p) of its duals still bounds LP* from above.
- *Coarser grid* (``coarsen=c > 1``): capacity rows of c consecutive slots are summed
  (capacity summed too), in difference form as well (a column's block sums are
  constant (batch, compute) or linear (KV) on the blocks it covers whole, so its
  differences stay a few nonzeros around its first and last block). That is a
  relaxation: LP_c* >= LP*, a valid upper bound on the hindsight optimum with c times
  fewer rows and chain links; its prices, copied to every slot of their block, are a
  valid p with D(p) = LP_c*. It costs bound tightness, not validity; start slots stay
  on the fine grid.
- *Presolve* is left on for one-shot solves (it removes nothing much here) and off in
  column generation (the master is re-solved with its basis).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from scipy import sparse

from olproute.pricing.reward import BATCH, COMPUTE, KV, NUM_RESOURCES
from solvers.problem import FlatColumns, LpProblem, column_block, flatten, prefill_interval

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

Method = Literal["auto", "simplex", "ipm"]
Strategy = Literal["auto", "full", "colgen"]
Form = Literal["difference", "dense"]

# "auto" picks interior point above this many nonzeros for a one-shot solve
IPM_ABOVE_NNZ = 300_000
# column generation prices requests in chunks of this many (memory: chunk x G x L)
PRICE_CHUNK = 1024
# difference form: row blocks of G x K after the request rows (batch chain, KV slope
# chain, KV level chain, compute chain), and the load column of each
CHAIN_ROWS = 4
U_COL, W_COL, V_COL, Z_COL = 0, 1, 2, 3


def all_columns(prob: LpProblem) -> FlatColumns:
    """Every column of the LP (every request, instance and delay inside the grid)."""
    parts = [flatten(column_block(prob, np.arange(i, min(i + PRICE_CHUNK, prob.num_requests))))
             for i in range(0, prob.num_requests, PRICE_CHUNK)]
    return FlatColumns.concat(parts) if parts else flatten(column_block(prob, np.arange(0)))


def earliest_columns(prob: LpProblem) -> FlatColumns:
    """The delay-0 column of every (request, instance): the start of column generation."""
    zero = np.zeros(1, dtype=np.int64)
    return flatten(column_block(prob, np.arange(prob.num_requests), zero), delays=zero)


# -- the matrix ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Layout:
    """Row and column blocks of a built model."""

    form: Form
    num_requests: int
    num_instances: int
    num_slots: int          # slots of the capacity rows (K, or ceil(K / coarsen))
    coarsen: int
    num_x: int              # x columns first, then (difference form) u, w, v, z per (g, l)
    slope_scale: float = 1.0  # the KV slope rows are multiplied by this (difference form)

    @property
    def cap_rows(self) -> int:
        return self.num_instances * self.num_slots

    def row_scale(self) -> FloatArray:
        """Per row: 1, except the KV slope rows (``slope_scale``)."""
        gk = self.cap_rows
        out = np.ones(self.num_requests + CHAIN_ROWS * gk)
        out[self.num_requests + gk:self.num_requests + 2 * gk] = self.slope_scale
        return out


def slope_scale(prob: LpProblem) -> float:
    """Scale of the KV slope rows: their entries are KV fractions of one request (about
    (s + 1) / M, 1e-2 .. 1e-3) next to the +-1 of the chain. Without scaling them to
    about 1, interior point stalls at (10000, 8, 1000) ("no progress"); row scaling of
    an equality row with right-hand side 0 changes neither x nor the capacity prices
    (reduced costs of u and v)."""
    return float(np.clip(1.0 / max(float(np.mean(prob.kv_a)), 1e-12), 1.0, 1e4))


def _x_entries_difference(prob: LpProblem, cols: FlatColumns, layout: Layout
                          ) -> tuple[IntArray, IntArray, FloatArray]:
    """(row, column, value) of the x columns in difference form; duplicates are summed
    later (a one-slot column has two entries on row s + 1)."""
    if layout.coarsen > 1:
        return _x_entries_difference_coarse(prob, cols, layout)
    n, k = prob.num_requests, prob.num_slots
    gk = prob.num_instances * k
    j, g, s, e = cols.request, cols.instance, cols.start, cols.end
    ps, pe, ca = prefill_interval(prob, j, g, s)
    idx = np.arange(len(cols), dtype=np.int64)
    ba = prob.batch_a[g]
    a = prob.kv_a[j, g]
    b = prob.kv_b[j, g]
    base_b = n + g * k            # batch rows:   u_l - u_{l-1} - sum dA x = 0
    base_s = n + gk + g * k       # KV slope rows: w_l - w_{l-1} - sum d2A x = 0
    base_c = n + 3 * gk + g * k   # compute rows: z_l - z_{l-1} - sum dC x = 0
    parts: list[tuple[IntArray, IntArray, FloatArray]] = [
        (j, idx, np.ones(len(cols))),
        (base_b + s, idx, -ba),
        (base_s + s, idx, -a),
        (base_c + ps, idx, -ca),
    ]
    for rows, vals, keep in (
            (base_b + e, ba, e < k),
            (base_s + s + 1, a - b, s + 1 < k),
            (base_s + e, a + b * (e - s), e < k),
            (base_s + e + 1, -(a + b * (e - 1 - s)), e + 1 < k),
            (base_c + pe, ca, pe < k)):
        parts.append((rows[keep], idx[keep], vals[keep]))
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]))


def _block_sums(alpha: FloatArray, beta: FloatArray, s: IntArray, e: IntArray,
                blocks: IntArray, c: int) -> FloatArray:
    """F_B = sum over slots k of block B (slots Bc .. Bc + c - 1) of alpha + beta (k - s)
    on [s, e), for candidate blocks (m, t); 0 for B < 0."""
    def upto(k: IntArray) -> FloatArray:
        m = np.clip(k - s[:, None], 0, (e - s)[:, None]).astype(np.float64)
        result: FloatArray = alpha[:, None] * m + beta[:, None] * m * (m - 1) / 2.0
        return result

    lo = np.maximum(blocks, 0) * c
    result: FloatArray = np.where(blocks >= 0, upto(lo + c) - upto(lo), 0.0)
    return result


def _x_entries_difference_coarse(prob: LpProblem, cols: FlatColumns, layout: Layout
                                 ) -> tuple[IntArray, IntArray, FloatArray]:
    """The difference form on blocks of c slots. A column's block sums F_B are constant
    (batch, compute) or linear (KV) on the blocks it covers whole, so its first (batch,
    compute) and second (KV) differences are nonzero only on the blocks around its first
    and last block: evaluated there from closed-form cumulative sums, each block once."""
    n, c, kc = prob.num_requests, layout.coarsen, layout.num_slots
    gk = prob.num_instances * kc
    j, g, s, e = cols.request, cols.instance, cols.start, cols.end
    ps, pe, ca = prefill_interval(prob, j, g, s)
    idx = np.arange(len(cols), dtype=np.int64)
    flat = np.zeros(len(cols))
    parts_r, parts_c, parts_v = [j], [idx], [np.ones(len(cols))]
    for order, base, alpha, beta, lo, hi in (
            (1, n + g * kc, prob.batch_a[g], flat, s, e),
            (2, n + gk + g * kc, prob.kv_a[j, g], prob.kv_b[j, g], s, e),
            (1, n + 3 * gk + g * kc, ca, flat, ps, pe)):
        offsets = np.arange(order + 1)[None, :]
        cand = np.concatenate([(lo // c)[:, None] + offsets, ((hi - 1) // c)[:, None] + offsets],
                              axis=1)
        f0 = _block_sums(alpha, beta, lo, hi, cand, c)
        f1 = _block_sums(alpha, beta, lo, hi, cand - 1, c)
        val = (f0 - f1 if order == 1
               else f0 - 2.0 * f1 + _block_sums(alpha, beta, lo, hi, cand - 2, c))
        dup = np.zeros(cand.shape, dtype=bool)
        for t in range(1, cand.shape[1]):
            dup[:, t] = (cand[:, :t] == cand[:, t:t + 1]).any(axis=1)
        scale = (np.abs(alpha) + np.abs(beta) * c) * c
        keep = ~dup & (cand < kc) & (np.abs(val) > 1e-12 * scale[:, None])
        rows = np.broadcast_to(base[:, None], cand.shape) + cand
        parts_r.append(rows[keep])
        parts_c.append(np.broadcast_to(idx[:, None], cand.shape)[keep])
        parts_v.append(-val[keep])   # x moves to the left-hand side of the chain rows
    return np.concatenate(parts_r), np.concatenate(parts_c), np.concatenate(parts_v)


def _expand(start: IntArray, end: IntArray) -> tuple[IntArray, IntArray]:
    """(column index, offset from start) of every slot of the intervals [start, end)."""
    length = end - start
    idx = np.repeat(np.arange(len(start), dtype=np.int64), length)
    offset = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(length) - length, length)
    return idx, offset


def _x_entries_dense(prob: LpProblem, cols: FlatColumns, coarsen: int,
                     num_slots: int) -> tuple[IntArray, IntArray, FloatArray]:
    """(row, column, value) of the x columns on the capacity rows themselves, slots
    summed in blocks of ``coarsen``; duplicates are summed later."""
    n = prob.num_requests
    j, g = cols.request, cols.instance

    def rows(idx: IntArray, slot: IntArray, r: int) -> IntArray:
        result: IntArray = n + NUM_RESOURCES * (g[idx] * num_slots + slot // coarsen) + r
        return result

    idx, offset = _expand(cols.start, cols.end)
    kv = prob.kv_a[j, g][idx] + prob.kv_b[j, g][idx] * offset
    slot = cols.start[idx] + offset
    ps, pe, ca = prefill_interval(prob, j, g, cols.start)
    pidx, poff = _expand(ps, pe)
    return (np.concatenate([j, rows(idx, slot, BATCH), rows(idx, slot, KV),
                            rows(pidx, ps[pidx] + poff, COMPUTE)]),
            np.concatenate([np.arange(len(cols), dtype=np.int64), idx, idx, pidx]),
            np.concatenate([np.ones(len(cols)), prob.batch_a[g][idx], kv,
                            ca[pidx]]))


def x_matrix(prob: LpProblem, cols: FlatColumns, layout: Layout) -> sparse.csc_matrix:
    """The x columns as a CSC matrix with the model's rows."""
    if layout.form == "difference":
        r, c, v = _x_entries_difference(prob, cols, layout)
        num_rows = prob.num_requests + CHAIN_ROWS * layout.cap_rows
        v = v * layout.row_scale()[r]
    else:
        r, c, v = _x_entries_dense(prob, cols, layout.coarsen, layout.num_slots)
        num_rows = prob.num_requests + NUM_RESOURCES * layout.cap_rows
    return sparse.csc_matrix((v, (r, c)), shape=(num_rows, len(cols)))


def _aux_matrix(prob: LpProblem, k: int) -> sparse.csc_matrix:
    """Columns u, w, v, z per (g, l) of the difference form on k (block) slots (see the
    module docstring)."""
    n, g = prob.num_requests, prob.num_instances
    gk = g * k
    cell = np.arange(gk, dtype=np.int64)
    nxt = (cell % k) < k - 1            # slot l + 1 exists on the same instance
    rows_b, rows_s, rows_l, rows_c = (n + i * gk + cell for i in range(CHAIN_ROWS))
    cu, cw, cv, cz = (i * gk + cell for i in (U_COL, W_COL, V_COL, Z_COL))
    r = np.concatenate([rows_b, rows_b[nxt] + 1,             # u: +1 at l, -1 at l + 1
                        rows_s, rows_s[nxt] + 1, rows_l,      # w: slope rows, level row
                        rows_l, rows_l[nxt] + 1,              # v: +1 at l, -1 at l + 1
                        rows_c, rows_c[nxt] + 1])             # z: +1 at l, -1 at l + 1
    c = np.concatenate([cu, cu[nxt], cw, cw[nxt], cw, cv, cv[nxt], cz, cz[nxt]])
    one = np.ones(gk)
    v = np.concatenate([one, -one[nxt], one, -one[nxt], -one, one, -one[nxt], one,
                        -one[nxt]])
    return sparse.csc_matrix((v, (r, c)), shape=(n + CHAIN_ROWS * gk, CHAIN_ROWS * gk))


def coarse_capacity(prob: LpProblem, coarsen: int) -> FloatArray:
    """Capacity summed over blocks of ``coarsen`` slots (G, ceil(K / c), 3); the last
    block sums the slots that exist."""
    g, k = prob.num_instances, prob.num_slots
    if coarsen == 1:
        return prob.capacity
    kc = -(-k // coarsen)
    pad = np.zeros((g, kc * coarsen, NUM_RESOURCES))
    pad[:, :k] = prob.capacity
    result: FloatArray = pad.reshape(g, kc, coarsen, NUM_RESOURCES).sum(axis=2)
    return result


@dataclass
class Model:
    """A built LP: the HiGHS arrays (minimise cost.x), its layout and its x columns."""

    layout: Layout
    cols: FlatColumns
    matrix: sparse.csc_matrix
    cost: FloatArray
    col_lower: FloatArray
    col_upper: FloatArray
    row_lower: FloatArray
    row_upper: FloatArray
    build_s: float = 0.0

    @property
    def nnz(self) -> int:
        return int(self.matrix.nnz)


def build(prob: LpProblem, cols: FlatColumns | None = None, form: Form = "difference",
          coarsen: int = 1) -> Model:
    """The LP on the columns ``cols`` (default: all of them) as HiGHS arrays."""
    t0 = time.perf_counter()
    cols = all_columns(prob) if cols is None else cols
    n, g = prob.num_requests, prob.num_instances
    inf = np.inf
    cap = coarse_capacity(prob, coarsen)
    if form == "difference":
        kc = cap.shape[1]
        layout = Layout("difference", n, g, kc, coarsen, len(cols), slope_scale(prob))
        aux = sparse.diags(layout.row_scale()) @ _aux_matrix(prob, kc)
        mat = sparse.hstack([x_matrix(prob, cols, layout), aux], format="csc")
        gk = g * kc
        col_lower = np.concatenate([np.zeros(len(cols)), np.full(CHAIN_ROWS * gk, -inf)])
        # load columns u, w, v, z: the capacity rows are their upper bounds
        col_upper = np.concatenate([np.full(len(cols), inf), cap[:, :, BATCH].ravel(),
                                    np.full(gk, inf), cap[:, :, KV].ravel(),
                                    cap[:, :, COMPUTE].ravel()])
        row_lower = np.concatenate([np.full(n, -inf), np.zeros(CHAIN_ROWS * gk)])
        row_upper = np.concatenate([np.ones(n), np.zeros(CHAIN_ROWS * gk)])
        cost = np.concatenate([-cols.reward, np.zeros(CHAIN_ROWS * gk)])
    else:
        kc = cap.shape[1]
        layout = Layout("dense", n, g, kc, coarsen, len(cols))
        mat = x_matrix(prob, cols, layout)
        cap_c = cap
        col_lower = np.zeros(len(cols))
        col_upper = np.full(len(cols), inf)
        row_lower = np.full(n + NUM_RESOURCES * g * kc, -inf)
        row_upper = np.concatenate([np.ones(n), cap_c.ravel()])
        cost = -cols.reward
    mat.sort_indices()
    return Model(layout, cols, mat, cost, col_lower, col_upper, row_lower, row_upper,
                 build_s=time.perf_counter() - t0)


# -- solving -----------------------------------------------------------------------------
@dataclass
class LpSolution:
    """The LP's answer. ``x`` holds the value of each column in ``cols``; ``p`` (G, K, 3)
    and ``y`` (N,) are the duals of the maximisation (>= 0); ``bound`` is D(p, y) >= LP*
    from ``solvers.certificate`` when computed (column generation always does)."""

    status: str
    objective: float
    cols: FlatColumns
    x: FloatArray
    p: FloatArray
    y: FloatArray
    method: str
    strategy: str
    form: str
    coarsen: int
    num_rows: int
    num_cols: int
    nnz: int
    iterations: int
    rounds: int = 1
    bound: float | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return float(sum(self.timings.values()))


def _highs(method: str, crossover: bool, presolve: bool, time_limit_s: float | None,
           threads: int | None) -> Any:
    import highspy

    make: Any = highspy.Highs    # highspy has no type hints
    h = make()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("solver", "ipm" if method == "ipm" else "simplex")
    h.setOptionValue("run_crossover", "on" if crossover else "off")
    h.setOptionValue("presolve", "on" if presolve else "off")
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    if threads is not None:
        # HiGHS keeps one thread scheduler per process, made by the first run: another
        # thread count is refused (an error, run() then leaves the status "Not Set" and
        # the objective 0) unless that scheduler is reset first
        make.resetGlobalScheduler(True)
        h.setOptionValue("threads", int(threads))
    return h


def _pass(h: Any, m: Model) -> None:
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_ = m.matrix.shape[1]
    lp.num_row_ = m.matrix.shape[0]
    lp.col_cost_ = m.cost
    lp.col_lower_ = m.col_lower
    lp.col_upper_ = m.col_upper
    lp.row_lower_ = m.row_lower
    lp.row_upper_ = m.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = m.matrix.indptr.astype(np.int32)
    lp.a_matrix_.index_ = m.matrix.indices.astype(np.int32)
    lp.a_matrix_.value_ = m.matrix.data.astype(np.float64)
    h.passModel(lp)


def _duals(h: Any, prob: LpProblem, m: Model) -> tuple[FloatArray, FloatArray]:
    """(p, y) of the maximisation from HiGHS's duals of min -r.x. HiGHS's reduced costs
    are d = cost - A^T row_dual; a row or a bounded column at its upper bound has a
    dual <= 0 in a minimisation, so the prices of the maximisation are their negatives:
    y = -row_dual (request rows), p = -col_dual of u, v, z (difference form) or
    p = -row_dual (capacity rows, dense form)."""
    sol = h.getSolution()
    n, g = prob.num_requests, prob.num_instances
    lay = m.layout
    row_dual = np.asarray(sol.row_dual, dtype=np.float64)
    y = -row_dual[:n]
    if lay.form == "difference":
        col_dual = np.asarray(sol.col_dual, dtype=np.float64)
        gk = lay.cap_rows
        aux = col_dual[lay.num_x:lay.num_x + CHAIN_ROWS * gk].reshape(CHAIN_ROWS, g,
                                                                      lay.num_slots)
        # HiGHS: a column at its upper bound has col_dual <= 0 in the minimisation
        pc = -np.stack([aux[U_COL], aux[V_COL], aux[Z_COL]], axis=-1)
    else:
        pc = -row_dual[n:].reshape(g, lay.num_slots, NUM_RESOURCES)
    # a block's price applies to each of its slots (module docstring, coarser grid)
    p = np.repeat(pc, lay.coarsen, axis=1)[:, :prob.num_slots]
    # round-off below zero is not a price
    return np.maximum(p, 0.0), np.maximum(y, 0.0)


def _status(h: Any) -> str:
    return str(h.modelStatusToString(h.getModelStatus()))


def solve(prob: LpProblem, method: Method = "auto", strategy: Strategy = "auto",
          form: Form = "difference", coarsen: int = 1, crossover: bool = True,
          presolve: bool = True, gap_tol: float = 0.0, tol: float = 1e-9,
          columns_per_request: int = 16, max_rounds: int = 200,
          time_limit_s: float | None = None, threads: int | None = None,
          verbose: bool = False) -> LpSolution:
    """Solve the window's LP.

    ``strategy="full"`` passes every column at once and solves with ``method``
    (``auto``: dual simplex below ``IPM_ABOVE_NNZ`` nonzeros, else interior point;
    ``crossover=False`` skips the vertex). ``strategy="colgen"`` runs column generation
    (see the module docstring) with interior-point masters, or with ``method="simplex"``
    an interior-point first master and warm-started simplex after it. ``auto`` is column
    generation in difference form and ``full`` in dense form. ``coarsen`` > 1 solves the
    coarse-grid relaxation (an upper bound; its prices are copied to every slot)."""
    if strategy == "auto":
        strategy = "full" if form == "dense" else "colgen"
    if strategy == "colgen":
        if form != "difference":
            raise ValueError("column generation builds the difference form")
        master = "simplex" if method == "simplex" else "ipm"
        return _colgen(prob, master, coarsen, gap_tol, tol, columns_per_request, max_rounds,
                       time_limit_s, threads, verbose)
    m = build(prob, form=form, coarsen=coarsen)
    if method == "auto":
        method = "ipm" if m.nnz > IPM_ABOVE_NNZ else "simplex"
    h = _highs(method, crossover, presolve, time_limit_s, threads)
    t0 = time.perf_counter()
    _pass(h, m)
    t1 = time.perf_counter()
    h.run()
    t2 = time.perf_counter()
    p, y = _duals(h, prob, m)
    info = h.getInfo()
    x = np.asarray(h.getSolution().col_value, dtype=np.float64)[:len(m.cols)]
    iters = int(info.simplex_iteration_count) + int(info.ipm_iteration_count)
    return LpSolution(
        status=_status(h), objective=-float(info.objective_function_value), cols=m.cols,
        x=x, p=p, y=y, method=method + ("" if crossover or method != "ipm" else " (no crossover)"),
        strategy="full", form=form, coarsen=coarsen, num_rows=m.matrix.shape[0],
        num_cols=m.matrix.shape[1], nnz=m.nnz, iterations=iters,
        timings={"build_s": m.build_s, "pass_s": t1 - t0, "solve_s": t2 - t1})


def _add_columns(h: Any, prob: LpProblem, new: FlatColumns, layout: Layout) -> IntArray:
    """Add the priced-out columns to the master; their HiGHS column indices."""
    xm = x_matrix(prob, new, layout)
    xm.sort_indices()
    first = h.getNumCol()
    h.addCols(len(new), -new.reward, np.zeros(len(new)), np.full(len(new), np.inf),
              xm.nnz, xm.indptr[:-1].astype(np.int32), xm.indices.astype(np.int32),
              xm.data.astype(np.float64))
    result: IntArray = first + np.arange(len(new), dtype=np.int64)
    return result


def _colgen(prob: LpProblem, master: str, coarsen: int, gap_tol: float, tol: float,
            per_request: int, max_rounds: int, time_limit_s: float | None, threads: int | None,
            verbose: bool) -> LpSolution:
    from solvers.certificate import Pricer

    t_start = time.perf_counter()
    timings = {"build_s": 0.0, "pass_s": 0.0, "solve_s": 0.0, "price_s": 0.0}
    t0 = time.perf_counter()
    cols = earliest_columns(prob)
    m = build(prob, cols, form="difference", coarsen=coarsen)
    # for block prices copied to every slot, sum_k p_k c_k = sum_B p_B C_B and a.p is the
    # coarse column's price: pricing on the fine grid prices the coarse LP exactly
    pricer = Pricer(prob)
    in_master = np.zeros((prob.num_requests, prob.num_instances, prob.num_delays), dtype=bool)
    in_master[cols.request, cols.instance, cols.delay] = True
    timings["build_s"] += time.perf_counter() - t0
    # ipm: every master by interior point without crossover (IPX has no warm start, but
    # its central duals price out fewer useless columns); simplex: the first master by
    # interior point with crossover, later ones by simplex from the last basis
    h = _highs("ipm", master == "simplex", True, time_limit_s, threads)
    t0 = time.perf_counter()
    _pass(h, m)
    timings["pass_s"] += time.perf_counter() - t0
    x_pos = [np.arange(len(cols), dtype=np.int64)]   # HiGHS column of each x column
    parts = [cols]
    iters = 0
    rounds = 0
    bound = np.inf
    layout = m.layout
    while True:
        rounds += 1
        t0 = time.perf_counter()
        h.run()
        if master == "ipm" and _status(h) != "Optimal":
            # IPX can stall ("no progress") on a hard master: finish it by crossover
            # and simplex from where it stopped rather than give up
            h.setOptionValue("run_crossover", "on")
            h.run()
            h.setOptionValue("run_crossover", "off")
        timings["solve_s"] += time.perf_counter() - t0
        if rounds == 1 and master == "simplex":
            h.setOptionValue("solver", "simplex")
            h.setOptionValue("presolve", "off")
        info = h.getInfo()
        iters += int(info.simplex_iteration_count) + int(info.ipm_iteration_count)
        status = _status(h)
        obj = -float(info.objective_function_value)
        p, y = _duals(h, prob, m)
        t1 = time.perf_counter()
        priced = pricer.price(p, y, tol=tol, per_request=per_request, exclude=in_master)
        timings["price_s"] += time.perf_counter() - t1
        bound = min(bound, priced.dual_value)
        if verbose:
            print(f"  round {rounds}: master {obj:.6f}  D(p) {priced.dual_value:.6f}  "
                  f"+{len(priced.new)} columns  {time.perf_counter() - t0:.2f} s", flush=True)
        out_of_time = (time_limit_s is not None
                       and time.perf_counter() - t_start > time_limit_s)
        if (status != "Optimal" or len(priced.new) == 0 or out_of_time
                or bound - obj <= gap_tol * max(abs(obj), 1e-12) or rounds >= max_rounds):
            break
        t0 = time.perf_counter()
        new = priced.new
        in_master[new.request, new.instance, new.delay] = True
        x_pos.append(_add_columns(h, prob, new, layout))
        parts.append(new)
        timings["build_s"] += time.perf_counter() - t0
    allc = FlatColumns.concat(parts)
    col_value = np.asarray(h.getSolution().col_value, dtype=np.float64)
    x = col_value[np.concatenate(x_pos)]
    return LpSolution(
        status=status, objective=obj, cols=allc, x=x, p=p, y=y,
        method="ipm (no crossover)" if master == "ipm" else "ipm + crossover, then simplex",
        strategy="colgen", form="difference", coarsen=coarsen, num_rows=h.getNumRow(),
        num_cols=h.getNumCol(), nnz=int(h.getNumNz()), iterations=iters, rounds=rounds,
        bound=float(bound), timings=timings)
