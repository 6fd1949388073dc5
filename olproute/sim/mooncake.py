"""Mooncake request traces (``data/mooncake``, FAST'25): arrivals, lengths, and which
prompt blocks are shared, as hashes of the engines' blocks for their prefix caches.

A trace is JSON lines: ``timestamp`` (arrival, milliseconds from the trace's start),
``input_length`` and ``output_length`` (tokens), and ``hash_ids``: one id per 512-token
block of the prompt (``TRACE_BLOCK_TOKENS``; the last block may be partial), remapped so
that equal ids mean a reusable prefix KV cache. The ids are prefix ids: equal ids at block
i mean equal blocks 0..i (both shipped traces satisfy it: an id always follows the same
ids). ``engine_block_hashes`` derives one hash per full block of the engines' block size
(``block_tokens``), keeping exactly that identity.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from olproute.sim.workloads import IntArray, Trace, WorkloadError

TRACE_BLOCK_TOKENS = 512
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True, eq=False)
class MooncakeTrace:
    """A Mooncake trace as read: ``trace`` (arrival seconds, prompt and output tokens) and,
    per row, its ``hash_ids`` (read-only int64, one per 512-token prompt block)."""

    trace: Trace
    hash_ids: tuple[IntArray, ...]

    def __len__(self) -> int:
        return len(self.trace)


def _row(line: str, where: str) -> tuple[float, int, int, list[int]]:
    """(timestamp ms, input tokens, output tokens, hash ids) of one line, checked."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not a JSON object: {exc.msg}") from None
    if not isinstance(obj, dict) or any(k not in obj for k in _KEYS):
        raise WorkloadError(f"{where}: expected an object with keys {', '.join(_KEYS)}")
    ts, prompt, output, ids = (obj[k] for k in _KEYS)
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) \
            or ts < 0:
        raise WorkloadError(f"{where}: timestamp: expected milliseconds >= 0, got {ts!r}")
    for key, value in (("input_length", prompt), ("output_length", output)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise WorkloadError(f"{where}: {key}: expected a positive integer, got {value!r}")
    if (not isinstance(ids, list)
            or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in ids)):
        raise WorkloadError(f"{where}: hash_ids: expected a list of integers >= 0")
    if len(ids) != math.ceil(prompt / TRACE_BLOCK_TOKENS):
        raise WorkloadError(f"{where}: hash_ids: {len(ids)} ids for {prompt} prompt tokens, "
                            f"expected one per {TRACE_BLOCK_TOKENS}-token block "
                            f"({math.ceil(prompt / TRACE_BLOCK_TOKENS)})")
    return float(ts), prompt, output, ids


def read_mooncake_jsonl(path: str | os.PathLike[str], time_scale: float = 1.0) -> MooncakeTrace:
    """Read a Mooncake trace, every row in file order. ``arrival_s = (timestamp - first
    timestamp) / 1000 * time_scale`` (timestamps are milliseconds). Rows must be sorted by
    timestamp, lengths integers >= 1 and ``hash_ids`` one id >= 0 per 512-token block;
    a violation raises WorkloadError naming the file and the line."""
    if not (math.isfinite(time_scale) and time_scale > 0.0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    name = os.fspath(path)
    stamps: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    ids: list[IntArray] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{name}: line {number}"
            ts, prompt, output, row_ids = _row(line, where)
            if stamps and ts < stamps[-1]:
                raise WorkloadError(f"{where}: timestamp: {ts!r} is earlier than the previous "
                                    f"row's {stamps[-1]!r}; rows must be sorted by arrival")
            stamps.append(ts)
            prompts.append(prompt)
            outputs.append(output)
            a = np.array(row_ids, dtype=np.int64)
            a.setflags(write=False)
            ids.append(a)
    arrival_s = np.array(stamps, dtype=np.float64)
    if len(arrival_s):
        arrival_s = (arrival_s - arrival_s[0]) / 1000.0 * time_scale
    trace = Trace(arrival_s, np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64))
    return MooncakeTrace(trace, tuple(ids))


def prefix_nodes(hash_ids: Sequence[IntArray]) -> tuple[IntArray, ...]:
    """Per row, a node id per trace block naming the chain of ids up to it: the chains
    of the whole trace are numbered 0, 1, 2, ... in order of first appearance (a trie
    over ``hash_ids``: node(i) = the number of (node(i - 1), hash_ids[i]), with node(-1) =
    -1), so equal nodes mean equal ids from the first block on, whatever ids mean."""
    numbers: dict[tuple[int, int], int] = {}
    out = []
    for row in hash_ids:
        parent = -1
        nodes = np.empty(len(row), dtype=np.int64)
        for i, x in enumerate(row.tolist()):
            parent = numbers.setdefault((parent, x), len(numbers))
            nodes[i] = parent
        out.append(nodes)
    return tuple(out)


def engine_block_hashes(mc: MooncakeTrace, block_tokens: int) -> tuple[IntArray, ...]:
    """Per row, the hashes of the prompt's full blocks of ``block_tokens`` tokens (which
    must divide 512): engine block k lies in trace block i = k // r at index j = k % r,
    r = 512 / block_tokens, and its hash is ``node(i) * r + j`` with ``node`` the row's
    ``prefix_nodes``. A hash is thus the whole prefix up to its block, as vLLM's chained
    hashes are: two rows' engine blocks k have equal hashes exactly when their trace ids
    agree up to block i (and a partial last trace block has as many full engine blocks in
    both, its id fixing its length). Only full blocks: ``prompt_tokens // block_tokens``
    hashes per row. Read-only int64 arrays, values >= 0."""
    if block_tokens < 1 or TRACE_BLOCK_TOKENS % block_tokens:
        raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}, got {block_tokens}")
    r = TRACE_BLOCK_TOKENS // block_tokens
    out = []
    for nodes, prompt in zip(prefix_nodes(mc.hash_ids), mc.trace.prompt_tokens.tolist(),
                             strict=True):
        k = np.arange(prompt // block_tokens, dtype=np.int64)
        h = nodes[k // r] * r + k % r
        h.setflags(write=False)
        out.append(h)
    return tuple(out)


def load_mooncake(path: str | os.PathLike[str], block_tokens: int,
                  time_scale: float = 1.0) -> Trace:
    """A Mooncake trace as a ``Trace`` whose rows carry their engine block hashes."""
    mc = read_mooncake_jsonl(path, time_scale)
    t = mc.trace
    return Trace(t.arrival_s, t.prompt_tokens, t.decode_tokens,
                 engine_block_hashes(mc, block_tokens))


def repeat_fraction(blocks: Sequence[IntArray]) -> float:
    """The fraction of all blocks (hashes or ids, over every row) that repeat one seen
    earlier in the trace: the prompt blocks an unbounded cache would hold already."""
    if not blocks:
        return 0.0
    values = np.sort(np.concatenate(blocks))
    if not len(values):
        return 0.0
    distinct = 1 + int(np.count_nonzero(np.diff(values)))
    return 1.0 - distinct / len(values)
