"""How many tokens an emulated request generates: it stops like a model, at its
end-of-sequence token, or at ``max_tokens``.

A request's natural length (where its EOS falls, counting the EOS as vLLM counts it in
``completion_tokens``) depends only on its prompt and the model, as greedy decoding
does, so the same prompt on the same model always stops at the same token:

1. **Truth**, when the prompt is in the truth index: prompt key -> {model: output tokens}.
   The index holds the prompts of the config's ``kind: synthetic`` workload, regenerated
   by the simulator's own function (``olproute.sim.requests.synthetic_prompts``: the same
   texts and per-model lengths a simulation of that config and seed runs), and the rows
   of a truth file (``olproute emulate --truth``: CSV or JSONL with ``prompt``, ``model``,
   ``output_tokens``, as ``olproute train-predictors --save-data`` and
   ``olproute.sim.prompts.write_training_file`` write them); a file's row wins over the
   workload's for the same prompt and model.
2. Otherwise a **draw from a trace's output lengths** (default: ``num_decode_tokens`` of
   ``data/traces/splitwise_conv.csv``), by inverse CDF: the lengths sorted, ``s[floor(u *
   n)]``, where the uniform ``u`` in [0, 1) is the first 8 bytes of
   ``blake2b(prompt key + b"\\0" + model name, key = seed as 8 little-endian bytes)``
   (53 bits of them). Nothing here uses Python's salted ``hash()``, so a prompt's length
   is the same in every process; the seed is the emulator's (``--seed``, default
   ``sim.seed``).

The request then generates ``n = min(natural, max_tokens)`` tokens, at least 1, and
finishes with ``finish_reason: "length"`` when ``n == max_tokens`` (vLLM v1 checks the
length cap before the EOS, so an EOS that is the last allowed token is a ``length`` too),
else ``"stop"``. ``exact`` lengths (``--exact-lengths``) skip all this: always
``max_tokens``, ``length``.

The prompt key (``prompt_key``, ``body_prompt_key``) is a 16-byte blake2b digest of the
prompt as the emulator receives it (the router's proxy forwards the body's prompt
unchanged): a completion's ``prompt`` string (a batch of one: its one string) as UTF-8;
a token-id list by its ids as 64-bit little-endian integers (in decimal, joined by
commas, if one does not fit; hashed with another personalisation, so it never equals a
text's key); a chat's messages by the texts of their contents (a list of content parts:
their ``text`` joined by a space) joined by ``"\\n"``, roles left out, so a chat of one
user message holding a prompt has that prompt's key. A benchmark computes the length the
emulator will produce with ``OutputLengths.tokens(prompt_key(text), model, max_tokens)``
(or ``tokens_of_body``), no HTTP involved.
"""

from __future__ import annotations

import array
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from olproute.config.loader import REPO_ROOT, LoadedConfig
from olproute.predict.training import csv_rows, jsonl_rows, output_tokens
from olproute.sim.requests import synthetic_prompts
from olproute.sim.workloads import WorkloadError, read_lengths_csv

DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "splitwise_conv.csv"
TRUTH_COLUMNS = ("prompt", "model", "output_tokens")
_TEXT, _IDS = b"olproute-text", b"olproute-ids"

FinishReason = Literal["stop", "length"]
TruthIndex = dict[bytes, dict[str, int]]


class TruthFileError(WorkloadError):
    """A truth file is unreadable or malformed; the message names the file, the line and
    the column (field) at fault."""


# -- prompt keys ---------------------------------------------------------------------------
def prompt_key(prompt: str | Sequence[int]) -> bytes:
    """The key of a completion prompt: a text, or a list of token ids."""
    if isinstance(prompt, str):
        return blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=16,
                       person=_TEXT).digest()
    try:
        ids = array.array("q", prompt)
        if sys.byteorder == "big":
            ids.byteswap()
        raw = ids.tobytes()  # 64-bit little-endian
    except OverflowError:  # an id beyond 64 bits: in decimal, comma-separated
        raw = ",".join(map(str, prompt)).encode()
    return blake2b(raw, digest_size=16, person=_IDS).digest()


def chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text a chat request is keyed by: each message's content (parts' texts joined
    by a space) joined by a newline; roles play no part."""
    return "\n".join(_content_text(m.get("content")) for m in messages)


def _content_text(content: object) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def body_prompt_key(body: Mapping[str, Any],
                    kind: Literal["completion", "chat"] | None = None) -> bytes:
    """The key of a request body: its ``prompt`` (``kind`` completion) or ``messages``
    (chat); without ``kind``, a body with ``messages`` and no ``prompt`` is a chat. The
    body must be valid (``olproute.emulator.protocol.parse_request`` accepts it)."""
    if kind is None:
        kind = "chat" if "messages" in body and "prompt" not in body else "completion"
    if kind == "chat":
        return prompt_key(chat_text(body["messages"]))
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    return prompt_key(prompt)


# -- lengths -------------------------------------------------------------------------------
class OutputLengths:
    """Where each request stops (see the module docstring): ``truth`` first, else a
    seeded inverse-CDF draw from ``trace_tokens`` (output lengths, each >= 1); ``exact``
    gives every request its ``max_tokens``. Immutable once built; pure lookups."""

    __slots__ = ("_key", "_sorted", "exact", "seed", "truth")

    def __init__(self, trace_tokens: npt.ArrayLike, *, seed: int = 0,
                 truth: Mapping[bytes, Mapping[str, int]] | None = None,
                 exact: bool = False) -> None:
        lengths = np.sort(np.asarray(trace_tokens, dtype=np.int64).ravel())
        if lengths.size == 0 or lengths[0] < 1:
            raise ValueError("trace_tokens must be a non-empty array of lengths >= 1")
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self._sorted: list[int] = lengths.tolist()
        self._key = seed.to_bytes(8, "little")
        self.seed = seed
        self.truth: Mapping[bytes, Mapping[str, int]] = MappingProxyType(
            {k: MappingProxyType(dict(v)) for k, v in (truth or {}).items()})
        self.exact = exact

    @classmethod
    def from_trace(cls, path: str | os.PathLike[str] = DEFAULT_TRACE, *, seed: int = 0,
                   truth: Mapping[bytes, Mapping[str, int]] | None = None,
                   exact: bool = False) -> OutputLengths:
        """Draws from the ``num_decode_tokens`` column of a trace CSV."""
        return cls(trace_output_tokens(path), seed=seed, truth=truth, exact=exact)

    @property
    def trace_tokens(self) -> list[int]:
        """The trace's output lengths, sorted."""
        return list(self._sorted)

    def uniform(self, key: bytes, model: str) -> float:
        """The prompt's seeded uniform in [0, 1) on ``model``."""
        digest = blake2b(key + b"\0" + model.encode(), digest_size=8, key=self._key).digest()
        return (int.from_bytes(digest, "little") >> 11) / (1 << 53)

    def natural(self, key: bytes | str, model: str) -> int:
        """Tokens up to and with the EOS, uncapped: the truth, else the trace draw.
        ``key`` is a prompt key, or a prompt text (keyed by ``prompt_key``)."""
        k = prompt_key(key) if isinstance(key, str) else key
        by_model = self.truth.get(k)
        if by_model is not None and model in by_model:
            return max(1, by_model[model])
        return self._sorted[int(self.uniform(k, model) * len(self._sorted))]

    def tokens(self, key: bytes | str, model: str, max_tokens: int
               ) -> tuple[int, FinishReason]:
        """(tokens generated, finish reason) of a request for ``max_tokens`` (>= 1)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        n = max_tokens if self.exact else min(self.natural(key, model), max_tokens)
        return n, "length" if n == max_tokens else "stop"

    def tokens_of_body(self, body: Mapping[str, Any], model: str, max_tokens: int,
                       kind: Literal["completion", "chat"] | None = None
                       ) -> tuple[int, FinishReason]:
        """``tokens`` of a request body (keyed by ``body_prompt_key``; not hashed when
        lengths are exact)."""
        if self.exact:
            return self.tokens(b"", model, max_tokens)
        return self.tokens(body_prompt_key(body, kind), model, max_tokens)


@functools.lru_cache(maxsize=8)
def _trace_tokens_cached(path: str, mtime_ns: int) -> tuple[int, ...]:
    return tuple(read_lengths_csv(path)[1].tolist())


def trace_output_tokens(path: str | os.PathLike[str] = DEFAULT_TRACE) -> tuple[int, ...]:
    """The output lengths of a trace CSV (``num_decode_tokens``), read once per file
    version. Raises WorkloadError naming the file (and line) when it is unusable."""
    p = os.fspath(path)
    try:
        mtime = os.stat(p).st_mtime_ns
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read: {exc.strerror}") from None
    tokens = _trace_tokens_cached(p, mtime)
    if not tokens:
        raise WorkloadError(f"{p}: no rows")
    return tokens


# -- the truth index ------------------------------------------------------------------------
def synthetic_truth(loaded: LoadedConfig, seed: int | None = None) -> TruthIndex:
    """The truth index of the config's workload: its prompts and per-model output lengths
    when it is ``kind: synthetic`` (regenerated exactly as the simulator draws them on
    ``seed``, default ``sim.seed``), else empty. A model answers a prompt one way: when
    the generator drew the same text twice (short instruction prompts repeat), the first
    draw's lengths are that text's."""
    if loaded.config.workload.kind != "synthetic":
        return {}
    try:
        reqs = synthetic_prompts(loaded, seed)
    except ValueError as exc:  # a pool model without synthetic truth
        raise WorkloadError(f"{loaded.path}: workload: {exc}") from None
    index: TruthIndex = {}
    for r in reqs:
        if r.text is not None and r.decode_tokens_by_model:
            known = index.setdefault(prompt_key(r.text), {})
            for model, tokens in r.decode_tokens_by_model.items():
                known.setdefault(model, tokens)
    return index


def read_truth_file(path: str | os.PathLike[str]) -> TruthIndex:
    """The truth index of a CSV (header naming at least ``prompt``, ``model``,
    ``output_tokens``) or JSONL file (``.jsonl``/``.ndjson``: one object per line with
    those keys). A row that repeats a prompt and model must repeat its length too. Raises
    TruthFileError naming the file, line and column of the first problem."""
    p = Path(path)
    if not p.is_file():
        raise TruthFileError(f"{p}: no such file")
    rows = (jsonl_rows(p, TruthFileError) if p.suffix in (".jsonl", ".ndjson")
            else csv_rows(p, TRUTH_COLUMNS, TruthFileError))
    index: TruthIndex = {}
    first_line: dict[tuple[bytes, str], int] = {}
    try:
        for line, row in rows:
            key, model, tokens = _truth_row(row, f"{p}: line {line}")
            known = index.setdefault(key, {})
            if known.get(model, tokens) != tokens:
                raise TruthFileError(
                    f"{p}: line {line}: output_tokens: {tokens} for a prompt and model given "
                    f"{known[model]} on line {first_line[(key, model)]}")
            known[model] = tokens
            first_line.setdefault((key, model), line)
    except UnicodeDecodeError as exc:
        raise TruthFileError(f"{p}: not UTF-8 text: {exc.reason}") from None
    if not index:
        raise TruthFileError(f"{p}: no truth rows")
    return index


def _truth_row(row: Mapping[str, object], where: str) -> tuple[bytes, str, int]:
    prompt, model, raw = row.get("prompt"), row.get("model"), row.get("output_tokens")
    if not isinstance(prompt, str) or not prompt:
        raise TruthFileError(f"{where}: prompt: expected non-empty text, got {prompt!r}")
    if not isinstance(model, str) or not model.strip():
        raise TruthFileError(f"{where}: model: expected a model name, got {model!r}")
    return prompt_key(prompt), model.strip(), output_tokens(raw, where, TruthFileError)


def output_lengths(loaded: LoadedConfig | None = None, *, seed: int | None = None,
                   truth_path: str | os.PathLike[str] | None = None,
                   trace_path: str | os.PathLike[str] = DEFAULT_TRACE,
                   exact: bool = False) -> OutputLengths:
    """The emulator's ``OutputLengths`` for a config: the synthetic workload's truth
    (if any) and the truth file's (``truth_path``) over draws from ``trace_path``, seeded
    by ``seed`` (default: the config's ``sim.seed``, else 0). With ``exact`` only
    ``max_tokens`` counts, and nothing is read."""
    run_seed = seed if seed is not None else (0 if loaded is None else loaded.config.sim.seed)
    if exact:
        return OutputLengths([1], seed=run_seed, exact=True)
    truth: TruthIndex = {} if loaded is None else synthetic_truth(loaded, run_seed)
    if truth_path is not None:
        for key, by_model in read_truth_file(truth_path).items():
            truth.setdefault(key, {}).update(by_model)
    return OutputLengths.from_trace(trace_path, seed=run_seed, truth=truth)


def describe_lengths(lengths: OutputLengths) -> str:
    """One line on where requests stop, for a log."""
    if lengths.exact:
        return "exact lengths (every request generates max_tokens)"
    return (f"output lengths: truth for {len(lengths.truth):,} prompt(s), else draws from "
            f"{len(lengths.trace_tokens):,} trace lengths (seed {lengths.seed})")
