"""A configured workload as the run's requests: arrivals and lengths (or generated
prompts), TTFT and TPOT targets, and the router's predictions per model of the pool.

Randomness is split by purpose from the run seed (numpy ``SeedSequence.spawn``), so every
policy compared on a seed sees the same requests, targets and predicted lengths, and a
policy's own coin flips never shift the workload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from olproute.config.loader import (
    ConfigError,
    LoadedConfig,
    prediction_problems,
    workload_block_problems,
)
from olproute.routing.prefix_index import text_block_hashes
from olproute.sim import workloads as wl
from olproute.sim.mooncake import load_mooncake
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
    """Arrivals and lengths of the configured workload (kind mooncake: with the prompts'
    block hashes)."""
    w = loaded.config.workload
    if w.kind in ("trace", "mooncake"):
        assert w.path is not None
        if w.kind == "mooncake":
            trace = load_mooncake(loaded.resolve(w.path), w.block_tokens, w.time_scale)
        else:
            trace = wl.read_trace_csv(loaded.resolve(w.path), time_scale=w.time_scale)
        if w.rate_per_s is not None:
            trace = trace.rescaled(wl.trace_time_scale_for_rate(trace, w.rate_per_s))
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
    loaded.require_workload()
    cfg = loaded.config
    st = streams(cfg.sim.seed if seed is None else seed, len(loaded.specs))
    problems = prediction_problems(cfg.prediction, cfg.workload.kind)
    problems += workload_block_problems(cfg.workload, loaded.specs)
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
    # the truth stands in for the prediction until _lengths_by_model draws it (one true
    # length on every model, each model's prediction with its own noise)
    reqs = wl.build_requests(trace, ttft_target, trace.decode_tokens, tpot_target, classes)
    noise = cfg.prediction.noise if cfg.prediction.mode == "noisy" else 0.0
    models = pool_models(loaded)
    return _with_predictions(reqs, models, _lengths_by_model(reqs, models, noise, st), None)


def synthetic_prompts(loaded: LoadedConfig, seed: int | None = None) -> list[Request]:
    """The requests of a ``synthetic`` workload as ``build_requests`` draws them on
    ``seed`` (the config's ``sim.seed`` when None): generated prompt texts with every pool
    model's true output length (``decode_tokens_by_model``) and arrivals, before SLO
    classes and predictions. The emulator reads its output lengths from these, so a live
    run and its simulation share the truth. Raises ConfigError for another workload kind."""
    if loaded.config.workload.kind != "synthetic":
        raise ConfigError(loaded.path, [("workload.kind", "synthetic prompts need kind "
                                         f"'synthetic', not {loaded.config.workload.kind!r}")])
    return _synthetic_drawn(loaded, streams(loaded.config.sim.seed if seed is None else seed,
                                            len(loaded.specs)))


def _synthetic_drawn(loaded: LoadedConfig, st: Streams) -> list[Request]:
    """Generated prompts with Poisson (or MMPP-2, ``workload.arrivals``) arrivals and
    per-model truth, drawn from ``st.workload``."""
    from olproute.sim.prompts import synthetic_requests

    w = loaded.config.workload
    assert w.rate_per_s is not None
    n = w.num_requests if w.num_requests is not None else int(
        np.ceil(w.rate_per_s * (w.duration_s or 0.0)))
    if w.arrivals == "mmpp2":
        arrivals = wl.mmpp2_arrivals(w.rate_per_s, w.ratio, n, st.workload).arrival_s
    else:
        arrivals = wl.poisson_arrivals(w.rate_per_s, n, st.workload)
    if w.duration_s is not None:
        arrivals = arrivals[arrivals < w.duration_s]
    return synthetic_requests(len(arrivals), arrivals, [s.model for s in loaded.specs],
                              st.workload)


def _synthetic_requests(loaded: LoadedConfig, st: Streams) -> list[Request]:
    """``_synthetic_drawn``'s requests with their SLO classes (``slo.mode: classes``),
    their prompts' block hashes (``workload.prefix_hashes``) and the router's predictions
    for every model of the pool (``_predict_per_model``)."""
    cfg = loaded.config
    reqs = _synthetic_drawn(loaded, st)
    if cfg.workload.prefix_hashes:
        reqs = with_block_hashes(reqs, cfg.workload.block_tokens)
    if cfg.slo.mode == "classes":
        slo = [wl.SloClass(c.name, c.ttft_ms / 1e3, c.tpot_ms / 1e3, c.weight)
               for c in cfg.slo.classes]
        idx = wl.assign_slo_classes(len(reqs), slo, st.targets).tolist()
        reqs = [replace(r, ttft_target_s=slo[i].ttft_s, tpot_target_s=slo[i].tpot_s,
                        slo_class=slo[i].name) for r, i in zip(reqs, idx, strict=True)]
    return _predict_per_model(loaded, reqs, st)


def with_block_hashes(reqs: list[Request], block_size: int) -> list[Request]:
    """The requests carrying their prompt texts' block hashes
    (``olproute.routing.prefix_index.text_block_hashes``: blocks of ``block_size`` words, as the
    router names a live prompt's), at most one per full block of ``prompt_tokens``; a
    request without text carries none."""
    return [r if r.text is None else replace(r, block_hashes=text_block_hashes(
        r.text, block_size, r.prompt_tokens // block_size)) for r in reqs]


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
    decode = _lengths_by_model(reqs, models, noise, st)
    quality: dict[str, list[float]] = {}
    for m in models:
        q = np.array([(r.quality_by_model or {}).get(m, 0.0) for r in reqs])
        quality[m] = wl.predicted_quality(q, q_noise, st.predict_quality).tolist()
    return _with_predictions(reqs, models, decode, quality)


def _lengths_by_model(reqs: list[Request], models: list[str], noise: float,
                      st: Streams) -> dict[str, list[int]]:
    """Each model's predicted lengths: its true length times its own uniform factor in
    [1 - noise, 1 + noise] (the first model's from the ``predict`` stream, the others'
    from ``predict_models``)."""
    decode: dict[str, list[int]] = {}
    for k, m in enumerate(models):
        truth = np.array([r.true_decode_tokens(m) for r in reqs], dtype=np.int64)
        rng = st.predict if k == 0 else st.predict_models
        decode[m] = wl.predicted_decode_tokens(truth, noise, rng).tolist()
    return decode


def _with_predictions(reqs: list[Request], models: list[str],
                      decode: dict[str, list[int]],
                      quality: dict[str, list[float]] | None) -> list[Request]:
    """The requests carrying these per-model predictions (the first model's length also
    as ``predicted_decode_tokens``)."""
    return [replace(r, predicted_decode_tokens=decode[models[0]][i],
                    predicted_decode_by_model={m: decode[m][i] for m in models},
                    predicted_quality_by_model=(None if quality is None else
                                                {m: quality[m][i] for m in models}))
            for i, r in enumerate(reqs)]
