"""Output-length and quality predictors: prompt features and LightGBM heads.

Features come from the prompt alone (BEAR paper, App. A.4): prompt statistics, length-
constraint and task-type indicators, and a signed hashing of the tokens into
``NUM_HASH_DIMS`` dimensions, normalised by the token count and projected to ``NUM_PCA``
by a PCA fitted on the training prompts; then per model a categorical model id and the
model's traits (log10 parameter count, log2 max context). Three LightGBM heads share
them: decode tokens (mean head, L2), decode tokens P90 (quantile head, optional) and
quality in [0, 1] (Huber, clipped).

Tokens come from ``tokenize``: lower-cased runs of word characters, and each other
non-space character alone. It is deterministic and has no vocabulary; it is not any
model's BPE tokenizer. Token hashes use ``zlib.crc32``, so features are identical across
processes (Python's ``hash()`` is salted per process).

``lightgbm`` is imported where it is used, never at package import.
"""

from __future__ import annotations

import csv
import ctypes
import itertools
import json
import math
import os
import re
import sys
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from olproute.types import Prediction, Request

if TYPE_CHECKING:
    import lightgbm

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

FEATURE_VERSION = 1
NUM_HASH_DIMS = 512
NUM_PCA = 16
TOKENIZER = "regex-word-punct-lower-v1"
TOKEN_HASH = "crc32"
_HEAD_FILES = {"decode": "decode_mean.txt", "quality": "quality.txt", "p90": "decode_p90.txt"}
_CACHE_MAX_TOKENS = 1 << 18  # bound on the token -> hash-slot cache of one featurizer


class PredictorError(ValueError):
    """Training data or a saved predictor is unusable; the message names the file and,
    for data, the 1-based line: ``data.csv: line 7: quality: must be in [0, 1], got 1.5``."""


# -- prompt features ----------------------------------------------------------------------
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_WINDOW_TOKENS = 80  # instructions sit at a prompt's start or end: indicators look there
_NUMBERS = {w: float(i) for i, w in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve"))}
_NUMBERS.update(fifteen=15.0, twenty=20.0)
# A length constraint is a number followed, within three tokens, by one of these units.
_UNITS = {"word": "words", "words": "words", "sentence": "sentences",
          "sentences": "sentences", "paragraph": "paragraphs", "paragraphs": "paragraphs",
          **dict.fromkeys(("items", "tips", "ideas", "examples", "reasons", "facts", "ways",
                           "points", "bullets", "steps", "questions", "benefits", "things",
                           "names", "suggestions"), "items")}
_CONSTRAINTS = ("words", "sentences", "paragraphs", "items")
# Indicators: any of these unigrams or bigrams in the instruction window.
_INDICATOR_WORDS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(words.split(","))) for name, words in (
        ("list", "list,enumerate,bullet,bullets,bulleted"),
        ("summarize", "summary,summarize,summarise,summarizing,tldr,key findings,overview"),
        ("explain", "explain,why,how does,how do,how is,describe,reasoning"),
        ("compare", "compare,comparison,versus,vs,difference between,differences between,"
                    "contrast"),
        ("creative", "wp,story,poem,fiction,narrative,character,plot"),
        ("rewrite", "rewrite,rephrase,paraphrase,translate,proofread,correct"),
        ("classify", "classify,categorize,categorise,which of,identify,label"),
        ("brevity", "brief,briefly,short,concise,concisely,one sentence,few words,under"),
        ("detail", "in detail,detailed,in depth,thorough,comprehensive,step by"),
        ("document", "passage,passages,document,documents,report,article,context,"
                     "text below,above"),
    ))
_INDICATORS = tuple(name for name, _ in _INDICATOR_WORDS)
STAT_NAMES: tuple[str, ...] = (
    "log_tokens", "log_chars", "log_sentences", "chars_per_token", "log_newlines",
    "log_question_marks", "has_length_constraint",
    *(f"log_requested_{c}" for c in _CONSTRAINTS), *(f"is_{i}" for i in _INDICATORS))
MODEL_FEATURE_NAMES = ("model_id", "log10_params", "log2_max_context")


def tokenize(text: str) -> list[str]:
    """Lower-cased tokens: runs of word characters, and each other non-space character."""
    return _TOKEN_RE.findall(text.lower())


def count_tokens(text: str) -> int:
    """Number of ``tokenize`` tokens (the ``prompt_tokens`` of synthetic data)."""
    return len(_TOKEN_RE.findall(text))


def _requested_lengths(window: Sequence[str]) -> dict[str, float]:
    """Largest number given per length unit ("in 3 sentences", "250-word", "five tips")."""
    found = dict.fromkeys(_CONSTRAINTS, 0.0)
    for i, tok in enumerate(window):
        value = _NUMBERS.get(tok)
        if value is None:
            if not tok.isdigit():
                continue
            value = float(tok)
        for nxt in window[i + 1:i + 4]:
            unit = _UNITS.get(nxt)
            if unit is not None:
                found[unit] = max(found[unit], value)
                break
            if nxt in _NUMBERS or nxt.isdigit() or (not nxt.isalnum() and nxt != "-"):
                break
    return found


def prompt_stats(text: str, tokens: Sequence[str], counts: Mapping[str, int]) -> list[float]:
    """The ``STAT_NAMES`` features of one prompt, from its text, its ``tokenize`` tokens
    and their counts. Counts are log1p; sentences are sentence-ending punctuation tokens;
    indicators and length constraints are read in the first and last ``_WINDOW_TOKENS``
    tokens, where instructions are."""
    n = len(tokens)
    window = tokens if n <= 2 * _WINDOW_TOKENS else [*tokens[:_WINDOW_TOKENS],
                                                     *tokens[-_WINDOW_TOKENS:]]
    grams = set(window)
    grams.update(f"{a} {b}" for a, b in itertools.pairwise(window))
    found = {name for name, words in _INDICATOR_WORDS if not words.isdisjoint(grams)}
    requested = _requested_lengths(window)
    num_chars = sum(len(t) * c for t, c in counts.items())
    return [
        math.log1p(n), math.log1p(len(text)),
        math.log1p(counts.get(".", 0) + counts.get("!", 0) + counts.get("?", 0)),
        num_chars / n if n else 0.0,
        math.log1p(text.count("\n")), math.log1p(counts.get("?", 0)),
        1.0 if any(requested.values()) or "brevity" in found or "detail" in found else 0.0,
        *(math.log1p(requested[c]) for c in _CONSTRAINTS),
        *(1.0 if i in found else 0.0 for i in _INDICATORS),
    ]


def token_slot(token: str, num_dims: int = NUM_HASH_DIMS) -> int:
    """Signed hashing slot of a token: ``+(i + 1)`` or ``-(i + 1)`` for dimension ``i``;
    the index is crc32 modulo ``num_dims``, the sign its top bit."""
    h = zlib.crc32(token.encode())
    return -(h % num_dims + 1) if h & 0x80000000 else h % num_dims + 1


@dataclass(frozen=True, slots=True, eq=False)
class Pca:
    """A linear projection: ``(x - mean) @ components`` with components (dims, k)."""

    mean: FloatArray
    components: FloatArray

    def project(self, x: FloatArray) -> FloatArray:
        return np.asarray((x - self.mean) @ self.components, dtype=np.float64)


def fit_pca(matrix: FloatArray, k: int) -> Pca:
    """PCA by SVD of the centred rows; each component's sign is fixed so its largest
    loading is positive, so a refit on the same rows gives the same projection."""
    mean = matrix.mean(axis=0)
    _, _, vt = np.linalg.svd(matrix - mean, full_matrices=False)
    comps = vt[:k].T.copy()
    if comps.shape[1] < k:  # fewer prompts than components: pad with zero directions
        comps = np.hstack([comps, np.zeros((comps.shape[0], k - comps.shape[1]))])
    signs = np.sign(comps[np.abs(comps).argmax(axis=0), np.arange(k)])
    comps *= np.where(signs == 0, 1.0, signs)
    return Pca(mean=mean, components=comps)


class Featurizer:
    """Prompt text -> statistics and hashed token vector; owns a bounded token-slot cache."""

    __slots__ = ("_cache", "num_dims")

    def __init__(self, num_dims: int = NUM_HASH_DIMS) -> None:
        self.num_dims = num_dims
        self._cache: dict[str, int] = {}

    def hashed(self, counts: Mapping[str, int], num_tokens: int) -> FloatArray:
        """Signed token counts in ``num_dims`` buckets, divided by the token count."""
        cache = self._cache
        if len(cache) > _CACHE_MAX_TOKENS:
            cache.clear()
        slots = []
        for tok in counts:
            s = cache.get(tok)
            if s is None:
                s = cache[tok] = token_slot(tok, self.num_dims)
            slots.append(s)
        sl = np.array(slots, dtype=np.int64)
        weights = np.sign(sl) * np.fromiter(counts.values(), np.float64, len(counts))
        vec = np.bincount(np.abs(sl) - 1, weights=weights, minlength=self.num_dims)
        return vec / max(1, num_tokens)

    def stats_and_hashed(self, text: str) -> tuple[list[float], FloatArray]:
        """``STAT_NAMES`` values and the hashed token vector of one prompt."""
        tokens = tokenize(text)
        counts = Counter(tokens)
        return prompt_stats(text, tokens, counts), self.hashed(counts, len(tokens))


# -- feature spec ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelTraits:
    """A model the predictor knows; its position in ``FeatureSpec.models`` is its
    categorical id. Unknown traits (a model missing from the profiles) are None."""

    name: str
    num_params: float | None = None
    max_context_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """What a saved predictor's features mean; a loader refuses another version."""

    models: tuple[ModelTraits, ...]
    version: int = FEATURE_VERSION
    num_hash_dims: int = NUM_HASH_DIMS
    num_pca: int = NUM_PCA
    tokenizer: str = TOKENIZER
    token_hash: str = TOKEN_HASH
    stat_names: tuple[str, ...] = STAT_NAMES

    @property
    def feature_names(self) -> tuple[str, ...]:
        return (*self.stat_names, *(f"pca_{i}" for i in range(self.num_pca)),
                *MODEL_FEATURE_NAMES)

    @property
    def num_prompt_features(self) -> int:
        return len(self.stat_names) + self.num_pca

    def model_rows(self) -> FloatArray:
        """Per known model: (id, log10 params, log2 max context); NaN where unknown."""
        return np.array([[i,
                          math.log10(m.num_params) if m.num_params else math.nan,
                          math.log2(m.max_context_tokens) if m.max_context_tokens else math.nan]
                         for i, m in enumerate(self.models)], dtype=np.float64).reshape(-1, 3)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "num_hash_dims": self.num_hash_dims,
                "num_pca": self.num_pca, "tokenizer": self.tokenizer,
                "token_hash": self.token_hash, "stat_names": list(self.stat_names),
                "feature_names": list(self.feature_names),
                "models": [{"name": m.name, "num_params": m.num_params,
                            "max_context_tokens": m.max_context_tokens} for m in self.models]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> FeatureSpec:
        version = data.get("version")
        if version != FEATURE_VERSION:
            raise PredictorError(f"{where}: feature spec version {version!r}; this olproute "
                                 f"reads version {FEATURE_VERSION}: retrain the predictor")
        try:
            spec = cls(models=tuple(ModelTraits(str(m["name"]), m.get("num_params"),
                                                m.get("max_context_tokens"))
                                    for m in data["models"]),
                       num_hash_dims=int(data["num_hash_dims"]), num_pca=int(data["num_pca"]),
                       tokenizer=str(data["tokenizer"]), token_hash=str(data["token_hash"]),
                       stat_names=tuple(data["stat_names"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PredictorError(f"{where}: malformed feature spec: {exc!r}") from exc
        if (spec.tokenizer, spec.token_hash, spec.stat_names) != (TOKENIZER, TOKEN_HASH,
                                                                  STAT_NAMES):
            raise PredictorError(f"{where}: features were computed differently "
                                 f"(tokenizer {spec.tokenizer!r}): retrain the predictor")
        return spec


# -- the request path on LightGBM's C API ----------------------------------------------------
def _lightgbm_library() -> ctypes.CDLL:
    """The shared library inside the installed ``lightgbm`` package, with the prototypes
    of the public C API calls used here (``c_api.h``)."""
    import lightgbm

    root = Path(lightgbm.__file__).resolve().parent
    found = sorted(root.glob("**/lib_lightgbm.*"))
    if not found:
        raise PredictorError(f"cannot find lib_lightgbm under {root}")
    lib = ctypes.CDLL(str(found[0]))  # the library lightgbm already loaded (same dlopen)
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.LGBM_GetLastError.restype = ctypes.c_char_p
    lib.LGBM_BoosterLoadModelFromString.argtypes = [ctypes.c_char_p, ctypes.POINTER(i32),
                                                    ctypes.POINTER(p)]
    lib.LGBM_BoosterPredictForMatSingleRowFastInit.argtypes = [
        p, i32, i32, i32, i32, ctypes.c_int32, ctypes.c_char_p, ctypes.POINTER(p)]
    lib.LGBM_BoosterPredictForMatSingleRowFast.argtypes = [
        p, p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)]
    lib.LGBM_FastConfigFree.argtypes = [p]
    lib.LGBM_BoosterFree.argtypes = [p]
    return lib


def _free_heads(lib: ctypes.CDLL, boosters: list[ctypes.c_void_p],
                configs: list[ctypes.c_void_p]) -> None:
    for fc in configs:  # a fast config points into its booster: free it first
        lib.LGBM_FastConfigFree(fc)
    for handle in boosters:
        lib.LGBM_BoosterFree(handle)


class RowHeads:
    """LightGBM models evaluated row by row on the C API's single-row fast path
    (``LGBM_BoosterPredictForMatSingleRowFast``), configured once with ``num_threads=1``.

    ``Booster.predict`` rebuilds its predictor and re-parses parameters on every call:
    measured here ~50 us per call on the request path, against ~5 us per row on this
    path, with identical outputs. The handles are our own, loaded from the model text
    through the public C API. Not thread-safe (a fast config holds one row buffer): use
    one ``Predictor`` per thread.
    """

    __slots__ = ("__weakref__", "_call", "_configs", "_len", "_out", "_out_ptr")

    def __init__(self, model_texts: Sequence[str], num_features: int) -> None:
        lib = _lightgbm_library()
        boosters: list[ctypes.c_void_p] = []
        self._configs: list[ctypes.c_void_p] = []
        weakref.finalize(self, _free_heads, lib, boosters, self._configs)
        for text in model_texts:
            handle, num_iterations, config = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_void_p()
            self._check(lib, lib.LGBM_BoosterLoadModelFromString(
                text.encode(), ctypes.byref(num_iterations), ctypes.byref(handle)))
            boosters.append(handle)
            # predict_type 0 = normal, data_type 1 = float64, all iterations
            self._check(lib, lib.LGBM_BoosterPredictForMatSingleRowFastInit(
                handle, 0, 0, -1, 1, num_features, b"num_threads=1", ctypes.byref(config)))
            self._configs.append(config)
        self._call = lib.LGBM_BoosterPredictForMatSingleRowFast
        self._out = ctypes.c_double()
        self._out_ptr = ctypes.pointer(self._out)
        self._len = ctypes.pointer(ctypes.c_int64())

    @staticmethod
    def _check(lib: ctypes.CDLL, code: int) -> None:
        if code != 0:
            raise PredictorError(f"LightGBM: {lib.LGBM_GetLastError().decode()}")

    def predict(self, head: int, x: FloatArray) -> list[float]:
        """Outputs of model ``head`` for each row of a C-contiguous float64 matrix."""
        assert x.flags.c_contiguous and x.dtype == np.float64
        call, config, length, out, out_ptr = (self._call, self._configs[head], self._len,
                                              self._out, self._out_ptr)
        base, stride = x.ctypes.data, x.strides[0]
        result = []
        for i in range(x.shape[0]):
            if call(config, base + i * stride, length, out_ptr) != 0:
                raise PredictorError("LightGBM single-row prediction failed")
            result.append(out.value)
        return result


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one tuple of instance models maps to feature rows: the model part of each
    distinct model's row, and for each instance the row it reads."""

    model_part: FloatArray
    row_of_instance: tuple[int, ...]


# -- the predictor -------------------------------------------------------------------------
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
                 "_quality", "_row_heads", "pca", "spec")

    def __init__(self, spec: FeatureSpec, pca: Pca, decode: lightgbm.Booster,
                 quality: lightgbm.Booster, decode_p90: lightgbm.Booster | None = None) -> None:
        self.spec = spec
        self.pca = pca
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
        return cls(spec, pca, heads["decode"], heads["quality"], heads.get("p90"))


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
        decode[m] = [max(1, round(float(o))) for o in dec]
        quality[m] = [min(max(float(q), 0.0), 1.0) for q in qual]
    return [replace(r, predicted_decode_tokens=decode[names[0]][i],
                    predicted_decode_by_model={m: decode[m][i] for m in names},
                    predicted_quality_by_model={m: quality[m][i] for m in names})
            for i, r in enumerate(requests)]


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


def _parse_row(values: Mapping[str, object], where: str) -> tuple[str, str, float, float]:
    prompt, model = values.get("prompt"), values.get("model")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PredictorError(f"{where}: prompt: expected non-empty text, got {prompt!r}")
    if not isinstance(model, str) or not model.strip():
        raise PredictorError(f"{where}: model: expected a model name, got {model!r}")
    raw_o, raw_q = values.get("output_tokens"), values.get("quality")
    try:
        if isinstance(raw_o, bool) or not isinstance(raw_o, str | int | float):
            raise ValueError
        tokens = float(raw_o)
        if not (math.isfinite(tokens) and tokens >= 1 and tokens == int(tokens)):
            raise ValueError
    except ValueError:
        raise PredictorError(f"{where}: output_tokens: expected an integer >= 1, "
                             f"got {raw_o!r}") from None
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


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    with path.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise PredictorError(f"{path}: line 1: empty file, expected a header row")
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise PredictorError(f"{path}: line 1: header lacks column(s) "
                                     f"{', '.join(missing)}")
            end = reader.line_num
            for row in reader:
                start, end = end + 1, reader.line_num
                if not row:
                    continue
                if len(row) != len(header):
                    raise PredictorError(f"{path}: line {start}: expected {len(header)} "
                                         f"fields, got {len(row)}")
                yield start, dict(zip(header, row, strict=True))
        except csv.Error as exc:
            raise PredictorError(f"{path}: line {reader.line_num}: {exc}") from exc


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PredictorError(f"{path}: line {line_no}: invalid JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise PredictorError(f"{path}: line {line_no}: expected a JSON object")
            yield line_no, obj


def read_training_file(path: str | os.PathLike[str]) -> TrainingData:
    """Training rows from CSV (header with prompt, model, output_tokens, quality; optional
    task) or JSONL (``.jsonl``: one object per line with those keys)."""
    p = Path(path)
    if not p.is_file():
        raise PredictorError(f"{p}: no such file")
    rows = _jsonl_rows(p) if p.suffix in (".jsonl", ".ndjson") else _csv_rows(p)
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


# -- evaluation --------------------------------------------------------------------------------
def _ranks(x: FloatArray) -> FloatArray:
    """1-based ranks, ties sharing their average rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return np.asarray((ends - (counts - 1) / 2.0)[inverse], dtype=np.float64)


def spearman(a: FloatArray, b: FloatArray) -> float:
    """Spearman rank correlation (NaN when either side is constant)."""
    ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def decode_errors(true: FloatArray, pred: FloatArray) -> tuple[float, float, float]:
    """MAE (tokens), MAPE (fraction of the true length) and R^2 of decode predictions."""
    err = pred - true
    ss_tot = float(((true - true.mean()) ** 2).sum())
    r2 = 1.0 - float((err**2).sum()) / ss_tot if ss_tot > 0 else math.nan
    return float(np.abs(err).mean()), float((np.abs(err) / true).mean()), r2


@dataclass(frozen=True, slots=True, eq=False)
class Evaluation:
    """Held-out figures. ``decode`` maps a label (the predictor and the mean baselines) to
    (MAE tokens, MAPE, R^2); arrays are per held-out row, for plots."""

    num_train_rows: int
    num_test_rows: int
    num_test_prompts: int
    decode: Mapping[str, tuple[float, float, float]]
    quality_spearman: float
    quality_spearman_within: float
    quality_mae: float
    p90_coverage: float | None
    true_decode: FloatArray = field(repr=False)
    pred_decode: FloatArray = field(repr=False)
    true_quality: FloatArray = field(repr=False)
    pred_quality: FloatArray = field(repr=False)
    groups: tuple[str, ...] = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"num_train_rows": self.num_train_rows, "num_test_rows": self.num_test_rows,
                "num_test_prompts": self.num_test_prompts,
                "decode": {k: {"mae_tokens": v[0], "mape": v[1], "r2": v[2]}
                           for k, v in self.decode.items()},
                "quality": {"spearman": self.quality_spearman,
                            "spearman_within_task_model": self.quality_spearman_within,
                            "mae": self.quality_mae},
                "decode_p90_coverage": self.p90_coverage}

    def table(self) -> str:
        lines = [f"held out: {self.num_test_rows:,} rows ({self.num_test_prompts:,} prompts); "
                 f"trained on {self.num_train_rows:,} rows",
                 f"{'decode tokens':<26}{'MAE':>9}{'MAPE':>9}{'R2':>8}",
                 f"{'-' * 26}{'-' * 9:>9}{'-' * 9:>9}{'-' * 8:>8}"]
        for label, (mae, mape, r2) in self.decode.items():
            lines.append(f"{label:<26}{mae:>9.1f}{mape:>9.3f}{r2:>8.3f}")
        lines += ["", f"{'quality':<26}{'value':>9}", f"{'-' * 26}{'-' * 9:>9}",
                  f"{'Spearman, all rows':<26}{self.quality_spearman:>9.3f}",
                  f"{'Spearman, within group':<26}{self.quality_spearman_within:>9.3f}",
                  f"{'MAE':<26}{self.quality_mae:>9.3f}"]
        if self.p90_coverage is not None:
            lines.append(f"{'decode P90 coverage':<26}{self.p90_coverage:>9.3f}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], max_points: int = 4000) -> None:
        """Predicted vs true decode tokens (log-log) and quality, coloured by group."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keep = np.random.default_rng(0).permutation(len(self.true_decode))[:max_points]
        groups = np.asarray(self.groups, dtype=object)[keep]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), constrained_layout=True)
        panels = ((self.true_decode, self.pred_decode, "decode tokens", True),
                  (self.true_quality, self.pred_quality, "quality", False))
        for ax, (true, pred, label, log) in zip(axes, panels, strict=True):
            for g in sorted(set(groups)):
                sel = keep[groups == g]
                ax.scatter(true[sel], pred[sel], s=4, alpha=0.35, label=g)
            lo, hi = float(min(true.min(), pred.min())), float(max(true.max(), pred.max()))
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            if log:
                ax.set_xscale("log")
                ax.set_yscale("log")
            ax.set_xlabel(f"true {label}")
            ax.set_ylabel(f"predicted {label}")
            ax.grid(True, which="both", alpha=0.3)
        mae = self.decode["predictor"][0]
        axes[0].set_title(f"held-out decode length (MAE {mae:.0f} tokens)")
        axes[1].set_title(f"held-out quality (Spearman {self.quality_spearman:.2f})")
        axes[0].legend(loc="upper left", markerscale=3, fontsize=8)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _group_means(keys_train: Sequence[str], y_train: FloatArray,
                 keys_test: Sequence[str], fallback: float) -> FloatArray:
    sums: dict[str, list[float]] = {}
    for k, y in zip(keys_train, y_train.tolist(), strict=True):
        acc = sums.setdefault(k, [0.0, 0.0])
        acc[0] += y
        acc[1] += 1.0
    return np.array([sums[k][0] / sums[k][1] if k in sums else fallback for k in keys_test])


def evaluate(predictor: Predictor, data: TrainingData, features: PromptMatrix,
             train_prompts: IntArray, test_prompts: IntArray) -> Evaluation:
    """Held-out decode MAE / MAPE / R^2 against per-task (and per-task-and-model) means of
    the training rows, and quality Spearman, on all rows and within (task, model)."""
    prompt_feats = np.hstack([features.stats, predictor.pca.project(features.hashed)])
    train = np.flatnonzero(np.isin(data.prompt_index, train_prompts))
    test = np.flatnonzero(np.isin(data.prompt_index, test_prompts))
    ids = predictor.model_ids([data.models[r] for r in test])
    x = predictor.rows(prompt_feats[data.prompt_index[test]], ids)
    decode, quality, upper = predictor.predict_matrix(x, p90=True)

    true_o, true_q = data.output_tokens[test], data.quality[test]
    task_tr = [data.tasks[p] or "all" for p in data.prompt_index[train].tolist()]
    task_te = [data.tasks[p] or "all" for p in data.prompt_index[test].tolist()]
    pair_tr = [f"{t}/{data.models[r]}" for t, r in zip(task_tr, train.tolist(), strict=True)]
    pair_te = [f"{t}/{data.models[r]}" for t, r in zip(task_te, test.tolist(), strict=True)]
    overall = float(data.output_tokens[train].mean())
    base_task = _group_means(task_tr, data.output_tokens[train], task_te, overall)
    base_pair = _group_means(pair_tr, data.output_tokens[train], pair_te, overall)
    within = [spearman(true_q[idx], quality[idx]) for g in sorted(set(pair_te))
              if len(idx := np.flatnonzero(np.asarray(pair_te) == g)) >= 10]
    within = [w for w in within if not math.isnan(w)]
    return Evaluation(
        num_train_rows=len(train), num_test_rows=len(test), num_test_prompts=len(test_prompts),
        decode={"predictor": decode_errors(true_o, decode),
                "per-task mean": decode_errors(true_o, base_task),
                "per-task-and-model mean": decode_errors(true_o, base_pair)},
        quality_spearman=spearman(true_q, quality),
        quality_spearman_within=float(np.mean(within)) if within else math.nan,
        quality_mae=float(np.abs(quality - true_q).mean()),
        p90_coverage=None if upper is None else float((true_o <= upper).mean()),
        true_decode=true_o, pred_decode=decode, true_quality=true_q, pred_quality=quality,
        groups=tuple(task_te))


def train_and_evaluate(data: TrainingData, traits: Mapping[str, tuple[float, int]],
                       holdout: float = 0.2, config: TrainConfig | None = None,
                       progress: bool = False) -> tuple[Predictor, Evaluation]:
    """Split by prompt, fit features and heads on the training prompts, evaluate on the
    held-out ones. The returned predictor is the one evaluated (trained without them)."""
    config = config or TrainConfig()
    train_p, test_p = split_prompts(len(data.prompts), holdout, config.seed)
    features = featurize_prompts(data.prompts, progress)
    predictor = train_predictor(data, features, train_p, traits, config, progress)
    return predictor, evaluate(predictor, data, features, train_p, test_p)
