"""The predictor: decode length (mean, optional P90) and quality per model from a
prompt, on the request path and in batches; saving and loading; ``apply_predictor`` for
simulated requests."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from olproute.predict.features import FeatureSpec, Featurizer, Pca, PredictorError
from olproute.predict.heads import RowHeads
from olproute.types import Prediction, Request

if TYPE_CHECKING:
    import lightgbm

FloatArray = npt.NDArray[np.float64]


_HEAD_FILES = {"decode": "decode_mean.txt", "quality": "quality.txt", "p90": "decode_p90.txt"}
# the predictor the package ships (package data; how it was trained: its README.md), which
# ``olproute serve`` runs unless the config's ``prediction`` section names another or none
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one tuple of instance models maps to feature rows: the model part of each
    distinct model's row, and for each instance the row it reads."""

    model_part: FloatArray
    row_of_instance: tuple[int, ...]


class Predictor:
    """Decode length (mean, optional P90) and quality per model from a prompt.

    ``predict`` is the request path: the prompt is featurised once, one row is built per
    distinct model (the model part of the rows is cached per tuple of instance models),
    and the heads run single-threaded on LightGBM's single-row fast path (``RowHeads``).
    LightGBM's default OpenMP threads are never used on this path: they stall whenever
    another process is busy on the machine. Batch paths (``predict_matrix``) make one
    single-threaded ``Booster.predict`` call per head on the whole matrix.
    """

    __slots__ = ("_decode", "_featurizer", "_model_index", "_model_rows", "_p90", "_plans",
                 "_quality", "_row_heads", "directory", "pca", "spec")

    def __init__(self, spec: FeatureSpec, pca: Pca, decode: lightgbm.Booster,
                 quality: lightgbm.Booster, decode_p90: lightgbm.Booster | None = None,
                 directory: Path | None = None) -> None:
        self.spec = spec
        self.pca = pca
        self.directory = directory   # the folder ``load`` read it from (None: trained here)
        self._decode = decode
        self._quality = quality
        self._p90 = decode_p90
        self._featurizer = Featurizer(spec.num_hash_dims)
        self._model_index = {m.name: i for i, m in enumerate(spec.models)}
        self._model_rows = spec.model_rows()
        self._plans: dict[tuple[str, ...], _Plan] = {}
        heads = [decode, quality] + ([decode_p90] if decode_p90 is not None else [])
        self._row_heads = RowHeads([b.model_to_string() for b in heads],
                                   len(spec.feature_names))

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.spec.models)

    @property
    def has_p90(self) -> bool:
        return self._p90 is not None

    def prompt_features(self, text: str) -> FloatArray:
        """The prompt part of a feature row (``spec.num_prompt_features`` values)."""
        stats, hashed = self._featurizer.stats_and_hashed(text)
        return np.concatenate([np.asarray(stats, dtype=np.float64), self.pca.project(hashed)])

    def model_ids(self, models: Sequence[str]) -> list[int]:
        """Categorical ids of model names (PredictorError for a model not trained on)."""
        try:
            return [self._model_index[m] for m in models]
        except KeyError as exc:
            raise PredictorError(f"the predictor was not trained for model {exc.args[0]!r} "
                                 f"(it knows: {', '.join(self.models)})") from None

    def rows(self, prompt_features: FloatArray, model_ids: Sequence[int]) -> FloatArray:
        """Feature matrix: one prompt-feature row per model id (or a matrix of them)."""
        pf = np.atleast_2d(prompt_features)
        out = np.empty((len(model_ids), pf.shape[1] + 3), dtype=np.float64)
        out[:, :pf.shape[1]] = pf
        out[:, pf.shape[1]:] = self._model_rows[model_ids]
        return out

    def predict_matrix(self, x: FloatArray, p90: bool = False) -> tuple[
            FloatArray, FloatArray, FloatArray | None]:
        """Decode tokens (>= 1), quality in [0, 1] and, if asked and trained, decode P90
        (>= the mean) for each row of a feature matrix: one single-threaded
        ``Booster.predict`` call per head (the batch path)."""
        decode = np.maximum(self._decode.predict(x, num_threads=1), 1.0)
        quality = np.clip(self._quality.predict(x, num_threads=1), 0.0, 1.0)
        upper = None
        if p90 and self._p90 is not None:
            upper = np.maximum(self._p90.predict(x, num_threads=1), decode)
        return (np.asarray(decode, np.float64), np.asarray(quality, np.float64),
                None if upper is None else np.asarray(upper, np.float64))

    def _plan(self, models: tuple[str, ...]) -> _Plan:
        plan = self._plans.get(models)
        if plan is None:
            distinct = list(dict.fromkeys(models))
            part = np.ascontiguousarray(self._model_rows[self.model_ids(distinct)])
            plan = _Plan(part, tuple(distinct.index(m) for m in models))
            if len(self._plans) >= 1024:  # pools are few; bound the cache anyway
                self._plans.clear()
            self._plans[models] = plan
        return plan

    def predict(self, request_or_prompt: Request | str, models: Sequence[str],
                p90: bool = False) -> Prediction:
        """Predictions for one request on each of ``models`` (one entry per instance;
        instances of the same model share one row). Same values as ``predict_matrix``."""
        if isinstance(request_or_prompt, Request):
            text = request_or_prompt.text
            if text is None:
                raise PredictorError(
                    f"request {request_or_prompt.request_id} has no prompt text to predict from")
        else:
            text = request_or_prompt
        names = tuple(models)
        plan = self._plan(names)
        num_prompt = self.spec.num_prompt_features
        x = np.empty((plan.model_part.shape[0], num_prompt + 3))
        x[:, :num_prompt] = self.prompt_features(text)
        x[:, num_prompt:] = plan.model_part
        heads = self._row_heads
        dec = [max(v, 1.0) for v in heads.predict(0, x)]
        qual = [min(max(v, 0.0), 1.0) for v in heads.predict(1, x)]
        up = None
        if p90 and self._p90 is not None:
            up = [max(u, d) for u, d in zip(heads.predict(2, x), dec, strict=True)]
        at = plan.row_of_instance
        return Prediction(models=names, decode_tokens=tuple(dec[i] for i in at),
                          quality=tuple(qual[i] for i in at),
                          decode_tokens_p90=None if up is None else tuple(up[i] for i in at))

    def predict_prompts(self, texts: Sequence[str], model: str) -> tuple[FloatArray, FloatArray]:
        """Decode tokens and quality of many prompts on one model (offline, batched)."""
        (mid,) = self.model_ids([model])
        feats = np.array([self.prompt_features(t) for t in texts]).reshape(len(texts), -1)
        decode, quality, _ = self.predict_matrix(self.rows(feats, [mid] * len(texts)))
        return decode, quality

    # -- persistence ---------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the heads (LightGBM text models), ``pca.npz`` and ``feature_spec.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        heads = {"decode": self._decode, "quality": self._quality, "p90": self._p90}
        for name, booster in heads.items():
            if booster is not None:
                booster.save_model(str(d / _HEAD_FILES[name]))
        np.savez(d / "pca.npz", mean=self.pca.mean, components=self.pca.components)
        import lightgbm

        spec = self.spec.to_json() | {
            "heads": [n for n, b in heads.items() if b is not None],
            "lightgbm_version": lightgbm.__version__}
        (d / "feature_spec.json").write_text(json.dumps(spec, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Predictor:
        """Read a directory written by ``save``; PredictorError names what is wrong."""
        import lightgbm

        d = Path(directory)
        spec_path = d / "feature_spec.json"
        try:
            data = json.loads(spec_path.read_text())
            with np.load(d / "pca.npz") as z:
                pca = Pca(mean=z["mean"].astype(np.float64),
                          components=z["components"].astype(np.float64))
        except (OSError, ValueError, KeyError) as exc:
            raise PredictorError(f"{d}: not a saved predictor: {exc}") from exc
        spec = FeatureSpec.from_json(data, str(spec_path))
        if pca.components.shape != (spec.num_hash_dims, spec.num_pca):
            raise PredictorError(f"{d / 'pca.npz'}: components have shape "
                                 f"{pca.components.shape}, the spec says "
                                 f"({spec.num_hash_dims}, {spec.num_pca})")
        heads: dict[str, lightgbm.Booster] = {}
        for name in data.get("heads", ["decode", "quality"]):
            path = d / _HEAD_FILES[name]
            try:
                heads[name] = lightgbm.Booster(model_file=str(path))
            except (OSError, lightgbm.basic.LightGBMError) as exc:
                raise PredictorError(f"{path}: cannot load LightGBM model: {exc}") from exc
            if heads[name].num_feature() != len(spec.feature_names):
                raise PredictorError(f"{path}: model has {heads[name].num_feature()} "
                                     f"features, the spec {len(spec.feature_names)}")
        if "decode" not in heads or "quality" not in heads:
            raise PredictorError(f"{spec_path}: heads must include 'decode' and 'quality'")
        return cls(spec, pca, heads["decode"], heads["quality"], heads.get("p90"), d)


def decode_prediction(tokens: float, max_tokens: int | None = None) -> int:
    """A predicted output length as a request carries it: rounded, at least 1, and at most
    ``max_tokens`` when given (the most the backend will generate)."""
    n = max(1, round(float(tokens)))
    return n if max_tokens is None else min(n, max_tokens)


def quality_prediction(quality: float) -> float:
    """A predicted quality as a request carries it: clipped to [0, 1]."""
    return min(max(float(quality), 0.0), 1.0)


def apply_predictor(requests: Sequence[Request], predictor: Predictor,
                    models: Sequence[str]) -> list[Request]:
    """Copies of ``requests`` carrying ``predictor``'s output for every model in
    ``models`` (the pool's models, first model first): ``predicted_decode_by_model``
    (rounded, >= 1), ``predicted_quality_by_model`` (in [0, 1]) and, for the first model,
    ``predicted_decode_tokens``. Nothing else changes. Every request needs its prompt
    text."""
    missing = [r.request_id for r in requests if r.text is None]
    if missing:
        raise PredictorError(f"{len(missing)} request(s) have no prompt text to predict from "
                             f"(first: request {missing[0]})")
    names = list(dict.fromkeys(models))
    if not names:
        raise PredictorError("apply_predictor needs at least one model")
    texts = [str(r.text) for r in requests]
    decode: dict[str, list[int]] = {}
    quality: dict[str, list[float]] = {}
    for m in names:
        dec, qual = predictor.predict_prompts(texts, m)
        decode[m] = [decode_prediction(o) for o in dec]
        quality[m] = [quality_prediction(q) for q in qual]
    return [replace(r, predicted_decode_tokens=decode[names[0]][i],
                    predicted_decode_by_model={m: decode[m][i] for m in names},
                    predicted_quality_by_model={m: quality[m][i] for m in names})
            for i, r in enumerate(requests)]
