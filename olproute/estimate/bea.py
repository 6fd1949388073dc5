"""Time-to-first-token estimators behind one interface.

``BeaEstimator`` replays each instance's batch formation from its snapshot with the
compiled core (``olproute._core.replay_ttft``: the same scheduling rules the simulator's
engines run) and times every replayed batch with the instance's calibrated 4-term model,
stopping at the batch that completes the new request's prefill (BEAR paper eqs. 9-12).
One call estimates every instance of a decision.

The others are the baselines and ablations of the BEAR paper, from coarse signals:
prefill throughput (eq. 8), the limited-processor-sharing closed form (eq. 13-14) and its
variability-corrected form (eq. 15), and SCORE-, RouteBalance- and LMDeploy-style
estimates. Where a paper leaves a detail open, the docstring says what we chose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from olproute._core import replay_ttft_many
from olproute.estimate.calibration import InstanceCalibration
from olproute.types import (
    SNAP_COMPUTED,
    SNAP_OUTPUT,
    SNAP_PREDICTED,
    SNAP_PROMPT,
    EngineSnapshot,
    InstanceSpec,
    RoutingContext,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """Per-instance TTFT in seconds if the request joined now, with its split into
    waiting (before its first prefill chunk runs) and prefill (until its first token)."""

    ttft_s: FloatArray
    wait_s: FloatArray
    prefill_s: FloatArray


class TtftEstimator(Protocol):
    name: str
    needs_snapshots: bool

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        """TTFT of ctx.request on every instance. ``predicted_decode[g]`` overrides the
        request's predicted output length on instance g (per-model predictions)."""
        ...

    def observe_dispatch(self, instance: int, now_s: float) -> None:
        """The router sent a request to ``instance`` at ``now_s``."""
        ...


def _new_decode(ctx: RoutingContext, predicted: IntArray | None) -> IntArray:
    if predicted is not None:
        return np.ascontiguousarray(predicted, dtype=np.int64)
    return np.full(len(ctx.specs), ctx.request.predicted_decode_tokens, dtype=np.int64)


def _require_snapshots(ctx: RoutingContext, name: str) -> tuple[EngineSnapshot, ...]:
    if ctx.snapshots is None:
        raise ValueError(f"estimator {name!r} needs instance snapshots in the context")
    return ctx.snapshots


class BeaEstimator:
    """Batch-evolution-aware replay. ``beta`` per instance comes from calibration and can
    be replaced while running (online recalibration) with ``set_beta``."""

    name = "bea"
    needs_snapshots = True

    def __init__(self, specs: Sequence[InstanceSpec],
                 calibrations: Sequence[InstanceCalibration],
                 max_batches: int = 200_000) -> None:
        if len(specs) != len(calibrations):
            raise ValueError("one calibration per instance")
        self._limits = np.array([(s.num_kv_blocks, s.block_size, s.max_num_seqs,
                                  s.max_num_batched_tokens) for s in specs], dtype=np.int64)
        self._beta = np.array([c.beta for c in calibrations], dtype=np.float64)
        self._max_batches = max_batches

    @property
    def beta(self) -> FloatArray:
        return self._beta.copy()

    @property
    def beta_view(self) -> FloatArray:
        """The batch-time coefficients (G, 4) as the replay reads them, not copied: for
        readers on the request path, which must not write to it."""
        return self._beta

    def set_beta(self, instance: int, beta: Sequence[float]) -> None:
        if len(beta) != 4 or min(beta) < 0:
            raise ValueError("beta must be 4 coefficients >= 0")
        self._beta[instance] = beta

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        many = self.estimate_many(ctx, np.array([ctx.request.prompt_tokens]),
                                  _new_decode(ctx, predicted_decode)[None, :],
                                  cached=cached_rows(ctx))
        return TtftEstimate(ttft_s=many.ttft_s[0], wait_s=many.wait_s[0],
                            prefill_s=many.prefill_s[0])

    def estimate_many(self, ctx: RoutingContext, prompts: IntArray,
                      predicted_decode: IntArray,
                      instances: IntArray | None = None,
                      cached: IntArray | None = None) -> TtftEstimate:
        """``estimate`` for N requests at once (prompts (N,), predicted outputs (N, G)),
        each as if it alone joined now: (N, G) arrays. Each instance is replayed up to
        now once for all of them. With ``instances`` (d indices), only those are
        replayed: ``predicted_decode`` and the result are (N, d), in their order.
        ``cached`` (as ``predicted_decode``): each one's prompt tokens cached on each
        instance, which its replayed prefill skips (``cached_rows``)."""
        out = self._replay(ctx, prompts, predicted_decode, instances, cached=cached)
        ttft, wait = out[..., 0], out[..., 1]
        # a request that never starts there has inf for both: its prefill time is inf too
        prefill = np.subtract(ttft, wait, out=np.full_like(ttft, np.inf),
                              where=np.isfinite(wait))
        return TtftEstimate(ttft_s=ttft, wait_s=wait, prefill_s=prefill)

    def ttft_many(self, ctx: RoutingContext, prompts: IntArray, predicted_decode: IntArray,
                  instances: IntArray | None = None,
                  loads: FloatArray | None = None,
                  cached: IntArray | None = None) -> FloatArray:
        """``estimate_many``'s TTFT alone (a strided view), for the request path; with
        ``loads`` (G or d, 2), each replayed instance's decode load from the same pass
        (``replay_ttft_many``)."""
        result: FloatArray = self._replay(ctx, prompts, predicted_decode, instances,
                                          loads, cached)[..., 0]
        return result

    def _replay(self, ctx: RoutingContext, prompts: IntArray, predicted_decode: IntArray,
                instances: IntArray | None, loads: FloatArray | None = None,
                cached: IntArray | None = None) -> FloatArray:
        """``replay_ttft_many``'s (N, G or d, 3) for ``estimate_many``."""
        snaps = _require_snapshots(ctx, self.name)
        pending = None if ctx.pending is None else list(ctx.pending)
        limits, beta = self._limits, self._beta
        if instances is None:
            replayed = list(snaps)
        else:
            order = instances.tolist()
            replayed = [snaps[g] for g in order]
            pending = None if pending is None else [pending[g] for g in order]
            limits, beta = limits[instances], beta[instances]
        out = replay_ttft_many(replayed, limits, beta,
                               np.ascontiguousarray(prompts, dtype=np.int64),
                               np.ascontiguousarray(predicted_decode, dtype=np.int64),
                               ctx.now_s, pending, self._max_batches, loads,
                               None if cached is None
                               else np.ascontiguousarray(cached, dtype=np.int64))
        return out

    def observe_dispatch(self, instance: int, now_s: float) -> None:
        """Dispatches reach the replay through the snapshot and ctx.pending."""


def cached_rows(ctx: RoutingContext) -> IntArray | None:
    """The request's prompt tokens the router expects cached on each instance, as one
    row (1, G) for ``estimate_many``; None without block hashes."""
    return None if ctx.prefixes is None else ctx.prefixes.cached_tokens[None, :]


def remaining_prefill_tokens(snap: EngineSnapshot) -> IntArray:
    """Prompt (or recompute) tokens each resident still has to prefill; 0 for decoders."""
    t = snap.table
    out = t[:, SNAP_OUTPUT]
    rem = t[:, SNAP_PROMPT] + out - t[:, SNAP_COMPUTED] - (out > 0)
    result: IntArray = np.maximum(rem, 0)
    return result


def remaining_decode_tokens(snap: EngineSnapshot) -> IntArray:
    """Predicted output tokens each resident has left (at least one: it has not finished)."""
    t = snap.table
    result: IntArray = np.maximum(t[:, SNAP_PREDICTED] - t[:, SNAP_OUTPUT], 1)
    return result


def pooled_by_kind(values: FloatArray, specs: Sequence[InstanceSpec]) -> FloatArray:
    """Each instance's value replaced by the mean over the instances of its kind (same
    model, GPU, tensor parallelism and scheduler limits): what a profile of that kind of
    instance measures, without the per-instance calibration noise."""
    kinds = [(s.model, s.gpu, s.tensor_parallel, s.max_num_seqs, s.max_num_batched_tokens)
             for s in specs]
    out = np.asarray(values, dtype=np.float64).copy()
    for kind in set(kinds):
        members = [g for g, k in enumerate(kinds) if k == kind]
        out[members] = out[members].mean()
    return out


class _FromCalibration:
    """Estimators from calibrated constants. With ``specs``, the prefill throughput is
    one figure per kind of instance (``pooled_by_kind``): a constant profiled per
    instance differs between identical replicas by calibration noise alone, and an
    estimate built on it alone (Prefill-TPS on idle queues) would send every request to
    the replica that happened to profile fastest."""

    needs_snapshots = True

    def __init__(self, calibrations: Sequence[InstanceCalibration],
                 specs: Sequence[InstanceSpec] | None = None) -> None:
        self._cal = list(calibrations)
        theta = np.array([c.prefill_tokens_per_s for c in calibrations], dtype=np.float64)
        self._theta = theta if specs is None else pooled_by_kind(theta, specs)

    def observe_dispatch(self, instance: int, now_s: float) -> None:
        """These estimators read only the snapshot."""

    def _prefill_s(self, prompt_tokens: int) -> FloatArray:
        return prompt_tokens / self._theta


class PrefillTpsEstimator(_FromCalibration):
    """BEAR eq. 8: pending prefill tokens of residents, then the new prompt, over the
    profiled prefill throughput of the instance (of its kind, when built with specs)."""

    name = "prefill_tps"

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        snaps = _require_snapshots(ctx, self.name)
        wait = np.array([remaining_prefill_tokens(s).sum() for s in snaps],
                        dtype=np.float64) / self._theta
        pre = self._prefill_s(ctx.request.prompt_tokens)
        return TtftEstimate(ttft_s=wait + pre, wait_s=wait, prefill_s=pre)


class ScoreEstimator(_FromCalibration):
    """SCORE-style: queue delay plus predicted output x per-token time. The queue delay
    is the waiting requests' pending prefill over prefill throughput (our reading of
    "queueing delay"); the per-token time is the instance's decode step now, from the
    calibrated beta and the snapshot (``decode_step_times_s``: its residents, the
    router's own dispatches the snapshot does not hold yet, and this request), so it
    grows with the instance's load as a measured TPOT does. A profiled mean TPOT
    instead is a constant per instance that differs between identical replicas by
    calibration noise alone and would send every request to the one that happened to
    profile fastest. As SCORE's latency does, the estimate carries the new request's
    own decode time."""

    name = "score"

    def __init__(self, calibrations: Sequence[InstanceCalibration],
                 specs: Sequence[InstanceSpec]) -> None:
        super().__init__(calibrations, specs)
        self._specs = tuple(specs)
        self._beta = np.array([c.beta for c in calibrations], dtype=np.float64)

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        snaps = _require_snapshots(ctx, self.name)
        wait = np.array([remaining_prefill_tokens(s)[s.num_running:].sum() for s in snaps],
                        dtype=np.float64)
        if ctx.pending is not None:
            wait += [0.0 if rows is None else float(rows[:, 0].sum()) for rows in ctx.pending]
        wait /= self._theta
        tpot = decode_step_times_s(snaps, self._specs, self._beta, ctx.request.prompt_tokens,
                                   ctx.pending)
        pre = _new_decode(ctx, predicted_decode) * tpot
        return TtftEstimate(ttft_s=wait + pre, wait_s=wait, prefill_s=pre)


class RouteBalanceEstimator(_FromCalibration):
    """RouteBalance-style: pending decode tokens of residents over the batch size times
    TPOT, plus the new prompt's prefill time. Batch size is the calibrated mean number
    of requests per batch."""

    name = "route_balance"

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        snaps = _require_snapshots(ctx, self.name)
        k = np.array([max(c.mean_batch_seqs, 1.0) for c in self._cal])
        tpot = np.array([c.tpot_s for c in self._cal])
        pending = np.array([remaining_decode_tokens(s).sum() for s in snaps], dtype=np.float64)
        wait = pending / k * tpot
        pre = self._prefill_s(ctx.request.prompt_tokens)
        return TtftEstimate(ttft_s=wait + pre, wait_s=wait, prefill_s=pre)


def _service_rates(cal: Sequence[InstanceCalibration], name: str) -> FloatArray:
    mu = [c.service_rate_per_s for c in cal]
    if any(m is None or m <= 0 for m in mu):
        raise ValueError(f"estimator {name!r} needs service_rate_per_s in the calibration "
                         "(fit it with the run's records)")
    return np.array(mu, dtype=np.float64)


class LmdeployEstimator(_FromCalibration):
    """LMDeploy-style: unfinished requests (residents and the new one) over the
    instance's request throughput."""

    name = "lmdeploy"

    def __init__(self, calibrations: Sequence[InstanceCalibration]) -> None:
        super().__init__(calibrations)
        self._mu = _service_rates(calibrations, self.name)

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        snaps = _require_snapshots(ctx, self.name)
        n = np.array([s.num_resident + 1 for s in snaps], dtype=np.float64)
        wait = n / self._mu
        zero = np.zeros_like(wait)
        return TtftEstimate(ttft_s=wait, wait_s=wait, prefill_s=zero)


class ArrivalTracker:
    """Exponentially weighted inter-arrival mean and variance (weight ``alpha`` per
    arrival): the arrival rate and its squared coefficient of variation."""

    def __init__(self, alpha: float = 0.02) -> None:
        self._alpha = alpha
        self._last: float | None = None
        self._mean = math.nan
        self._var = 0.0

    def add(self, t: float) -> None:
        if self._last is not None:
            gap = t - self._last
            if math.isnan(self._mean):
                self._mean = gap
            else:
                d = gap - self._mean
                self._mean += self._alpha * d
                self._var = (1 - self._alpha) * (self._var + self._alpha * d * d)
        self._last = t

    @property
    def rate_per_s(self) -> float:
        return 0.0 if math.isnan(self._mean) or self._mean <= 0 else 1.0 / self._mean

    @property
    def scv(self) -> float:
        return 1.0 if math.isnan(self._mean) or self._mean <= 0 else self._var / self._mean**2


def lps_wait_s(arrival_rate: float, service_rate: float, k: float,
               max_utilisation: float = 0.99) -> float:
    """BEAR eq. 13-14: expected wait of M/M/1-LPS(k), rho^k / (mu - alpha). Utilisation is
    capped at ``max_utilisation`` so an overloaded instance gets a large finite wait."""
    rho = min(arrival_rate / service_rate, max_utilisation)
    return float(rho**k / (service_rate * (1.0 - rho)))


def lps_wait_variability_s(arrival_rate: float, service_rate: float, k: float,
                           arrival_scv: float, service_scv: float,
                           max_utilisation: float = 0.99) -> float:
    """BEAR eq. 15: ((c_a^2 + c_s^2) / 2) rho^k E[Q] / (1 - rho), with E[Q] = 1 / mu."""
    rho = min(arrival_rate / service_rate, max_utilisation)
    return float((arrival_scv + service_scv) / 2.0 * rho**k / (service_rate * (1.0 - rho)))


class LpsEstimator(_FromCalibration):
    """Closed form without snapshots: the LPS wait from each instance's arrival rate
    (tracked from the router's own dispatches), service rate and concurrency k (the
    calibrated mean batch size), plus s / prefill throughput. ``variability=True`` uses
    eq. 15 with the tracked arrival SCV and the calibrated service SCV."""

    needs_snapshots = False

    def __init__(self, calibrations: Sequence[InstanceCalibration],
                 variability: bool = False) -> None:
        super().__init__(calibrations)
        self.name = "lps_var" if variability else "lps"
        self._mu = _service_rates(calibrations, self.name)
        self._k = np.array([max(c.mean_batch_seqs, 1.0) for c in calibrations])
        self._scv = np.array([1.0 if c.service_scv is None else c.service_scv
                              for c in calibrations])
        self._variability = variability
        self._arrivals = [ArrivalTracker() for _ in calibrations]

    def observe_dispatch(self, instance: int, now_s: float) -> None:
        self._arrivals[instance].add(now_s)

    def estimate(self, ctx: RoutingContext,
                 predicted_decode: IntArray | None = None) -> TtftEstimate:
        wait = np.empty(len(self._arrivals))
        for g, tr in enumerate(self._arrivals):
            if self._variability:
                wait[g] = lps_wait_variability_s(tr.rate_per_s, self._mu[g], self._k[g],
                                                 tr.scv, self._scv[g])
            else:
                wait[g] = lps_wait_s(tr.rate_per_s, self._mu[g], self._k[g])
        pre = self._prefill_s(ctx.request.prompt_tokens)
        return TtftEstimate(ttft_s=wait + pre, wait_s=wait, prefill_s=pre)


ESTIMATORS = ("bea", "prefill_tps", "lps", "lps_var", "score", "route_balance", "lmdeploy")


def make_estimator(name: str, specs: Sequence[InstanceSpec],
                   calibrations: Sequence[InstanceCalibration]) -> TtftEstimator:
    """An estimator by name (one of ESTIMATORS)."""
    if name == "bea":
        return BeaEstimator(specs, calibrations)
    if name == "prefill_tps":
        return PrefillTpsEstimator(calibrations, specs)
    if name in ("lps", "lps_var"):
        return LpsEstimator(calibrations, variability=name == "lps_var")
    if name == "score":
        return ScoreEstimator(calibrations, specs)
    if name == "route_balance":
        return RouteBalanceEstimator(calibrations)
    if name == "lmdeploy":
        return LmdeployEstimator(calibrations)
    raise ValueError(f"unknown estimator {name!r} (known: {', '.join(ESTIMATORS)})")


def decode_step_times_s(snapshots: Sequence[EngineSnapshot], specs: Sequence[InstanceSpec],
                        beta: FloatArray, prompt_tokens: int | IntArray,
                        inbound: Sequence[FloatArray | None] | None = None) -> FloatArray:
    """Per instance, the calibrated time of one decode batch of its residents plus the new
    request (up to max_num_seqs, contexts as they stand): the time per output token the
    new request should expect there now. Unlike the profiled mean TPOT, it grows with
    the instance's decode load (beta0 + beta1 * n + beta2 * sum of contexts). With
    ``inbound`` (``RoutingContext.inbound`` rows, prompt first) the requests on their way
    to an instance count as residents after the others. With ``prompt_tokens`` of
    shape (N,), one row per prompt: (N, G)."""
    g_count = len(snapshots)
    fixed = np.empty(g_count)      # the residents counted
    resident = np.empty(g_count)
    for g, (snap, spec) in enumerate(zip(snapshots, specs, strict=True)):
        t = snap.table
        contexts = (t[:, SNAP_PROMPT] + t[:, SNAP_OUTPUT]).astype(np.float64)
        rows = None if inbound is None else inbound[g]
        if rows is not None and rows.shape[0]:
            contexts = np.concatenate([contexts, rows[:, 0]])
        n = min(contexts.shape[0], spec.max_num_seqs - 1)
        resident[g] = float(contexts[:n].sum())
        fixed[g] = n
    return decode_step_time(beta, fixed, resident, np.asarray(prompt_tokens))


def decode_step_time(beta: FloatArray, num_resident: FloatArray, resident_context: FloatArray,
                     prompt_tokens: FloatArray | IntArray) -> FloatArray:
    """``decode_step_times_s`` from each instance's residents counted (G,): their number
    and their contexts' sum (``replay_ttft_many`` counts them compiled, ``loads``)."""
    fixed = beta[:, 0] + beta[:, 1] * (num_resident + 1)
    prompt = np.asarray(prompt_tokens, dtype=np.float64)[..., None]
    out: FloatArray = fixed + beta[:, 2] * (resident_context + prompt)
    return out
