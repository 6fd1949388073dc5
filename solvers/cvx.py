"""The window's LP written plainly in cvxpy: for tests against ``solvers.lp`` and small
offline studies. It shares only the problem data with the HiGHS builder: rewards come
from ``olproute.pricing.reward.reward_terms`` request by request, usage from
``olproute.pricing.reward.dense`` column by column (the prefill slots from
``olproute.pricing.reward.prefill_span`` on the LP's grid), and the capacity rows are written out
slot by slot (no difference form, no column generation). Dense in (columns x slots): keep it
to a few thousand columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.pricing.reward import NUM_RESOURCES, Columns, dense, prefill_span, reward_terms
from olproute.routing.outlook import Outlook
from solvers.problem import FlatColumns, LpProblem

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CvxSolution:
    status: str
    objective: float
    cols: FlatColumns
    x: FloatArray
    p: FloatArray       # (G, K, 3) capacity prices of the maximisation, >= 0
    y: FloatArray       # (N,) request-row prices, >= 0


def enumerate_columns(prob: LpProblem) -> FlatColumns:
    """Every (request, instance, delay) column inside the grid, one at a time."""
    rows: list[tuple[int, int, int, int, int, float]] = []
    for j in range(prob.num_requests):
        a = int(prob.arrival_slot[j])
        for g in range(prob.num_instances):
            for d in range(prob.num_delays):
                ttft = float(prob.exec_ttft_s[j, g]) + d * prob.slot_s
                look = Outlook(decode_tokens=np.array([prob.decode_tokens[j, g]]),
                               quality=np.array([prob.utility[j, g]]),
                               cost_musd=np.zeros(1))
                terms = reward_terms(int(prob.prompt_tokens[j]), float(prob.ttft_target_s[j]),
                                     look, np.array([ttft]), np.array([prob.tpot_s[j, g]]),
                                     prob.reward, prob.slot_s, prob.horizon)
                k0 = int(np.ceil(min(ttft, prob.horizon * prob.slot_s) / prob.slot_s - 1e-9))
                start = a + min(max(k0, 0), prob.horizon)
                if start >= prob.num_slots:
                    continue
                dur = int(prob.duration[j, g])
                end = min(start + dur, prob.num_slots)
                # prorated at the grid's end (solvers.problem, "The grid's end")
                rows.append((j, g, d, start, end, float(terms.total[0]) * (end - start) / dur))
    arr = np.array(rows, dtype=np.float64).reshape(-1, 6)
    ints = arr[:, :5].astype(np.int64)
    return FlatColumns(request=ints[:, 0], instance=ints[:, 1], delay=ints[:, 2],
                       start=ints[:, 3], end=ints[:, 4], reward=arr[:, 5])


def usage_matrix(prob: LpProblem, cols: FlatColumns) -> FloatArray:
    """(G, K, 3, columns): what each column uses of every capacity row."""
    g_n, k_n = prob.num_instances, prob.num_slots
    out = np.zeros((g_n, k_n, NUM_RESOURCES, len(cols)))
    for i in range(len(cols)):
        j, g = int(cols.request[i]), int(cols.instance[i])
        start = np.array([cols.start[i]])
        # the online column relative to the arrival (clipped there), moved to the grid
        a_j = int(prob.arrival_slot[j])
        ps, pe, ca = prefill_span(float(prob.prompt_tokens[j]), start - a_j,
                                  np.array([prob.compute_cap[g]]), k_n + 1)
        ps, pe = np.minimum(ps + a_j, k_n), np.minimum(pe + a_j, k_n)
        col = Columns(start=start, end=np.array([cols.end[i]]),
                      batch_a=np.array([prob.batch_a[g]]), kv_a=np.array([prob.kv_a[j, g]]),
                      kv_b=np.array([prob.kv_b[j, g]]), pre_start=ps, pre_end=pe,
                      compute_a=np.asarray(ca, dtype=np.float64).reshape(1))
        out[g, :, :, i] = dense(col, k_n)[0]
    return out


def solve_cvx(prob: LpProblem, solver: str = "HIGHS", **kwargs: Any) -> CvxSolution:
    """The LP in cvxpy (HiGHS through cvxpy by default)."""
    import cvxpy as cp

    cols = enumerate_columns(prob)
    use = usage_matrix(prob, cols).reshape(-1, len(cols))
    assign = np.zeros((prob.num_requests, len(cols)))
    assign[cols.request, np.arange(len(cols))] = 1.0
    x: Any = cp.Variable(len(cols), nonneg=True)
    one_start: Any = assign @ x <= 1
    capacity: Any = use @ x <= prob.capacity.reshape(-1)
    problem: Any = cp.Problem(cp.Maximize(cols.reward @ x), [one_start, capacity])
    problem.solve(solver=solver, **kwargs)
    # cvxpy: the dual of a "<=" constraint of a maximisation is >= 0 as returned (it
    # reports the multiplier of the constraint in the problem as written), no flip.
    p = np.asarray(capacity.dual_value, dtype=np.float64).reshape(
        prob.num_instances, prob.num_slots, NUM_RESOURCES)
    y = np.asarray(one_start.dual_value, dtype=np.float64)
    return CvxSolution(status=str(problem.status), objective=float(problem.value), cols=cols,
                       x=np.asarray(x.value, dtype=np.float64), p=p, y=y)
