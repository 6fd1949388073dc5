"""Benchmark of the predictors: request-path latency and training time.

    python bench/bench_predict.py [--json PATH] [--calls N] [--no-contention]

Latency is the request path, ``Predictor.predict(prompt, models)`` (features of one
prompt, then one single-threaded ``Booster.predict`` per head on one row per distinct
model), for 8 instances; a single-row ``Booster.predict`` measured in the same run is the
reference. Featurisation is timed per prompt on the compiled kernel and on its Python
twin in the same run (prompts of ~50 and ~2k tokens), and one ``predict()`` is split into
its parts (features, PCA, the heads, the rest). Training is on 20k synthetic rows
(num_threads=2), with the held-out figures.
With contention on (the default), a busy process is started beside the benchmark to show
why the request path pins LightGBM to one thread; it is ended before the script exits.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute.config.loader import load_profiles
from olproute.predict import (
    Featurizer,
    Predictor,
    TrainConfig,
    evaluate,
    featurize_prompts,
    split_prompts,
    train_predictor,
)
from olproute.sim.prompts import MODELS, TASKS, generate_prompts, training_data

REPO = Path(__file__).resolve().parents[1]
BEAR_POOL = ("qwen3-0.6b", "qwen3-0.6b", "qwen3-0.6b", "qwen3-8b", "qwen3-8b", "qwen3-8b",
             "qwen3-32b", "qwen3-32b")  # 8 instances of 3 models
SIX_MODELS = (*MODELS, "qwen3-8b", "qwen3-32b")  # 8 instances of 6 models
GOAL_P50_US = 150.0
TRAIN_ROWS = 20_000


def _percentiles_us(fn: Callable[[], object], calls: int) -> tuple[float, float, float]:
    for _ in range(min(200, calls)):
        fn()
    times = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - t0
    p50, p90, p99 = np.percentile(times, [50, 90, 99]) / 1e3
    return float(p50), float(p90), float(p99)


def _train(seed: int) -> tuple[Predictor, dict[str, Any]]:
    profiles = load_profiles(REPO / "configs" / "profiles.yaml")
    traits = {n: (m.num_params, m.max_context_tokens) for n, m in profiles.models.items()}
    num_prompts = -(-TRAIN_ROWS // len(MODELS))
    t0 = time.perf_counter()
    data = training_data(generate_prompts(num_prompts, list(MODELS), np.random.default_rng(seed)))
    t1 = time.perf_counter()
    features = featurize_prompts(data.prompts)
    t2 = time.perf_counter()
    config = TrainConfig(num_threads=2, seed=seed)
    train_p, test_p = split_prompts(len(data.prompts), 0.2, seed)
    predictor = train_predictor(data, features, train_p, traits, config)
    t3 = time.perf_counter()
    ev = evaluate(predictor, data, features, train_p, test_p)
    return predictor, {
        "rows": len(data), "prompts": len(data.prompts), "train_rows": ev.num_train_rows,
        "generate_s": t1 - t0, "features_s": t2 - t1, "train_heads_s": t3 - t2,
        "heads": 3 if config.p90 else 2, "evaluation": ev.as_dict()}


def _busy_neighbour() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _latency(predictor: Predictor, calls: int, contention: bool) -> dict[str, Any]:
    prompts = generate_prompts(400, list(MODELS), np.random.default_rng(12345))
    by_task = {t: [p.text for p in prompts if p.task == t] for t in TASKS}
    short = by_task["instruction"] + by_task["creative"]
    tokens = {t: float(np.median([p.prompt_tokens for p in prompts if p.task == t]))
              for t in TASKS}
    out: dict[str, Any] = {"prompt_tokens_median": tokens}

    def cycle(texts: Sequence[str]) -> Callable[[], str]:
        it = itertools.cycle(texts)
        return lambda: next(it)

    nxt = cycle(short)
    out["features_short"] = _percentiles_us(lambda: predictor.prompt_features(nxt()), calls)
    for task in ("doc_qa", "summarization"):
        nt = cycle(by_task[task])
        out[f"features_{task}"] = _percentiles_us(lambda nt=nt: predictor.prompt_features(nt()),
                                                  max(200, calls // 10))
    out["predict_8inst_3models"] = _percentiles_us(lambda: predictor.predict(nxt(), BEAR_POOL),
                                                   calls)
    out["predict_8inst_6models"] = _percentiles_us(lambda: predictor.predict(nxt(), SIX_MODELS),
                                                   calls)
    out["predict_8inst_3models_p90"] = _percentiles_us(
        lambda: predictor.predict(nxt(), BEAR_POOL, p90=True), calls)
    for task in ("doc_qa", "summarization"):
        nt = cycle(by_task[task])
        out[f"predict_8inst_3models_{task}"] = _percentiles_us(
            lambda nt=nt: predictor.predict(nt(), BEAR_POOL), max(200, calls // 10))
    pool_ids = predictor.model_ids(list(dict.fromkeys(BEAR_POOL)))

    def via_booster_predict() -> object:  # the same request, one Booster.predict per head
        return predictor.predict_matrix(predictor.rows(predictor.prompt_features(nxt()),
                                                       pool_ids))

    out["predict_booster_path_3models"] = _percentiles_us(via_booster_predict, calls)
    f = predictor.prompt_features(short[0])
    ids8 = predictor.model_ids(SIX_MODELS)
    x8 = predictor.rows(f, ids8)
    x1 = np.ascontiguousarray(x8[:1])
    booster = predictor._decode  # the reference is one raw Booster.predict call
    heads = predictor._row_heads
    out["fast_heads_8rows"] = _percentiles_us(lambda: (heads.predict(0, x8),
                                                       heads.predict(1, x8)), calls)
    out["booster_heads_8rows"] = _percentiles_us(lambda: predictor.predict_matrix(x8), calls)
    out["booster_1row"] = _percentiles_us(lambda: booster.predict(x1, num_threads=1), calls)
    out["booster_8rows"] = _percentiles_us(lambda: booster.predict(x8, num_threads=1), calls)
    if contention:
        busy = _busy_neighbour()
        try:
            time.sleep(0.3)
            out["busy_predict_8inst_3models"] = _percentiles_us(
                lambda: predictor.predict(nxt(), BEAR_POOL), calls)
            out["busy_booster_8rows_1thread"] = _percentiles_us(
                lambda: booster.predict(x8, num_threads=1), calls)
            out["busy_booster_8rows_2threads"] = _percentiles_us(
                lambda: booster.predict(x8, num_threads=2), calls)
        finally:
            busy.terminate()
            busy.wait()
    return out


def _featurize(predictor: Predictor, calls: int) -> dict[str, Any]:
    """Per prompt, compiled kernel against the Python twin, and one predict() in parts."""
    prompts = generate_prompts(400, list(MODELS), np.random.default_rng(12345))
    sizes = {"short": (50, 30), "2k": (2000, 20)}  # tokens: the prompts nearest, how many
    compiled = Featurizer(predictor.spec.num_hash_dims)
    twin = Featurizer(predictor.spec.num_hash_dims, compiled=False)
    out: dict[str, Any] = {}
    for size, (tokens, num_prompts) in sizes.items():
        chosen = sorted(prompts, key=lambda p, t=tokens: abs(p.prompt_tokens - t))[:num_prompts]
        texts = [p.text for p in chosen]
        n = calls if size == "short" else max(200, calls // 10)
        c_it, p_it = itertools.cycle(texts), itertools.cycle(texts)
        c = _percentiles_us(lambda it=c_it: compiled.stats_and_hashed(next(it)), n)
        py = _percentiles_us(lambda it=p_it: twin.stats_and_hashed(next(it)), n)
        out[size] = {"prompts": len(texts),
                     "prompt_tokens_median": float(np.median([p.prompt_tokens for p in chosen])),
                     "compiled": c, "python": py, "ratio_p50": py[0] / c[0]}
        out[f"predict_parts_{size}"] = _predict_parts(predictor, texts, n)
    return out


def _predict_parts(predictor: Predictor, texts: Sequence[str], calls: int) -> dict[str, float]:
    """p50 us of one predict() (8 instances of 3 models) and of its parts on the same
    prompts: stats and hashed vector, PCA, the decode and quality heads on the rows."""
    it = itertools.cycle(texts)
    pf = predictor.prompt_features(texts[0])
    x = predictor.rows(pf, predictor.model_ids(list(dict.fromkeys(BEAR_POOL))))
    heads, featurizer = predictor._row_heads, predictor._featurizer
    hashed = featurizer.stats_and_hashed(texts[0])[1]
    parts = {
        "predict": _percentiles_us(lambda: predictor.predict(next(it), BEAR_POOL), calls)[0],
        "stats_and_hashed": _percentiles_us(
            lambda: featurizer.stats_and_hashed(next(it)), calls)[0],
        "pca_project": _percentiles_us(lambda: predictor.pca.project(hashed), calls)[0],
        "heads": _percentiles_us(lambda: (heads.predict(0, x), heads.predict(1, x)), calls)[0],
    }
    parts["rest"] = parts["predict"] - sum(v for k, v in parts.items() if k != "predict")
    return parts


def _featurize_table(feat: dict[str, Any]) -> str:
    lines = [f"{'featurize one prompt (us, p50)':<58} {'compiled':>8} {'python':>8} "
             f"{'ratio':>8}", "-" * 85]
    for size in ("short", "2k"):
        f = feat[size]
        label = (f"stats_and_hashed, ~{f['prompt_tokens_median']:,.0f} tokens "
                 f"({f['prompts']} prompts)")
        lines.append(f"{label:<58} {f['compiled'][0]:8.1f} {f['python'][0]:8.1f} "
                     f"{f['ratio_p50']:7.1f}x")
    lines += ["", f"{'one predict(), 8 instances of 3 models (us, p50)':<58} "
                  f"{'short':>8} {'2k':>8}", "-" * 85]
    for key, label in (("predict", "predict()"), ("stats_and_hashed", "  stats and hashed vector"),
                       ("pca_project", "  PCA projection"),
                       ("heads", "  2 heads x 3 rows, single-row fast path"),
                       ("rest", "  the rest (rows, plan, output)")):
        lines.append(f"{label:<58} {feat['predict_parts_short'][key]:8.1f} "
                     f"{feat['predict_parts_2k'][key]:8.1f}")
    return "\n".join(lines)


def _table(train: dict[str, Any], lat: dict[str, Any]) -> str:
    ev = train["evaluation"]
    rows: list[tuple[str, str]] = []

    def us(key: str) -> str:
        p50, p90, p99 = lat[key]
        return f"{p50:8.1f} {p90:8.1f} {p99:8.1f}"

    tok = lat["prompt_tokens_median"]
    lines = [f"{'request path (us)':<58} {'p50':>8} {'p90':>8} {'p99':>8}", "-" * 85]
    spec = [
        ("features, short prompt (instruction / creative)", "features_short"),
        (f"features, doc_qa prompt (~{tok['doc_qa']:,.0f} tokens)", "features_doc_qa"),
        (f"features, summarization prompt (~{tok['summarization']:,.0f} tokens)",
         "features_summarization"),
        ("predict(), 8 instances of 3 models, short prompt", "predict_8inst_3models"),
        ("predict(), 8 instances of 6 models, short prompt", "predict_8inst_6models"),
        ("predict(p90=True), 8 instances of 3 models", "predict_8inst_3models_p90"),
        ("predict(), 8 instances of 3 models, doc_qa prompt", "predict_8inst_3models_doc_qa"),
        ("predict(), 8 instances of 3 models, summarization",
         "predict_8inst_3models_summarization"),
        ("same request, heads by Booster.predict (1 call per head)",
         "predict_booster_path_3models"),
        ("2 heads x 8 rows, single-row fast path", "fast_heads_8rows"),
        ("2 heads x 8 rows, one Booster.predict per head", "booster_heads_8rows"),
        ("reference: 1 Booster.predict, 1 row (decode head)", "booster_1row"),
        ("reference: 1 Booster.predict, 8 rows (decode head)", "booster_8rows"),
    ]
    if "busy_booster_8rows_2threads" in lat:
        spec += [("busy neighbour: predict(), 8 instances of 3 models",
                  "busy_predict_8inst_3models"),
                 ("busy neighbour: 1 Booster.predict, 8 rows, num_threads=1",
                  "busy_booster_8rows_1thread"),
                 ("busy neighbour: 1 Booster.predict, 8 rows, num_threads=2",
                  "busy_booster_8rows_2threads")]
    lines += [f"{label:<58} {us(key)}" for label, key in spec]
    headline = lat["predict_8inst_3models"][0]
    verdict = "met" if headline <= GOAL_P50_US else "MISSED"
    lines.append(f"predict() p50, 8 instances / 3 models: {headline:.0f} us (goal <= "
                 f"{GOAL_P50_US:.0f}: {verdict}); "
                 f"{headline / lat['booster_1row'][0]:.1f}x one single-row Booster.predict, "
                 f"{lat['predict_booster_path_3models'][0] / headline:.2f}x faster than "
                 "heads by Booster.predict")
    lines.append(f"fast path vs Booster.predict, 2 heads x 8 rows: "
                 f"{lat['booster_heads_8rows'][0] / lat['fast_heads_8rows'][0]:.2f}x at p50")
    if "busy_booster_8rows_2threads" in lat:
        one, two = lat["busy_booster_8rows_1thread"], lat["busy_booster_8rows_2threads"]
        lines.append(f"busy neighbour, 2 threads vs 1: p50 {two[0] / one[0]:.1f}x, "
                     f"p99 {two[2] / one[2]:.1f}x")
    d = ev["decode"]
    rows = [
        ("training rows / prompts", f"{train['rows']:,} / {train['prompts']:,} "
                                    f"({train['train_rows']:,} rows trained, rest held out)"),
        ("generate synthetic prompts", f"{train['generate_s']:.2f} s"),
        ("features (tokenize, hash, PCA)", f"{train['features_s']:.2f} s"),
        (f"train {train['heads']} heads (num_threads=2)", f"{train['train_heads_s']:.2f} s"),
        ("held-out decode MAE: predictor / per-task mean",
         f"{d['predictor']['mae_tokens']:.1f} / {d['per-task mean']['mae_tokens']:.1f} tokens"),
        ("held-out decode MAPE: predictor / per-task mean",
         f"{d['predictor']['mape']:.3f} / {d['per-task mean']['mape']:.3f}"),
        ("held-out decode R2: predictor / per-task mean",
         f"{d['predictor']['r2']:.3f} / {d['per-task mean']['r2']:.3f}"),
        ("held-out quality Spearman: all rows / within task+model",
         f"{ev['quality']['spearman']:.3f} / {ev['quality']['spearman_within_task_model']:.3f}"),
    ]
    lines += ["", f"{'training':<58} value", "-" * 85]
    lines += [f"{k:<58} {v}" for k, v in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser)
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per measure")
    parser.add_argument("--no-contention", action="store_true",
                        help="skip the busy-neighbour measures")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    begin(args, parser, None if argv is None else [sys.argv[0], *argv])
    predictor, train = _train(args.seed)
    lat = _latency(predictor, args.calls, not args.no_contention)
    feat = _featurize(predictor, args.calls)
    print(_table(train, lat))
    print()
    print(_featurize_table(feat))
    if args.json:
        write_results(args.json, {"training": train, "latency_us": lat,
                                  "goal_p50_us": GOAL_P50_US, "featurize": feat}, [args.seed])
    return 0


if __name__ == "__main__":
    sys.exit(main())
