"""How good is each TTFT estimator? Run the simulator; at each dispatch ask every
estimator for the chosen instance's TTFT; compare with the realised TTFT.

Calibration comes from a file or from a profiling run of the same scenario on another
seed (other batch-time noise and length predictions; ``olproute.sim.scenario.
profile_calibration``), as production would calibrate on yesterday's logs rather than on
the requests it is about to route.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.config.loader import LoadedConfig
from olproute.estimate.bea import TtftEstimator, make_estimator
from olproute.estimate.calibration import InstanceCalibration, predict_batch_time
from olproute.policies import Policy
from olproute.sim import metrics
from olproute.sim.cluster import ProgressFn, SimResult
from olproute.sim.scenario import (
    CalibrationSource,
    build_requests,
    make_cluster,
    make_policy,
    profile_calibration,
)
from olproute.types import Decision, Outcome, RoutingContext

FloatArray = npt.NDArray[np.float64]


class EstimatorProbe(Policy):
    """Wraps a policy: decides and observes as it does, and records every estimator's
    TTFT for the instance each request is dispatched to. It needs snapshots (the
    estimators read them) and forwards no other hook: the wrapped policy is never
    ticked."""

    needs_snapshots = True

    def __init__(self, inner: Policy, estimators: Sequence[TtftEstimator]) -> None:
        self.name = inner.name
        self._inner = inner
        self.estimators = list(estimators)
        self.estimates: dict[int, tuple[int, tuple[float, ...]]] = {}

    def decide(self, ctx: RoutingContext) -> Decision:
        decision = self._inner.decide(ctx)
        g = decision.instance
        if g is not None:
            est = tuple(float(e.estimate(ctx).ttft_s[g]) for e in self.estimators)
            self.estimates[ctx.request.request_id] = (g, est)
            for e in self.estimators:
                e.observe_dispatch(g, ctx.now_s)
        return decision

    def observe(self, outcome: Outcome) -> None:
        self._inner.observe(outcome)


@dataclass(frozen=True, slots=True)
class EstimateEval:
    names: tuple[str, ...]
    request_ids: npt.NDArray[np.int64]
    instance: npt.NDArray[np.int64]
    predicted_s: FloatArray          # (n, num_estimators)
    observed_s: FloatArray           # (n,)
    batch_time_ape: FloatArray       # per batch of the run: |beta model - truth| / truth
    result: SimResult


def run_estimate_eval(
    loaded: LoadedConfig,
    policy: str,
    estimators: Sequence[str],
    calibration: Sequence[InstanceCalibration] | None = None,
    snapshot_age_s: float | None = None,
    progress: ProgressFn | None = None,
) -> EstimateEval:
    """Run ``policy`` with every estimator probing its dispatches. The snapshot age is
    the config's ``sim.snapshot_age_ms`` unless given (seconds)."""
    cal = list(calibration) if calibration is not None else profile_calibration(loaded, policy)
    ests = [make_estimator(n, loaded.specs, cal) for n in estimators]
    source = CalibrationSource(loaded, known=cal)  # the policy sees the estimators' own
    probe = EstimatorProbe(make_policy(loaded, policy, calibration=source), ests)
    cluster = make_cluster(loaded, probe, snapshot_age_s=snapshot_age_s,
                           record_batches=True)  # its batch times are judged below
    res = cluster.run(build_requests(loaded), progress)
    ttft = metrics.ttft_s(res)
    ids = np.array(sorted(rid for rid in probe.estimates if np.isfinite(ttft[rid])),
                   dtype=np.int64)
    pred = np.array([probe.estimates[int(i)][1] for i in ids], dtype=np.float64).reshape(
        len(ids), len(ests))
    inst = np.array([probe.estimates[int(i)][0] for i in ids], dtype=np.int64)
    log = res.batch_log
    ape = np.empty(log.shape[0])
    for g, c in enumerate(cal):
        rows = log[:, 0] == g
        ape[rows] = np.abs(predict_batch_time(c.beta, log[rows]) / log[rows, 2] - 1.0)
    return EstimateEval(names=tuple(e.name for e in ests), request_ids=ids, instance=inst,
                        predicted_s=pred, observed_s=ttft[ids], batch_time_ape=ape, result=res)


def error_rows(ev: EstimateEval) -> list[dict[str, float | str]]:
    """Per estimator: MAPE, median and P90 absolute percentage error, signed bias (all %)."""
    rows: list[dict[str, float | str]] = []
    obs = ev.observed_s
    for k, name in enumerate(ev.names):
        rel = ev.predicted_s[:, k] / obs - 1.0
        ape = np.abs(rel)
        rows.append({"estimator": name, "n": float(len(obs)),
                     "mape_pct": float(np.mean(ape) * 100),
                     "median_ape_pct": float(np.median(ape) * 100),
                     "p90_ape_pct": float(np.percentile(ape, 90) * 100),
                     "bias_pct": float(np.median(rel) * 100)})
    return rows


def format_rows(rows: Sequence[Mapping[str, float | str]], batch_mape_pct: float) -> str:
    head = f"{'estimator':<14} {'n':>7} {'MAPE %':>9} {'median %':>9} {'P90 %':>9} {'bias %':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['estimator']!s:<14} {r['n']:>7.0f} {r['mape_pct']:>9.2f} "
                     f"{r['median_ape_pct']:>9.2f} {r['p90_ape_pct']:>9.2f} {r['bias_pct']:>8.2f}")
    lines.append(f"batch-time model (4-term beta) MAPE over all batches: {batch_mape_pct:.2f} %")
    return "\n".join(lines)


def scatter_png(ev: EstimateEval, path: Path, title: str = "") -> None:
    """Predicted vs observed TTFT, one log-log panel per estimator, y = x dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(ev.names)
    cols = min(n, 4)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.5 * nrows),
                             constrained_layout=True, squeeze=False)
    obs = ev.observed_s
    lo = max(float(np.min(obs)) * 0.8, 1e-4)
    hi = float(np.max(obs)) * 1.25
    for k, name in enumerate(ev.names):
        ax = axes[k // cols][k % cols]
        pred = np.clip(ev.predicted_s[:, k], lo, hi * 10)
        ax.scatter(obs, pred, s=3, alpha=0.35, linewidths=0)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ape = np.mean(np.abs(ev.predicted_s[:, k] / obs - 1.0)) * 100
        ax.set_title(f"{name}  (MAPE {ape:.1f}%)", fontsize=10)
        ax.set_xlabel("observed TTFT (s)")
        ax.set_ylabel("predicted TTFT (s)")
        ax.grid(True, which="both", alpha=0.25)
    for k in range(n, nrows * cols):
        axes[k // cols][k % cols].axis("off")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
