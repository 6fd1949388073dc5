"""How good is each TTFT estimator? Run the simulator; at each dispatch ask every
estimator for the chosen instance's TTFT; compare with the realised TTFT.

Calibration comes from a file or from a profiling run of the same scenario on another
seed (other batch-time noise and length predictions), as production would calibrate on
yesterday's logs rather than on the requests it is about to route.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.bea import TtftEstimator, make_estimator
from olproute.calibration import (
    InstanceCalibration,
    calibrate_log,
    predict_batch_time,
)
from olproute.config import LoadedConfig
from olproute.policies import Policy
from olproute.sim import metrics
from olproute.sim.cluster import ProgressFn, SimResult
from olproute.sim.scenario import (
    CalibrationSource,
    build_requests,
    make_cluster,
    make_policy,
    simulate,
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


def calibrate_result(res: SimResult) -> list[InstanceCalibration]:
    """Calibration of every instance from one run's batch log and records."""
    finished = np.isfinite(res.finish_s)
    completions = [int(np.sum(finished & (res.instance == g))) for g in range(len(res.specs))]
    decode = [res.decode_tokens[finished & (res.instance == g)].astype(np.float64)
              for g in range(len(res.specs))]
    cal = calibrate_log(res.batch_log, [s.name for s in res.specs], completions, decode)
    return [cal[s.name] for s in res.specs]


def profile_calibration(loaded: LoadedConfig, policy: str,
                        seed_offset: int = 1) -> list[InstanceCalibration]:
    """Calibrate on a profiling run of the same scenario with another seed; the LPS
    service rate and concurrency come from a saturation run of each instance."""
    res = simulate(loaded, policy, seed=loaded.config.sim.seed + seed_offset)
    sat = saturation_profile(loaded)
    return [replace(c, service_rate_per_s=s.requests_per_s, mean_batch_seqs=s.mean_batch_seqs)
            for c, s in zip(calibrate_result(res), sat, strict=True)]


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


@dataclass(frozen=True, slots=True)
class Saturation:
    """An instance's behaviour when it always has work: completions per second and the
    mean number of requests per batch (LPS mu and k, BEAR sec. 4.2)."""

    requests_per_s: float
    mean_batch_seqs: float


def saturation_profile(loaded: LoadedConfig, num_requests: int = 2000) -> list[Saturation]:
    """Every instance, on its own, given ``num_requests`` of the workload's requests at
    time 0; measured between the 20th and 80th percentile completions, away from the
    start-up and drain transients."""
    reqs = build_requests(loaded)[:num_requests]
    out = []
    for g, spec in enumerate(loaded.specs):
        burst = [replace(r, arrival_s=0.0, request_id=i) for i, r in enumerate(reqs)]
        one = loaded.with_updates(instances=(loaded.config.instances[0].model_copy(
            update={"name": spec.name, "model": spec.model, "gpu": spec.gpu,
                    "tensor_parallel": spec.tensor_parallel, "replicas": 1,
                    "max_num_seqs": spec.max_num_seqs,
                    "max_num_batched_tokens": spec.max_num_batched_tokens,
                    "block_size": spec.block_size,
                    "kv_capacity_tokens": spec.kv_capacity_tokens, "role": "mixed"}),))
        res = simulate(one, "round_robin", burst, seed=loaded.config.sim.seed + 7 + g)
        done = np.sort(res.finish_s)
        t0, t1 = done[int(0.2 * len(done))], done[int(0.8 * len(done))]
        completed = 0.6 * len(done)
        log = res.batch_log
        mid = (log[:, 1] >= t0) & (log[:, 1] < t1)
        if t1 <= t0 or not mid.any():
            # too few requests, or all alike (they finish together): the whole run
            t0, t1, completed = 0.0, float(done[-1]), float(len(done))
            mid = np.ones(len(log), dtype=bool)
        k = float((log[mid, 3] * log[mid, 2]).sum() / log[mid, 2].sum())
        out.append(Saturation(requests_per_s=float(completed / (t1 - t0)),
                              mean_batch_seqs=k))
    return out
