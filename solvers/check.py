"""``olproute lp-check``: run bid_price, solve the exact LP of the run's window, and
certify the online prices.

Reported: LP* (column generation to ``gap_tol``), the online reward (realised, see
``solvers.certificate.online_reward``), D(p_online) of the online prices mapped to
absolute slots, the certificate D(p_online)/LP* - 1, the online gap (LP* - online)/LP*
(and against D(p_online), which needs no LP), and capacity rows: how many bind in the
LP (slack <= 1e-6 of a capacity above 1e-6), how many the LP prices (p* > 0), and how
many the online prices price (p > 1e-6). The LP's duals are not unique (the LP is
degenerate), so prices are compared through D(p), and the PNG is a picture, not an
element-wise test.
Rows are (instance, slot, resource) over the three resources batch, KV and compute
(``olproute.pricing.reward.RESOURCES``); the binding rows are also counted per resource.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.config.loader import ConfigError, LoadedConfig
from olproute.pricing.reward import BATCH, COMPUTE, KV, RESOURCES
from olproute.sim.cluster import ProgressFn
from olproute.sim.scenario import CalibrationSource
from solvers.certificate import (
    absolute_prices,
    best_scale,
    certificate,
    dual_value,
    gap,
    online_reward,
)
from solvers.lp import LpSolution, solve
from solvers.problem import LpProblem, prefill_interval
from solvers.record import Recording, WindowLog, build_window, record_bid_price

# how run_check records its run: (config, seed, calibration, progress)
RecordFn = Callable[[LoadedConfig, int | None, CalibrationSource | None, ProgressFn | None],
                    Recording]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

PRICED = 1e-6     # an online price above this counts as pricing its row
BINDING = 1e-6    # LP slack below this (capacity fractions) counts as binding
PRICE_COLORS = ("tab:blue", "tab:orange", "tab:green")   # batch, KV, compute


@dataclass(frozen=True, slots=True)
class CheckResult:
    num_requests: int
    num_instances: int
    num_slots: int
    max_delay: int
    lp_value: float
    lp_bound: float
    online_reward: float
    online_served: int
    d_online: float
    certificate: float        # D(p_online) / LP* - 1
    best_scale: float         # lambda minimising D(lambda p_online)
    certificate_scaled: float  # D(lambda p_online) / LP* - 1 at that lambda
    gap_lp: float             # (LP* - online) / LP*
    gap_d: float              # (D(p_online) - online) / D(p_online)
    rows: int                 # capacity rows (G x K x 3)
    lp_binding: int
    lp_priced: int
    online_priced: int
    lp_status: str
    lp_method: str
    lp_rounds: int
    lp_seconds: float
    record_seconds: float
    binding_by_resource: dict[str, int]   # resource name -> rows binding in the LP

    def as_dict(self) -> dict[str, float | int | str | dict[str, int]]:
        return asdict(self)


def lp_load(prob: LpProblem, sol: LpSolution) -> FloatArray:
    """(G, K, 3) capacity used by the LP's solution, through difference arrays."""
    keep = sol.x > 1e-12
    c, x = sol.cols, sol.x[keep]
    j, g, s, e = c.request[keep], c.instance[keep], c.start[keep], c.end[keep]
    ps, pe, share = prefill_interval(prob, j, g, s)
    k = prob.num_slots
    d0 = np.zeros((prob.num_instances, k + 1, len(RESOURCES)))
    d1 = np.zeros((prob.num_instances, k + 1))
    ba = prob.batch_a[g] * x
    a = prob.kv_a[j, g] * x
    b = prob.kv_b[j, g] * x
    ca = share * x
    for r, lo, hi, val in ((BATCH, s, e, ba), (KV, s, e, a - b * s), (COMPUTE, ps, pe, ca)):
        np.add.at(d0[:, :, r], (g, lo), val)
        np.add.at(d0[:, :, r], (g, hi), -val)
    np.add.at(d1, (g, s), b)
    np.add.at(d1, (g, e), -b)
    idx = np.arange(k, dtype=np.float64)[None, :]
    out: FloatArray = np.cumsum(d0[:, :k], axis=1)
    out[:, :, KV] += idx * np.cumsum(d1[:, :k], axis=1)
    return out


def check(log: WindowLog, ids: npt.NDArray[np.int64], prob: LpProblem, gap_tol: float = 0.0,
          record_seconds: float = 0.0, time_limit_s: float | None = None,
          threads: int | None = None) -> tuple[CheckResult, LpSolution, FloatArray]:
    """Solve the window's LP and certify the recorded prices; returns the figures, the LP
    solution and the online prices on the LP's grid. ``ids`` are the window's request
    ids in the log (``build_window``'s second result). ``time_limit_s`` and ``threads``
    bound the LP solve (``solvers.lp.solve``)."""
    t0 = time.perf_counter()
    sol = solve(prob, gap_tol=gap_tol, time_limit_s=time_limit_s, threads=threads)
    lp_s = time.perf_counter() - t0
    # no updates (prices disabled, or a window before the first tick): the prices were 0
    p_online = (absolute_prices(log.updates, prob.t0_s, prob.slot_s, prob.num_slots)
                if log.updates else np.zeros_like(prob.free))
    d_on = dual_value(prob, p_online)
    lam, d_scaled = best_scale(prob, p_online)
    online = online_reward(prob, log.instance[ids], log.first_token_s[ids],
                           log.finish_s[ids])
    # a row binds when the LP's solution uses all of a capacity there was: a row with no
    # capacity left at the window start (residents over-committed it) is not counted
    cap = prob.capacity
    binding = (cap - lp_load(prob, sol) <= BINDING) & (cap > BINDING)
    total = float(online.sum())
    out = CheckResult(
        num_requests=prob.num_requests, num_instances=prob.num_instances,
        num_slots=prob.num_slots, max_delay=prob.max_delay, lp_value=sol.objective,
        lp_bound=float(sol.bound if sol.bound is not None else sol.objective),
        online_reward=total, online_served=int(np.sum(online > 0)), d_online=d_on,
        certificate=certificate(d_on, sol.objective), best_scale=lam,
        certificate_scaled=certificate(d_scaled, sol.objective), gap_lp=gap(sol.objective, total),
        gap_d=gap(d_on, total), rows=int(prob.capacity.size),
        lp_binding=int(np.sum(binding)), lp_priced=int(np.sum(sol.p > PRICED)),
        online_priced=int(np.sum(p_online > PRICED)), lp_status=sol.status,
        lp_method=f"{sol.strategy}, {sol.method}", lp_rounds=sol.rounds, lp_seconds=lp_s,
        record_seconds=record_seconds,
        binding_by_resource={name: int(np.sum(binding[:, :, r]))
                             for r, name in enumerate(RESOURCES)})
    return out, sol, p_online


@dataclass(frozen=True, slots=True)
class DurationFit:
    """How right the model was about time over a window's served requests: each held
    on its instance for its predicted output tokens times the TPOT its first decision
    expected (``tpot_s``: ``decode_load.load_aware_tpot``), against its realised decode
    (first token to finish).

    - ``duration_ratio``: the mean over requests of realised / predicted decode time;
    - ``occupancy_ratio``: realised / predicted mean decoders per instance over the
      window (the sums of the two durations, by Little's law), with
      ``running_realised`` and ``running_predicted`` themselves."""

    served: int
    duration_ratio: float
    occupancy_ratio: float
    running_realised: float
    running_predicted: float


def _decode_times(prob: LpProblem, instance: IntArray, first_token_s: FloatArray,
                  finish_s: FloatArray) -> tuple[IntArray, IntArray, FloatArray, FloatArray]:
    """(request, instance, realised, predicted decode time) of the served requests."""
    ok = (instance >= 0) & np.isfinite(first_token_s) & np.isfinite(finish_s)
    j = np.nonzero(ok)[0]
    g = instance[j]
    realised = np.maximum(finish_s[j] - first_token_s[j], 0.0)
    predicted = prob.decode_tokens[j, g] * prob.tpot_s[j, g]
    return j, g, realised, predicted


def duration_fit(prob: LpProblem, instance: IntArray, first_token_s: FloatArray,
                 finish_s: FloatArray) -> DurationFit:
    """``DurationFit`` of the window's requests (per-request arrays in the window's
    order)."""
    _, _, realised, predicted = _decode_times(prob, instance, first_token_s, finish_s)
    keep = predicted > 0
    realised, predicted = realised[keep], predicted[keep]
    span = prob.num_slots * prob.slot_s * prob.num_instances
    if realised.size == 0:
        return DurationFit(0, math.nan, math.nan, 0.0, 0.0)
    return DurationFit(
        served=int(realised.size), duration_ratio=float(np.mean(realised / predicted)),
        occupancy_ratio=float(realised.sum() / predicted.sum()),
        running_realised=float(realised.sum() / span),
        running_predicted=float(predicted.sum() / span))


def realised_problem(prob: LpProblem, instance: IntArray, first_token_s: FloatArray,
                     finish_s: FloatArray) -> LpProblem:
    """The window's LP on the durations that held: a served request's TPOT on its own
    instance is its realised decode time over its predicted output tokens (as
    ``certificate.online_reward`` reads it); every other (request, instance) keeps its
    predicted TPOT times that instance's realised / predicted decode time over the
    requests it served (1 where it served none)."""
    j, g, realised, predicted = _decode_times(prob, instance, first_token_s, finish_s)
    num = np.bincount(g, realised, minlength=prob.num_instances)
    den = np.bincount(g, predicted, minlength=prob.num_instances)
    scale = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    tpot = prob.tpot_s * scale[None, :]
    o = prob.decode_tokens[j, g]
    tpot[j, g] = np.where(o > 0, np.maximum(realised, 1e-12) / np.where(o > 0, o, 1.0),
                          tpot[j, g])
    return replace(prob, tpot_s=tpot, _derived={})


def run_check(loaded: LoadedConfig, seed: int | None = None, t0_s: float | None = None,
              t1_s: float | None = None, max_delay: int | None = None, gap_tol: float = 0.0,
              progress: ProgressFn | None = None, record: RecordFn = record_bid_price
              ) -> tuple[CheckResult, LpProblem, LpSolution, FloatArray, WindowLog, IntArray]:
    """Record a bid_price run (with ``record``: ``solvers.resolve.record_as_configured``
    for a config with re-solves), build the window's LP and check it; also the run's log
    and the window's request ids in it."""
    t0 = time.perf_counter()
    rec = record(loaded, seed, None, progress)
    rec_s = time.perf_counter() - t0
    prob, ids = build_window(rec.log, t0_s, t1_s, max_delay=max_delay)
    out, sol, p_online = check(rec.log, ids, prob, gap_tol, rec_s)
    return out, prob, sol, p_online, rec.log, ids


def format_check(r: CheckResult) -> str:
    by_resource = ", ".join(f"{name} {n}" for name, n in r.binding_by_resource.items())
    rows = [
        ("window", f"{r.num_requests} requests, {r.num_instances} instances, "
                   f"{r.num_slots} slots, max delay {r.max_delay} slots"),
        ("LP*", f"{r.lp_value:.3f}  ({r.lp_status}; {r.lp_method}; {r.lp_rounds} rounds, "
                f"{r.lp_seconds:.2f} s; bound {r.lp_bound:.3f})"),
        ("online reward", f"{r.online_reward:.3f}  ({r.online_served} served)"),
        ("D(p_online)", f"{r.d_online:.3f}"),
        ("certificate D(p_online)/LP* - 1", f"{r.certificate * 100:+.2f}%"),
        ("  best rescaling of p_online", f"x{r.best_scale:.3f}: D/LP* - 1 = "
                                          f"{r.certificate_scaled * 100:+.2f}%"),
        ("online gap (LP* - online)/LP*", f"{r.gap_lp * 100:+.2f}%"),
        ("online gap (D - online)/D", f"{r.gap_d * 100:+.2f}%"),
        ("capacity rows", f"{r.rows}"),
        ("  binding in the LP", f"{r.lp_binding}  ({by_resource})"),
        ("  priced by the LP (p* > 1e-6)", f"{r.lp_priced}"),
        ("  priced online (p > 1e-6)", f"{r.online_priced}"),
    ]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def plot_prices(prob: LpProblem, p_lp: FloatArray, p_online: FloatArray, path: Path,
                names: list[str] | None = None) -> None:
    """Per instance: LP duals and online prices over time, batch, KV and compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = prob.num_instances
    t = prob.t0_s + np.arange(prob.num_slots) * prob.slot_s
    fig, axes = plt.subplots(g, 1, figsize=(11, 2.1 * g + 0.6), sharex=True,
                             constrained_layout=True, squeeze=False)
    for i in range(g):
        ax = axes[i, 0]
        for r, name in enumerate(RESOURCES):
            ax.plot(t, p_lp[i, :, r], color=PRICE_COLORS[r], lw=0.9, label=f"LP dual, {name}")
            ax.plot(t, p_online[i, :, r], color=PRICE_COLORS[r], lw=0.9, ls="--",
                    label=f"online, {name}")
        ax.set_ylabel(names[i] if names else f"instance {i}")
        # symlog: LP duals (about the reward per unit of usage) and online prices can be
        # orders of magnitude apart; both stay readable
        ax.set_yscale("symlog", linthresh=0.1)
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(ncol=3, fontsize=8, loc="upper right")
    axes[0, 0].set_title("prices per capacity fraction and slot (symlog): exact LP duals "
                         "(solid) vs bid_price's online prices (dashed)")
    axes[-1, 0].set_xlabel("time (s)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def lp_check_command(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    """``olproute lp-check`` on a loaded config and the parsed options."""
    import json

    progress = None
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(desc="bid_price", unit="req", leave=False)
        progress = bar.update
    rec_t0 = time.perf_counter()
    if loaded.config.prices.resolve_period_s is not None:
        raise ConfigError(loaded.path, [(
            "prices.resolve_period_s", "lp-check records bid_price without re-solves: set "
            "it to null (python -m solvers.compare --price resolve_period_s=S measures "
            "runs with them)")])
    rec = record_bid_price(loaded, progress=(lambda _: progress(1)) if progress else None)
    rec_s = time.perf_counter() - rec_t0
    if bar is not None:
        bar.close()
    t0 = args.window_start_s
    log = rec.log
    t1 = None if args.window_s is None else (t0 or (log.free[0][0] if log.free else 0.0)
                                              ) + args.window_s
    prob, ids = build_window(log, t0, t1, max_delay=args.max_delay_slots)
    result, sol, p_online = check(log, ids, prob, args.gap_tol, rec_s)
    print(format_check(result))
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    png = Path(args.png) if args.png else (out or Path(".")) / "lp_check.png"
    plot_prices(prob, sol.p, p_online, png, [s.name for s in loaded.specs])
    print(f"wrote {png}")
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return 0
