"""Training: reading training files (CSV or JSON lines), featurising prompts, splitting
by prompt and fitting the three LightGBM heads."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from olproute.predict.features import (
    NUM_HASH_DIMS,
    NUM_PCA,
    STAT_NAMES,
    FeatureSpec,
    Featurizer,
    ModelTraits,
    PredictorError,
    fit_pca,
)
from olproute.predict.predictor import Predictor

if TYPE_CHECKING:
    import lightgbm

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# -- training data ---------------------------------------------------------------------------
REQUIRED_COLUMNS = ("prompt", "model", "output_tokens", "quality")


@dataclass(frozen=True, slots=True, eq=False)
class TrainingData:
    """Rows of (prompt, model, output tokens, quality); prompts stored once.

    ``prompt_index``, ``models``, ``output_tokens`` and ``quality`` are per row; ``prompts``
    and ``tasks`` (None where unknown) per distinct prompt.
    """

    prompts: tuple[str, ...]
    tasks: tuple[str | None, ...]
    prompt_index: IntArray
    models: tuple[str, ...]
    output_tokens: FloatArray
    quality: FloatArray
    source: str = ""

    def __len__(self) -> int:
        return len(self.models)


def output_tokens(raw: object, where: str, error: type[Exception] = PredictorError) -> int:
    """A row's ``output_tokens`` (a whole number >= 1, as text or a JSON number); a bad one
    raises ``error`` naming ``where`` and the field."""
    try:
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise ValueError
        value = float(raw)
        if not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise ValueError
    except ValueError:
        raise error(f"{where}: output_tokens: expected an integer >= 1, got {raw!r}") from None
    return int(value)


def _parse_row(values: Mapping[str, object], where: str) -> tuple[str, str, float, float]:
    prompt, model = values.get("prompt"), values.get("model")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PredictorError(f"{where}: prompt: expected non-empty text, got {prompt!r}")
    if not isinstance(model, str) or not model.strip():
        raise PredictorError(f"{where}: model: expected a model name, got {model!r}")
    raw_q = values.get("quality")
    tokens = float(output_tokens(values.get("output_tokens"), where))
    try:
        if isinstance(raw_q, bool) or not isinstance(raw_q, str | int | float):
            raise ValueError
        quality = float(raw_q)
        if not (math.isfinite(quality) and 0.0 <= quality <= 1.0):
            raise ValueError
    except ValueError:
        raise PredictorError(f"{where}: quality: expected a number in [0, 1], "
                             f"got {raw_q!r}") from None
    return prompt, model.strip(), tokens, quality


def csv_rows(path: Path, required: Sequence[str] = REQUIRED_COLUMNS,
             error: type[Exception] = PredictorError) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row by header name) of a CSV file whose header names every column of
    ``required``; a problem raises ``error`` naming the file and line."""
    with path.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise error(f"{path}: line 1: empty file, expected a header row")
            missing = [c for c in required if c not in header]
            if missing:
                raise error(f"{path}: line 1: header lacks column(s) {', '.join(missing)}")
            end = reader.line_num
            for row in reader:
                start, end = end + 1, reader.line_num
                if not row:
                    continue
                if len(row) != len(header):
                    raise error(f"{path}: line {start}: expected {len(header)} "
                                f"fields, got {len(row)}")
                yield start, dict(zip(header, row, strict=True))
        except csv.Error as exc:
            raise error(f"{path}: line {reader.line_num}: {exc}") from None


def jsonl_rows(path: Path, error: type[Exception] = PredictorError
               ) -> Iterator[tuple[int, dict[str, object]]]:
    """(line number, object) of each non-blank line of a JSONL file; a line that is not a
    JSON object raises ``error`` naming the file, line and column."""
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}: line {line_no}: column {exc.colno}: invalid JSON: "
                            f"{exc.msg}") from None
            if not isinstance(obj, dict):
                raise error(f"{path}: line {line_no}: expected a JSON object")
            yield line_no, obj


def read_training_file(path: str | os.PathLike[str]) -> TrainingData:
    """Training rows from CSV (header with prompt, model, output_tokens, quality; optional
    task) or JSONL (``.jsonl``: one object per line with those keys)."""
    p = Path(path)
    if not p.is_file():
        raise PredictorError(f"{p}: no such file")
    rows = jsonl_rows(p) if p.suffix in (".jsonl", ".ndjson") else csv_rows(p)
    prompt_ids: dict[str, int] = {}
    tasks: list[str | None] = []
    index, models, tokens, quality = [], [], [], []
    try:
        for line_no, values in rows:
            prompt, model, o, q = _parse_row(values, f"{p}: line {line_no}")
            pid = prompt_ids.setdefault(prompt, len(prompt_ids))
            if pid == len(tasks):
                task = values.get("task")
                tasks.append(str(task) if task not in (None, "") else None)
            index.append(pid)
            models.append(model)
            tokens.append(o)
            quality.append(q)
    except UnicodeDecodeError as exc:
        raise PredictorError(f"{p}: not UTF-8 text: {exc.reason}") from exc
    if not models:
        raise PredictorError(f"{p}: no training rows")
    return TrainingData(prompts=tuple(prompt_ids), tasks=tuple(tasks),
                        prompt_index=np.asarray(index, dtype=np.int64), models=tuple(models),
                        output_tokens=np.asarray(tokens, dtype=np.float64),
                        quality=np.asarray(quality, dtype=np.float64), source=str(p))


# -- training --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TrainConfig:
    """LightGBM settings. Few trees keep the request path fast, since every row walks every
    tree: on synthetic data 120 / 80 rounds at rate 0.12 are within 2% of the MAE of
    250 / 200 at 0.06 and cut the request's two predict calls from ~115 to ~80 us."""

    decode_rounds: int = 120
    quality_rounds: int = 80
    learning_rate: float = 0.12
    num_leaves: int = 31
    min_data_in_leaf: int = 20
    huber_delta: float = 0.1  # quality units: errors beyond it count linearly
    p90: bool = True
    num_threads: int = 2
    seed: int = 0

    def params(self, objective: str, **extra: float) -> dict[str, Any]:
        return {"objective": objective, "learning_rate": self.learning_rate,
                "num_leaves": self.num_leaves, "min_data_in_leaf": self.min_data_in_leaf,
                "feature_fraction": 0.9, "bagging_fraction": 0.9, "bagging_freq": 1,
                "num_threads": self.num_threads, "seed": self.seed, "deterministic": True,
                "force_col_wise": True, "verbosity": -1, **extra}


ProgressFactory = Callable[[int, str], Any]


def _progress(enabled: bool) -> ProgressFactory:
    def make(total: int, desc: str) -> Any:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled,
                    leave=False, unit="it")
    return make


@dataclass(frozen=True, slots=True, eq=False)
class PromptMatrix:
    """Per distinct prompt: statistics (n, len(STAT_NAMES)) and hashed vectors (n, dims)."""

    stats: FloatArray
    hashed: FloatArray


def featurize_prompts(texts: Sequence[str], progress: bool = False) -> PromptMatrix:
    featurizer = Featurizer()
    stats = np.empty((len(texts), len(STAT_NAMES)))
    hashed = np.empty((len(texts), NUM_HASH_DIMS))
    with _progress(progress)(len(texts), "features") as bar:
        for i, text in enumerate(texts):
            s, h = featurizer.stats_and_hashed(text)
            stats[i], hashed[i] = s, h
            bar.update(1)
    return PromptMatrix(stats, hashed)


def model_traits(names: Sequence[str],
                 known: Mapping[str, tuple[float, int]]) -> tuple[ModelTraits, ...]:
    """Traits for each model name, from ``known`` (name -> (parameters, max context
    tokens), e.g. the profiles); a name not in ``known`` gets unknown traits."""
    return tuple(ModelTraits(n, *known[n]) if n in known else ModelTraits(n) for n in names)


def train_predictor(data: TrainingData, features: PromptMatrix, train_prompts: IntArray,
                    traits: Mapping[str, tuple[float, int]], config: TrainConfig,
                    progress: bool = False) -> Predictor:
    """Fit the PCA on ``train_prompts`` and the heads on their rows."""
    import lightgbm

    pca = fit_pca(features.hashed[train_prompts], NUM_PCA)
    spec = FeatureSpec(models=model_traits(sorted(set(data.models)), traits))
    model_ids = {m.name: i for i, m in enumerate(spec.models)}
    prompt_feats = np.hstack([features.stats, pca.project(features.hashed)])
    rows = np.flatnonzero(np.isin(data.prompt_index, train_prompts))
    x = np.hstack([prompt_feats[data.prompt_index[rows]],
                   spec.model_rows()[[model_ids[data.models[r]] for r in rows]]])
    names = list(spec.feature_names)
    category = [names.index("model_id")]
    heads = [("decode", config.params("regression"), data.output_tokens, config.decode_rounds),
             ("quality", config.params("huber", alpha=config.huber_delta), data.quality,
              config.quality_rounds)]
    if config.p90:
        heads.append(("p90", config.params("quantile", alpha=0.9), data.output_tokens,
                      config.decode_rounds))
    boosters: dict[str, lightgbm.Booster] = {}
    make_bar = _progress(progress)
    for name, params, target, rounds in heads:
        dataset = lightgbm.Dataset(x, target[rows], feature_name=names,
                                   categorical_feature=category, free_raw_data=True,
                                   params={"verbosity": -1})
        with make_bar(rounds, f"train {name}") as bar:
            boosters[name] = lightgbm.train(params, dataset, num_boost_round=rounds,
                                            callbacks=[lambda _env, b=bar: b.update(1)])
    return Predictor(spec, pca, boosters["decode"], boosters["quality"], boosters.get("p90"))


def split_prompts(num_prompts: int, holdout: float, seed: int) -> tuple[IntArray, IntArray]:
    """Train and held-out prompt indices: whole prompts are held out, so no prompt is in
    both (its rows for other models would leak)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    order = np.random.default_rng(seed).permutation(num_prompts)
    num_test = min(num_prompts - 1, max(1, round(holdout * num_prompts)))
    return np.sort(order[num_test:]), np.sort(order[:num_test])
