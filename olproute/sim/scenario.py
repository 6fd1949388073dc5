"""From a loaded config to a simulation run: requests, timers, policy, cluster.

Randomness is split by purpose from the run seed (numpy ``SeedSequence.spawn``), so every
policy compared on a seed sees the same requests, targets and predicted lengths, and a
policy's own coin flips never shift the workload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from olproute.calibration import CalibrationError, InstanceCalibration, read_calibration
from olproute.config import ConfigError, LoadedConfig, prediction_problems
from olproute.disagg import KvTransfer
from olproute.outlook import OutlookSource
from olproute.policies import REGISTRY, Policy, PolicyEnv
from olproute.sim import workloads as wl
from olproute.sim.cluster import Cluster, ProgressFn, SimResult
from olproute.sim.engine import BatchTimer
from olproute.sim.timing import LinearTiming, RooflineTiming
from olproute.types import Request

# Child seed streams of the run seed, by purpose. Later purposes are appended, so the
# earlier streams (and the runs made with them) stay as they were.
_WORKLOAD, _TARGETS, _PREDICT, _POLICY, _ENGINES, _PREDICT_MODELS, _PREDICT_QUALITY = range(7)


@dataclass(frozen=True, slots=True)
class Streams:
    workload: np.random.Generator
    targets: np.random.Generator
    predict: np.random.Generator          # the first model's predicted lengths
    policy: np.random.Generator
    engine_seeds: tuple[np.random.SeedSequence, ...]
    predict_models: np.random.Generator   # the other models' predicted lengths
    predict_quality: np.random.Generator  # predicted quality, every model


def streams(seed: int, num_instances: int) -> Streams:
    root = np.random.SeedSequence(seed)
    kids = root.spawn(7)
    return Streams(
        workload=np.random.default_rng(kids[_WORKLOAD]),
        targets=np.random.default_rng(kids[_TARGETS]),
        predict=np.random.default_rng(kids[_PREDICT]),
        policy=np.random.default_rng(kids[_POLICY]),
        engine_seeds=tuple(kids[_ENGINES].spawn(num_instances)),
        predict_models=np.random.default_rng(kids[_PREDICT_MODELS]),
        predict_quality=np.random.default_rng(kids[_PREDICT_QUALITY]),
    )


def pool_models(loaded: LoadedConfig) -> list[str]:
    """The pool's distinct models, in the order of their first instance."""
    return list(dict.fromkeys(s.model for s in loaded.specs))


def _lengths(loaded: LoadedConfig, n: int, rng: np.random.Generator) -> tuple[
        np.ndarray, np.ndarray]:
    w = loaded.config.workload
    if w.lengths_path is None:
        assert w.prompt_tokens is not None and w.decode_tokens is not None
        return (np.full(n, w.prompt_tokens, dtype=np.int64),
                np.full(n, w.decode_tokens, dtype=np.int64))
    prompt, decode = wl.read_lengths_csv(loaded.resolve(w.lengths_path))
    order = rng.permutation(len(prompt))
    return prompt[order], decode[order]


def build_trace(loaded: LoadedConfig, rng: np.random.Generator) -> wl.Trace:
    """Arrivals and lengths of the configured workload."""
    w = loaded.config.workload
    if w.kind == "trace":
        assert w.path is not None
        trace = wl.read_trace_csv(loaded.resolve(w.path), time_scale=w.time_scale)
        if w.rate_per_s is not None:
            factor = wl.trace_time_scale_for_rate(trace, w.rate_per_s)
            trace = wl.Trace(trace.arrival_s * factor, trace.prompt_tokens, trace.decode_tokens)
        if w.start_s > 0 or w.duration_s is not None:
            end = w.start_s + w.duration_s if w.duration_s is not None else np.inf
            trace = trace.window(w.start_s, float(end))
        if w.num_requests is not None:
            trace = trace.head(min(w.num_requests, len(trace)))
        return trace
    assert w.rate_per_s is not None
    n = w.num_requests if w.num_requests is not None else int(
        np.ceil(w.rate_per_s * (w.duration_s or 0.0)))
    if w.kind == "poisson":
        arrivals = wl.poisson_arrivals(w.rate_per_s, n, rng)
    else:
        arrivals = wl.mmpp2_arrivals(w.rate_per_s, w.ratio, n, rng).arrival_s
    if w.duration_s is not None:
        arrivals = arrivals[arrivals < w.duration_s]
    prompt, decode = _lengths(loaded, len(arrivals), rng)
    return wl.lengths_with_arrivals(prompt, decode, arrivals)


def build_requests(loaded: LoadedConfig, seed: int | None = None) -> list[Request]:
    """The run's requests with TTFT (and TPOT) targets and predicted decode lengths."""
    cfg = loaded.config
    st = streams(cfg.sim.seed if seed is None else seed, len(loaded.specs))
    problems = prediction_problems(cfg.prediction, cfg.workload.kind)
    if problems:
        raise ConfigError(loaded.path, problems)
    if cfg.workload.kind == "synthetic":
        return _synthetic_requests(loaded, st)
    trace = build_trace(loaded, st.workload)
    n = len(trace)
    tpot_target = None
    classes = None
    if cfg.slo.mode == "bear":
        ttft_target = wl.bear_ttft_targets_s(trace.prompt_tokens, st.targets)
    else:
        slo = [wl.SloClass(c.name, c.ttft_ms / 1e3, c.tpot_ms / 1e3, c.weight)
               for c in cfg.slo.classes]
        idx = wl.assign_slo_classes(n, slo, st.targets)
        ttft_target = np.array([slo[i].ttft_s for i in idx])
        tpot_target = np.array([slo[i].tpot_s for i in idx])
        classes = [slo[i].name for i in idx]
    noise = cfg.prediction.noise if cfg.prediction.mode == "noisy" else 0.0
    predicted = wl.predicted_decode_tokens(trace.decode_tokens, noise, st.predict)
    reqs = wl.build_requests(trace, ttft_target, predicted, tpot_target, classes)
    models = pool_models(loaded)
    if len(models) == 1:
        return reqs
    # one true length on every model: each other model's prediction has its own noise
    by_model = {models[0]: predicted.tolist()} | {
        m: wl.predicted_decode_tokens(trace.decode_tokens, noise, st.predict_models).tolist()
        for m in models[1:]}
    return [replace(r, predicted_decode_by_model={m: by_model[m][i] for m in models})
            for i, r in enumerate(reqs)]


def _synthetic_requests(loaded: LoadedConfig, st: Streams) -> list[Request]:
    """Generated prompts with Poisson (or MMPP-2, ``workload.arrivals``) arrivals and
    per-model truth, and the router's predictions for every model of the pool
    (``_predict_per_model``)."""
    from olproute.sim.prompts import synthetic_requests

    cfg, w = loaded.config, loaded.config.workload
    assert w.rate_per_s is not None
    n = w.num_requests if w.num_requests is not None else int(
        np.ceil(w.rate_per_s * (w.duration_s or 0.0)))
    if w.arrivals == "mmpp2":
        arrivals = wl.mmpp2_arrivals(w.rate_per_s, w.ratio, n, st.workload).arrival_s
    else:
        arrivals = wl.poisson_arrivals(w.rate_per_s, n, st.workload)
    if w.duration_s is not None:
        arrivals = arrivals[arrivals < w.duration_s]
    reqs = synthetic_requests(len(arrivals), arrivals, [s.model for s in loaded.specs],
                              st.workload)
    if cfg.slo.mode == "classes":
        slo = [wl.SloClass(c.name, c.ttft_ms / 1e3, c.tpot_ms / 1e3, c.weight)
               for c in cfg.slo.classes]
        idx = wl.assign_slo_classes(len(reqs), slo, st.targets).tolist()
        reqs = [replace(r, ttft_target_s=slo[i].ttft_s, tpot_target_s=slo[i].tpot_s,
                        slo_class=slo[i].name) for r, i in zip(reqs, idx, strict=True)]
    return _predict_per_model(loaded, reqs, st)


def _predict_per_model(loaded: LoadedConfig, reqs: list[Request],
                       st: Streams) -> list[Request]:
    """Per-model predictions of length and quality, by ``prediction.mode``: the truth
    (oracle); the truth with independent uniform noise per model (noisy; the first
    model's lengths from the ``predict`` stream, the others' from ``predict_models``,
    quality from ``predict_quality``); or the trained predictor on the prompt text."""
    pred = loaded.config.prediction
    models = pool_models(loaded)
    if pred.mode == "predictor":
        from olproute.predict import Predictor, apply_predictor

        assert pred.model_dir is not None
        return apply_predictor(reqs, Predictor.load(loaded.resolve(pred.model_dir)), models)
    noise, q_noise = (pred.noise, pred.quality_noise) if pred.mode == "noisy" else (0.0, 0.0)
    decode: dict[str, list[int]] = {}
    quality: dict[str, list[float]] = {}
    for k, m in enumerate(models):
        truth = np.array([r.true_decode_tokens(m) for r in reqs], dtype=np.int64)
        rng = st.predict if k == 0 else st.predict_models
        decode[m] = wl.predicted_decode_tokens(truth, noise, rng).tolist()
    for m in models:
        q = np.array([(r.quality_by_model or {}).get(m, 0.0) for r in reqs])
        quality[m] = wl.predicted_quality(q, q_noise, st.predict_quality).tolist()
    return [replace(r, predicted_decode_tokens=decode[models[0]][i],
                    predicted_decode_by_model={m: decode[m][i] for m in models},
                    predicted_quality_by_model={m: quality[m][i] for m in models})
            for i, r in enumerate(reqs)]


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


class CalibrationSource:
    """The calibration estimating policies use, built on first use and then kept:
    ``calibration: auto`` profiles the scenario on another seed (round robin) and
    saturates each instance; otherwise the YAML file of ``olproute calibrate``."""

    def __init__(self, loaded: LoadedConfig,
                 known: Sequence[InstanceCalibration] | None = None) -> None:
        self._loaded = loaded
        self._value: tuple[InstanceCalibration, ...] | None = (
            None if known is None else tuple(known))

    def __call__(self) -> tuple[InstanceCalibration, ...]:
        if self._value is None:
            self._value = self._build()
        return self._value

    def _build(self) -> tuple[InstanceCalibration, ...]:
        loaded = self._loaded
        source = loaded.config.calibration
        if source == "auto":
            from olproute.sim.estimate_eval import profile_calibration

            return tuple(profile_calibration(loaded, "round_robin"))
        path = loaded.resolve(source)
        try:
            by_name = read_calibration(path)
        except CalibrationError as exc:
            raise ConfigError(loaded.path, [("calibration", str(exc))]) from exc
        missing = [s.name for s in loaded.specs if s.name not in by_name]
        if missing:
            raise ConfigError(loaded.path, [("calibration", f"{path} has no entry for "
                                             f"instance(s) {', '.join(missing)}")])
        return tuple(by_name[s.name] for s in loaded.specs)


def outlook_source(loaded: LoadedConfig) -> OutlookSource:
    """Per-request expectations in the configured prediction mode."""
    cfg = loaded.config
    predictor = None
    if cfg.prediction.mode == "predictor":
        from olproute.predict import Predictor

        assert cfg.prediction.model_dir is not None
        predictor = Predictor.load(loaded.resolve(cfg.prediction.model_dir))
    return OutlookSource(loaded.specs, loaded.profiles, cfg.prediction.mode, predictor)


def policy_env(loaded: LoadedConfig, name: str, rng: np.random.Generator,
               calibration: CalibrationSource | None = None) -> PolicyEnv:
    """Everything a policy is built from, for this configuration."""
    cfg = loaded.config
    return PolicyEnv(
        specs=loaded.specs, rng=rng, params=cfg.router.policy_params.get(name, {}),
        slot_s=cfg.router.slot_ms / 1e3, horizon_slots=cfg.router.horizon_slots,
        reward=cfg.reward, prices=cfg.prices, admission=cfg.admission,
        calibration_source=calibration or CalibrationSource(loaded),
        outlook_source=outlook_source(loaded), transfer_s=kv_transfer(loaded).seconds)


def simulate(
    loaded: LoadedConfig,
    policy_name: str | None = None,
    requests: Sequence[Request] | None = None,
    seed: int | None = None,
    progress: ProgressFn | None = None,
    reference_core: bool = False,
    calibration: CalibrationSource | None = None,
) -> SimResult:
    """Run one policy (the config's, unless named) on the configured workload. Pass one
    ``calibration`` to several runs to profile only once."""
    cfg = loaded.config
    run_seed = cfg.sim.seed if seed is None else seed
    name = policy_name or cfg.router.policy
    reqs = list(requests) if requests is not None else build_requests(loaded, run_seed)
    _check_fits(loaded, reqs)
    policy = make_policy(loaded, name, run_seed, calibration)
    return make_cluster(loaded, policy, run_seed, reference_core).run(reqs, progress)


def make_policy(loaded: LoadedConfig, name: str, seed: int | None = None,
                calibration: CalibrationSource | None = None) -> Policy:
    """The named policy as a run on ``seed`` (the config's when None) builds it: its
    generator is that seed's policy stream."""
    cfg = loaded.config
    st = streams(cfg.sim.seed if seed is None else seed, len(loaded.specs))
    return REGISTRY.create(name, policy_env(loaded, name, st.policy, calibration))


def make_cluster(loaded: LoadedConfig, policy: Policy, seed: int | None = None,
                 reference_core: bool = False, snapshot_age_s: float | None = None,
                 record_batches: bool | None = None) -> Cluster:
    """The configuration's engines, timed on ``seed``'s streams, behind ``policy``: slot,
    KV transfer, and the batch log and snapshot age (seconds) of the config unless
    given."""
    cfg = loaded.config
    return Cluster(loaded.specs, build_timers(loaded, seed), policy,
                   slot_s=cfg.router.slot_ms / 1e3,
                   record_batches=(cfg.sim.record_batches if record_batches is None
                                   else record_batches),
                   reference_core=reference_core,
                   snapshot_age_s=(cfg.sim.snapshot_age_ms / 1e3 if snapshot_age_s is None
                                   else snapshot_age_s),
                   transfer=kv_transfer(loaded).seconds,
                   max_held=cfg.admission.max_held)


def kv_transfer(loaded: LoadedConfig) -> KvTransfer:
    """The KV transfer time between this configuration's pools (its one model)."""
    model = loaded.profiles.models[loaded.specs[0].model]
    return KvTransfer.of(model, loaded.config.transfer)


def _check_fits(loaded: LoadedConfig, requests: Sequence[Request]) -> None:
    """Every request must fit in the smallest KV cache, or an engine would reject it."""
    smallest = min(loaded.specs, key=lambda s: s.kv_capacity_tokens)
    for r in requests:
        need = r.prompt_tokens + max([r.decode_tokens, *(r.decode_tokens_by_model or {}).values()])
        if need > smallest.kv_capacity_tokens:
            raise ValueError(
                f"request {r.request_id} needs {need} KV tokens, "
                f"more than instance {smallest.name!r} holds ({smallest.kv_capacity_tokens})")
