"""Prompt features (BEAR paper, App. A.4): the tokenizer, prompt statistics, length-
constraint and task-type indicators, the signed token hashing and its PCA, and the
``FeatureSpec`` a saved predictor records so that features are computed the same way."""

from __future__ import annotations

import itertools
import math
import re
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.predict import _featurize

FloatArray = npt.NDArray[np.float64]


FEATURE_VERSION = 1
NUM_HASH_DIMS = 512
NUM_PCA = 16
TOKENIZER = "regex-word-punct-lower-v1"
TOKEN_HASH = "crc32"
_CACHE_MAX_TOKENS = 1 << 18  # bound on the token -> hash-slot cache of one featurizer


class PredictorError(ValueError):
    """Training data or a saved predictor is unusable; the message names the file and,
    for data, the 1-based line: ``data.csv: line 7: quality: must be in [0, 1], got 1.5``."""


_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# a lone surrogate (a JSON body may carry one, "\ud800") has no UTF-8 form to hash
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_WINDOW_TOKENS = 80  # instructions sit at a prompt's start or end: indicators look there
_LOOKAHEAD_TOKENS = 3  # a unit counts if it follows its number within this many tokens
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
            if not tok.isdecimal():  # isdigit() also holds for "²", which float() refuses
                continue
            value = float(tok)
        for nxt in window[i + 1:i + 1 + _LOOKAHEAD_TOKENS]:
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


# -- the compiled path -----------------------------------------------------------------------
# the characters prompt_stats counts: sentence ends ("?" also alone) and newlines, which
# lower() neither makes nor removes, so the lowered text has the original's
_COUNTED = ".!?\n"


def _ascii_classes() -> bytes:
    """The kernel's class of each ASCII character, read off ``_TOKEN_RE`` itself: a word
    character if two of it are one token, another token if one of it is, else space."""
    def cls(c: str) -> int:
        if _TOKEN_RE.fullmatch(c + c):
            return _featurize.WORD
        return _featurize.OTHER if _TOKEN_RE.fullmatch(c) else _featurize.SPACE
    return bytes(cls(chr(i)) for i in range(128))


def new_kernel(num_dims: int = NUM_HASH_DIMS) -> _featurize.FeatureKernel:
    """The compiled featuriser with this module's word lists and windows as its tables."""
    grams = [(bit, g.split(" ")) for bit, (_, words) in enumerate(_INDICATOR_WORDS)
             for g in sorted(words)]
    for _, parts in grams:  # the kernel matches one or two whole tokens
        assert len(parts) <= 2 and tokenize(" ".join(parts)) == parts, parts
    words = list(dict.fromkeys([*_NUMBERS, *_UNITS, *(w for _, ps in grams for w in ps)]))
    index = {w: i for i, w in enumerate(words)}
    masks = [0] * len(words)
    pairs = []
    for bit, parts in grams:
        if len(parts) == 1:
            masks[index[parts[0]]] |= 1 << bit
        else:
            pairs.append((index[parts[0]], index[parts[1]], 1 << bit))
    return _featurize.FeatureKernel(
        _ascii_classes(), [w.encode() for w in words],
        [_NUMBERS.get(w, math.nan) for w in words],
        [_CONSTRAINTS.index(_UNITS[w]) if w in _UNITS else -1 for w in words],
        masks, pairs, num_dims, _WINDOW_TOKENS, _LOOKAHEAD_TOKENS, len(_CONSTRAINTS),
        _COUNTED.encode())


_SETS_LENGTH = sum(1 << _INDICATORS.index(i) for i in ("brevity", "detail"))


def _kernel_stats(text: str, num_tokens: int, num_chars: int, counted: tuple[int, ...],
                  found: int, requested: list[float]) -> list[float]:
    """``prompt_stats`` from the kernel's counts; the same arithmetic, value for value."""
    ends, bangs, questions, newlines = counted
    return [
        math.log1p(num_tokens), math.log1p(len(text)), math.log1p(ends + bangs + questions),
        num_chars / num_tokens if num_tokens else 0.0,
        math.log1p(newlines), math.log1p(questions),
        1.0 if any(requested) or found & _SETS_LENGTH else 0.0,
        *(math.log1p(r) for r in requested),
        *(1.0 if found >> bit & 1 else 0.0 for bit in range(len(_INDICATORS))),
    ]


class Featurizer:
    """Prompt text -> statistics and hashed token vector.

    ``stats_and_hashed`` runs the compiled kernel (``olproute.predict._featurize``: one pass over
    the UTF-8 bytes, every Unicode prompt, no fallback); ``compiled=False`` runs the
    plain-Python twin (``tokenize``, ``Counter``, ``prompt_stats``, ``hashed``), which
    gives bitwise-identical features and owns a bounded token-slot cache. Not
    thread-safe (the kernel has scratch buffers): one featurizer per thread.
    """

    __slots__ = ("_cache", "_kernel", "num_dims")

    def __init__(self, num_dims: int = NUM_HASH_DIMS, compiled: bool = True) -> None:
        self.num_dims = num_dims
        self._cache: dict[str, int] = {}
        self._kernel = new_kernel(num_dims) if compiled else None

    @property
    def compiled(self) -> bool:
        return self._kernel is not None

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
        """``STAT_NAMES`` values and the hashed token vector of one prompt. A lone
        surrogate (no UTF-8 form) counts as U+FFFD, the replacement character."""
        try:
            return self._stats_and_hashed(text)
        except UnicodeEncodeError:
            return self._stats_and_hashed(_SURROGATE_RE.sub("\ufffd", text))

    def _stats_and_hashed(self, text: str) -> tuple[list[float], FloatArray]:
        if self._kernel is None:
            tokens = tokenize(text)
            counts = Counter(tokens)
            return prompt_stats(text, tokens, counts), self.hashed(counts, len(tokens))
        hashed = np.empty(self.num_dims)
        counts_found = self._kernel.run(text.lower(), hashed)
        return _kernel_stats(text, *counts_found), hashed


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
