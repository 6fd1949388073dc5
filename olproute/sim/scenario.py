"""From a loaded config to a simulation run: the engines' timers, the policy (built by
``olproute.routing.assembly``), the cluster, and the run; and the profiling run behind
``calibration: auto`` (``profile_calibration``), which is a simulation too.

The run's requests come from ``olproute.sim.requests`` (``build_requests``, ``streams``,
re-exported here); every purpose draws from its own child stream of the run seed, so a
policy's coin flips never shift the workload or the engines' noise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from olproute.config.loader import ConfigError, LoadedConfig
from olproute.estimate.calibration import InstanceCalibration, calibrate_log
from olproute.policies import Policy
from olproute.routing import assembly
from olproute.routing.assembly import build_policy, kv_transfer
from olproute.sim.cluster import Cluster, ProgressFn, SimResult
from olproute.sim.engine import BatchTimer
from olproute.sim.replicas import Sync
from olproute.sim.requests import build_requests, streams
from olproute.sim.timing import LinearTiming, RooflineTiming
from olproute.types import Request

__all__ = ["CalibrationSource", "Saturation", "build_requests", "build_timers",
           "calibrate_result", "kv_transfer", "make_cluster", "make_policy", "make_replicas",
           "profile_calibration", "saturation_profile", "simulate", "simulate_replicas",
           "streams", "sweep_calibration"]


def build_timers(loaded: LoadedConfig, seed: int | None = None) -> list[BatchTimer]:
    cfg = loaded.config
    st = streams(cfg.sim.seed if seed is None else seed, len(loaded.specs))
    timers: list[BatchTimer] = []
    for spec, ss in zip(loaded.specs, st.engine_seeds, strict=True):
        rng = np.random.default_rng(ss)
        if cfg.sim.timing == "linear":
            timers.append(LinearTiming(cfg.sim.linear_beta, cfg.sim.noise_cv, rng))
        else:
            timers.append(RooflineTiming(
                loaded.profiles.models[spec.model], loaded.profiles.gpus[spec.gpu],
                spec.tensor_parallel, cfg.sim.batch_overhead_ms / 1e3, cfg.sim.noise_cv, rng))
    return timers


class CalibrationSource(assembly.CalibrationSource):
    """``olproute.routing.assembly.CalibrationSource`` whose ``calibration: auto`` is answered by
    a profiling run of the scenario in this simulator (``profile_calibration`` with round
    robin): what simulations, the benchmarks and the server's start-up use."""

    def __init__(self, loaded: LoadedConfig,
                 known: Sequence[InstanceCalibration] | None = None) -> None:
        super().__init__(loaded, known, profile=_round_robin_profile)


def _round_robin_profile(loaded: LoadedConfig) -> list[InstanceCalibration]:
    if not loaded.has_workload:   # a server's config: no workload to profile on
        return sweep_calibration(loaded)
    return profile_calibration(loaded, "round_robin")


# wraps the policy a run built (given the run's config): how the layers above the
# simulator add what it cannot import, e.g. bid_price's re-solves (solvers.resolve)
PolicyWrap = Callable[[Policy, LoadedConfig], Policy]


def simulate(
    loaded: LoadedConfig,
    policy_name: str | None = None,
    requests: Sequence[Request] | None = None,
    seed: int | None = None,
    progress: ProgressFn | None = None,
    reference_core: bool = False,
    calibration: assembly.CalibrationSource | None = None,
    wrap: PolicyWrap | None = None,
) -> SimResult:
    """Run one policy (the config's, unless named) on the configured workload. Pass one
    ``calibration`` to several runs to profile only once. ``wrap`` wraps the policy
    built; bid_price with ``prices.resolve_period_s`` set needs one that re-solves
    (``solvers.resolve.resolving``, which ``olproute simulate`` passes): the LP is
    not the simulator's to import, and a config's re-solves are never silently
    dropped."""
    cfg = loaded.config
    run_seed = cfg.sim.seed if seed is None else seed
    name = policy_name or cfg.router.policy
    reqs = list(requests) if requests is not None else build_requests(loaded, run_seed)
    _check_fits(loaded, reqs)
    policy = make_policy(loaded, name, run_seed, calibration)
    if wrap is not None:
        policy = wrap(policy, loaded)
    elif name == "bid_price" and cfg.prices.resolve_period_s is not None:
        raise ConfigError(loaded.path, [(
            "prices.resolve_period_s", "re-solves need the exact LP: run bid_price with "
            "them through olproute simulate / compare, or pass "
            "wrap=solvers.resolve.resolving to simulate")])
    return make_cluster(loaded, policy, run_seed, reference_core).run(reqs, progress)


def make_policy(loaded: LoadedConfig, name: str, seed: int | None = None,
                calibration: assembly.CalibrationSource | None = None) -> Policy:
    """The named policy as a run on ``seed`` (the config's when None) builds it: its
    generator is that seed's policy stream."""
    cfg = loaded.config
    st = streams(cfg.sim.seed if seed is None else seed, len(loaded.specs))
    return build_policy(loaded, name, st.policy, calibration or CalibrationSource(loaded))


def make_replicas(loaded: LoadedConfig, name: str, num_replicas: int, seed: int | None = None,
                  calibration: assembly.CalibrationSource | None = None) -> list[Policy]:
    """``num_replicas`` policies of that name, one per router replica: the first as a run
    on ``seed`` builds its one policy (``make_policy``), replica k > 0 with its own
    generator (seeded by the run seed and k); all on one calibration."""
    if num_replicas < 1:
        raise ValueError("at least one replica")
    run_seed = loaded.config.sim.seed if seed is None else seed
    cal = calibration or CalibrationSource(loaded)
    return [make_policy(loaded, name, run_seed, cal), *(
        build_policy(loaded, name, np.random.default_rng([run_seed, k]), cal)
        for k in range(1, num_replicas))]


def simulate_replicas(
    loaded: LoadedConfig,
    policy_name: str,
    num_replicas: int,
    sync: Sync,
    requests: Sequence[Request] | None = None,
    seed: int | None = None,
    progress: ProgressFn | None = None,
    calibration: assembly.CalibrationSource | None = None,
) -> SimResult:
    """``simulate`` with ``num_replicas`` router replicas of the named policy, their views
    and prices shared as ``sync`` says (``olproute.sim.replicas``); they see what a router
    rebuilds from its traffic whatever the config's ``sim.snapshot_view``."""
    run_seed = loaded.config.sim.seed if seed is None else seed
    reqs = list(requests) if requests is not None else build_requests(loaded, run_seed)
    _check_fits(loaded, reqs)
    policies = make_replicas(loaded, policy_name, num_replicas, run_seed, calibration)
    return make_cluster(loaded, policies, run_seed, sync=sync).run(reqs, progress)


def make_cluster(loaded: LoadedConfig, policy: Policy | Sequence[Policy],
                 seed: int | None = None, reference_core: bool = False,
                 snapshot_age_s: float | None = None, record_batches: bool | None = None,
                 sync: Sync | None = None) -> Cluster:
    """The configuration's engines, timed on ``seed``'s streams, behind ``policy`` (or
    router replicas, one per policy, their sync ``sync``): slot, KV transfer, the snapshot
    view, and the batch log and snapshot age (seconds) of the config unless given.
    Replicas see what a router rebuilds from its traffic (``snapshot_view`` router), with
    no age of their own unless given: their sync is their staleness. The routers' prefix
    index is the config's ``sim.prefix_index``."""
    cfg = loaded.config
    replicas = not isinstance(policy, Policy)
    return Cluster(loaded.specs, build_timers(loaded, seed), policy,
                   slot_s=cfg.router.slot_ms / 1e3,
                   record_batches=(cfg.sim.record_batches if record_batches is None
                                   else record_batches),
                   reference_core=reference_core,
                   snapshot_age_s=(snapshot_age_s if snapshot_age_s is not None else
                                   0.0 if replicas else cfg.sim.snapshot_age_ms / 1e3),
                   transfer=kv_transfer(loaded).seconds,
                   max_held=cfg.admission.max_held,
                   snapshot_view="router" if replicas else cfg.sim.snapshot_view, sync=sync,
                   prefix_index=cfg.sim.prefix_index)


def _check_fits(loaded: LoadedConfig, requests: Sequence[Request]) -> None:
    """Every request must fit in the smallest KV cache, or an engine would reject it."""
    smallest = min(loaded.specs, key=lambda s: s.kv_capacity_tokens)
    for r in requests:
        need = r.prompt_tokens + max([r.decode_tokens, *(r.decode_tokens_by_model or {}).values()])
        if need > smallest.kv_capacity_tokens:
            raise ValueError(
                f"request {r.request_id} needs {need} KV tokens, "
                f"more than instance {smallest.name!r} holds ({smallest.kv_capacity_tokens})")


# -- calibration by a profiling run ---------------------------------------------
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
class Saturation:
    """An instance's behaviour when it always has work: completions per second and the
    mean number of requests per batch (LPS mu and k, BEAR sec. 4.2)."""

    requests_per_s: float
    mean_batch_seqs: float


def _one_instance(loaded: LoadedConfig, g: int) -> LoadedConfig:
    """The config with instance ``g`` alone (one replica, mixed)."""
    spec = loaded.specs[g]
    return loaded.with_updates(instances=(loaded.config.instances[0].model_copy(
        update={"name": spec.name, "model": spec.model, "gpu": spec.gpu,
                "tensor_parallel": spec.tensor_parallel, "replicas": 1,
                "max_num_seqs": spec.max_num_seqs,
                "max_num_batched_tokens": spec.max_num_batched_tokens,
                "block_size": spec.block_size,
                "kv_capacity_tokens": spec.kv_capacity_tokens, "role": "mixed",
                "enable_prefix_caching": spec.enable_prefix_caching}),))


# the profiling sweep of a config without a workload: prompt lengths x concurrency, each
# phase's requests arriving at once with SWEEP_DECODE_TOKENS outputs each
SWEEP_PROMPTS = (16, 64, 256, 1024, 4096)
SWEEP_CONCURRENCY = (1, 4, 16, 64)
SWEEP_DECODE_TOKENS = 32


def sweep_calibration(loaded: LoadedConfig) -> list[InstanceCalibration]:
    """Calibrate every instance on a profiling sweep in the simulator, as the BEAR paper
    profiles its engines: each (prompt length, concurrency) phase alone on the instance,
    prompts up to its context and its KV cache, concurrency up to its ``max_num_seqs``.
    Beta, prefill throughput and TPOT come from all phases' batches; the LPS service rate
    and concurrency from the most concurrent phase of the longest prompt (the instance
    saturated). What ``calibration: auto`` means when the config has no workload (a
    server's: its backends' profiles are the only guess there is until ``olproute
    calibrate --backend`` measures them)."""
    out = []
    for g, spec in enumerate(loaded.specs):
        one = _one_instance(loaded, g)
        context = loaded.profiles.models[spec.model].max_context_tokens
        most = min(context, spec.kv_capacity_tokens) - SWEEP_DECODE_TOKENS
        prompts = [p for p in SWEEP_PROMPTS if p <= most] or [max(most, 1)]
        levels = sorted({min(c, spec.max_num_seqs) for c in SWEEP_CONCURRENCY})
        logs, completions = [], 0
        sat: tuple[float, float] | None = None
        for i, (p, c) in enumerate((p, c) for p in prompts for c in levels):
            c = min(c, max(spec.kv_capacity_tokens // (p + SWEEP_DECODE_TOKENS), 1))
            burst = [Request(k, 0.0, p, SWEEP_DECODE_TOKENS, SWEEP_DECODE_TOKENS, 60.0)
                     for k in range(c)]
            res = simulate(one, "round_robin", burst, seed=loaded.config.sim.seed + 7 + g + i)
            logs.append(res.batch_log)
            finished = np.isfinite(res.finish_s)
            completions += int(finished.sum())
            busy = float(res.batch_log[:, 2].sum())
            k = float((res.batch_log[:, 3] * res.batch_log[:, 2]).sum() / busy)
            sat = (float(finished.sum()) / busy, k)
        assert sat is not None
        log = np.concatenate(logs)
        log[:, 0] = 0.0
        # every output is SWEEP_DECODE_TOKENS long: the sweep says nothing of a
        # workload's service variability (service_scv stays unknown)
        cal = calibrate_log(log, [spec.name], [completions])
        out.append(replace(cal[spec.name], service_rate_per_s=sat[0], mean_batch_seqs=sat[1]))
    return out


def saturation_profile(loaded: LoadedConfig, num_requests: int = 2000) -> list[Saturation]:
    """Every instance, on its own, given ``num_requests`` of the workload's requests at
    time 0; measured between the 20th and 80th percentile completions, away from the
    start-up and drain transients."""
    reqs = build_requests(loaded)[:num_requests]
    out = []
    for g in range(len(loaded.specs)):
        burst = [replace(r, arrival_s=0.0, request_id=i) for i, r in enumerate(reqs)]
        one = _one_instance(loaded, g)
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
