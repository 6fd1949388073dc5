"""Workloads for the simulator: arrival processes, request traces and per-request targets.

Times are seconds and rates are requests per second unless a name says otherwise. Token
counts are integers. Every random draw takes a ``numpy.random.Generator`` from the caller;
nothing here touches global random state, so a seeded generator gives identical output.

Sources for the constants:

* BEAR paper, App. B, Table 3: the MMPP-2 arrival process (``mmpp2_rates``,
  ``mmpp2_arrivals``); App. A.2: per-request TTFT targets (``bear_ttft_targets_s``).
* Calibrate-then-Route paper: the tight / loose SLO classes (``TIGHT``, ``LOOSE``).
* ``data/traces``: the Splitwise and arXiv-summarization traces read by ``read_trace_csv``
  and ``read_lengths_csv``; ``data/mooncake``: the Mooncake traces with prompt block
  hashes, read by ``olproute.sim.mooncake``.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.types import Request

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ARRIVED_AT = "arrived_at"
PREFILL_TOKENS = "num_prefill_tokens"
DECODE_TOKENS = "num_decode_tokens"

# Upper bound on sojourns drawn per vectorised batch in ``mmpp2_arrivals`` (bounds memory).
_MAX_SOJOURN_BATCH = 1 << 20
# Lower bound on sojourns per batch, so tiny remainders do not cost one Python loop each.
_MIN_SOJOURN_BATCH = 64


class WorkloadError(ValueError):
    """A workload input file is malformed.

    The message names the file and, where it applies, the 1-based line number and the column,
    e.g. ``"data/x.csv: line 17: num_decode_tokens: expected a positive integer, got 'abc'"``.
    """


def _frozen_array(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[np.generic]:
    """Return a read-only 1-D copy of ``values`` with the given dtype."""
    array = np.array(values, dtype=dtype, copy=True)
    if array.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {array.shape}")
    array.setflags(write=False)
    return array


def _require_integer_dtype(name: str, values: npt.ArrayLike) -> None:
    """Raise ValueError unless ``values`` is an integer array (or empty)."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """A request trace: one row per request, sorted by arrival.

    ``arrival_s`` is float64 seconds, non-decreasing, first value >= 0. ``prompt_tokens`` and
    ``decode_tokens`` are int64 and >= 1. ``block_hashes``, when the trace has them, holds
    one read-only int64 array per row: the hashes of the prompt's full blocks of the
    engines' block size (``Request.block_hashes``). The arrays are stored as read-only
    copies, so a Trace is immutable. Equality is identity (compare the arrays to compare
    contents).
    """

    arrival_s: FloatArray
    prompt_tokens: IntArray
    decode_tokens: IntArray
    block_hashes: tuple[IntArray, ...] | None = None

    def __post_init__(self) -> None:
        _require_integer_dtype("prompt_tokens", self.prompt_tokens)
        _require_integer_dtype("decode_tokens", self.decode_tokens)
        arrival = _frozen_array(self.arrival_s, np.float64)
        prompt = _frozen_array(self.prompt_tokens, np.int64)
        decode = _frozen_array(self.decode_tokens, np.int64)
        if not len(arrival) == len(prompt) == len(decode):
            raise ValueError(
                "Trace arrays differ in length: "
                f"arrival_s {len(arrival)}, prompt_tokens {len(prompt)}, "
                f"decode_tokens {len(decode)}"
            )
        if len(arrival):
            if not np.all(np.isfinite(arrival)):
                raise ValueError("Trace.arrival_s must be finite")
            if arrival[0] < 0.0:
                raise ValueError(f"Trace.arrival_s must start at >= 0, got {arrival[0]}")
            if np.any(np.diff(arrival) < 0.0):
                raise ValueError("Trace.arrival_s must be non-decreasing")
            if prompt.min() < 1:
                raise ValueError("Trace.prompt_tokens must be >= 1")
            if decode.min() < 1:
                raise ValueError("Trace.decode_tokens must be >= 1")
        if self.block_hashes is not None and len(self.block_hashes) != len(arrival):
            raise ValueError(f"Trace.block_hashes has {len(self.block_hashes)} rows, the "
                             f"trace {len(arrival)}")
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_tokens", prompt)
        object.__setattr__(self, "decode_tokens", decode)

    def __len__(self) -> int:
        """Number of requests (rows)."""
        return len(self.arrival_s)

    def head(self, n: int) -> Trace:
        """The first ``n`` rows (all rows if ``n`` exceeds the length); ``n`` must be >= 0."""
        if n < 0:
            raise ValueError(f"head: n must be >= 0, got {n}")
        return Trace(self.arrival_s[:n], self.prompt_tokens[:n], self.decode_tokens[:n],
                     None if self.block_hashes is None else self.block_hashes[:n])

    def rescaled(self, factor: float) -> Trace:
        """The same rows with every arrival time multiplied by ``factor`` (> 0)."""
        _require_positive_finite("factor", factor)
        return Trace(self.arrival_s * factor, self.prompt_tokens, self.decode_tokens,
                     self.block_hashes)

    def window(self, start_s: float, end_s: float) -> Trace:
        """Rows with ``start_s <= arrival_s < end_s``, arrivals shifted by ``-start_s``;
        ``end_s`` may be infinite (to the last row).

        The returned trace's clock starts at the window's start, so its first arrival is the
        offset (seconds) of that request from ``start_s``, not necessarily 0.
        """
        if not (math.isfinite(start_s) and (math.isfinite(end_s) or end_s == math.inf)):
            raise ValueError(f"window: bounds must be finite, got [{start_s}, {end_s})")
        if end_s < start_s:
            raise ValueError(f"window: end_s {end_s} is before start_s {start_s}")
        lo = int(np.searchsorted(self.arrival_s, start_s, side="left"))
        hi = int(np.searchsorted(self.arrival_s, end_s, side="left"))
        return Trace(
            self.arrival_s[lo:hi] - start_s,
            self.prompt_tokens[lo:hi],
            self.decode_tokens[lo:hi],
            None if self.block_hashes is None else self.block_hashes[lo:hi],
        )


def _require_positive_finite(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number > 0."""
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _require_count(name: str, value: int) -> None:
    """Raise ValueError unless ``value`` is an integer >= 0."""
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def poisson_arrivals(rate_per_s: float, num_requests: int, rng: np.random.Generator) -> FloatArray:
    """Arrival times (s) of a homogeneous Poisson process with rate ``rate_per_s`` (req/s).

    The times are the cumulative sum of ``num_requests`` exponential gaps with mean
    ``1 / rate_per_s``, so the first arrival is at the first gap, not at 0.
    """
    _require_positive_finite("rate_per_s", rate_per_s)
    _require_count("num_requests", num_requests)
    gaps = rng.exponential(1.0 / rate_per_s, size=num_requests)
    return np.cumsum(gaps, dtype=np.float64)


def mmpp2_rates(
    mean_rate_per_s: float, ratio: float, high_fraction: float = 0.2
) -> tuple[float, float]:
    """Arrival rates (req/s) of the low and high states of a two-state MMPP.

    ``alpha_L = mean / ((1 - pH) + pH * r)`` and ``alpha_H = r * alpha_L``, with ``pH`` the
    long-run fraction of time in the high state and ``r`` the high/low ratio (>= 1), so the
    time-averaged rate is ``mean_rate_per_s`` (BEAR paper, App. B, Table 3).
    """
    _require_positive_finite("mean_rate_per_s", mean_rate_per_s)
    if not (math.isfinite(ratio) and ratio >= 1.0):
        raise ValueError(f"ratio must be a finite number >= 1, got {ratio!r}")
    if not 0.0 <= high_fraction <= 1.0:
        raise ValueError(f"high_fraction must be in [0, 1], got {high_fraction!r}")
    low = mean_rate_per_s / ((1.0 - high_fraction) + high_fraction * ratio)
    return low, ratio * low


@dataclass(frozen=True, slots=True, eq=False)
class Mmpp2Arrivals:
    """Arrivals of a two-state MMPP together with the hidden state path that produced them.

    The state is ``first_state`` (0 = low, 1 = high) on ``[0, state_change_s[0])`` and flips
    at each time in ``state_change_s`` (sorted, all < ``horizon_s``). The path is known on
    ``[0, horizon_s]``, and ``horizon_s`` >= the last arrival. Arrays are read-only copies;
    equality is identity.
    """

    arrival_s: FloatArray
    state_change_s: FloatArray
    first_state: int
    horizon_s: float

    def __post_init__(self) -> None:
        arrival = _frozen_array(self.arrival_s, np.float64)
        changes = _frozen_array(self.state_change_s, np.float64)
        if self.first_state not in (0, 1):
            raise ValueError(f"first_state must be 0 or 1, got {self.first_state!r}")
        if len(arrival) and arrival[-1] > self.horizon_s:
            raise ValueError(f"horizon_s {self.horizon_s} is before the last arrival")
        if len(changes) and (np.any(np.diff(changes) < 0.0) or changes[-1] > self.horizon_s):
            raise ValueError("state_change_s must be sorted and within [0, horizon_s]")
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "state_change_s", changes)

    def time_in_high_fraction(self) -> float:
        """Fraction of ``[0, horizon_s]`` spent in the high state.

        For a zero-length horizon this is the indicator of the starting state.
        """
        if self.horizon_s <= 0.0:
            return float(self.first_state)
        bounds = np.concatenate(([0.0], self.state_change_s, [self.horizon_s]))
        durations = np.diff(bounds)
        states = (self.first_state + np.arange(len(durations))) % 2
        return float(durations[states == 1].sum() / self.horizon_s)


def mmpp2_arrivals(
    mean_rate_per_s: float,
    ratio: float,
    num_requests: int,
    rng: np.random.Generator,
    high_fraction: float = 0.2,
    switch_low_to_high_per_s: float = 0.1,
    switch_high_to_low_per_s: float = 0.4,
) -> Mmpp2Arrivals:
    """Exact simulation of the first ``num_requests`` arrivals of a two-state MMPP.

    The hidden state is a CTMC that leaves low at ``switch_low_to_high_per_s`` and high at
    ``switch_high_to_low_per_s`` (per second); its stationary high fraction
    ``z_LH / (z_LH + z_HL)`` must equal ``high_fraction`` to within 1e-9 (ValueError
    otherwise), so rates from ``mmpp2_rates`` and the switching agree. The first state is
    drawn from the stationary distribution. Within a sojourn of length ``d`` in a state with
    rate ``a`` the arrival count is Poisson(``a * d``) and the times are sorted uniforms.
    ``horizon_s`` is the end of the sojourn holding the last returned arrival (0 if
    ``num_requests`` is 0).
    """
    _require_count("num_requests", num_requests)
    _require_positive_finite("switch_low_to_high_per_s", switch_low_to_high_per_s)
    _require_positive_finite("switch_high_to_low_per_s", switch_high_to_low_per_s)
    stationary_high = switch_low_to_high_per_s / (
        switch_low_to_high_per_s + switch_high_to_low_per_s
    )
    if abs(high_fraction - stationary_high) > 1e-9:
        raise ValueError(
            f"high_fraction {high_fraction!r} disagrees with the switch rates, whose "
            f"stationary high fraction is {stationary_high!r}"
        )
    low_rate, high_rate = mmpp2_rates(mean_rate_per_s, ratio, high_fraction)
    rates = np.array([low_rate, high_rate])
    exit_rates = np.array([switch_low_to_high_per_s, switch_high_to_low_per_s])
    first_state = int(rng.random() < stationary_high)
    if num_requests == 0:
        return Mmpp2Arrivals(np.empty(0), np.empty(0), first_state, 0.0)

    arrivals_per_sojourn = (low_rate / exit_rates[0] + high_rate / exit_rates[1]) / 2.0
    arrival_chunks: list[FloatArray] = []
    end_chunks: list[FloatArray] = []
    state, clock_s, remaining = first_state, 0.0, num_requests
    while True:
        wanted = math.ceil(1.25 * remaining / arrivals_per_sojourn)
        size = min(_MAX_SOJOURN_BATCH, max(_MIN_SOJOURN_BATCH, wanted))
        states = (state + np.arange(size)) % 2
        durations = rng.exponential(1.0 / exit_rates[states])
        ends = clock_s + np.cumsum(durations)
        starts = np.concatenate(([clock_s], ends[:-1]))
        counts = rng.poisson(rates[states] * durations)
        offsets = rng.random(int(counts.sum())) * np.repeat(durations, counts)
        # Sojourns are disjoint and consecutive, so one global sort orders each of them.
        times = np.sort(np.repeat(starts, counts) + offsets)
        cumulative = np.cumsum(counts)
        if cumulative[-1] >= remaining:
            last = int(np.searchsorted(cumulative, remaining, side="left"))
            arrival_chunks.append(times[:remaining])
            end_chunks.append(ends[: last + 1])
            break
        arrival_chunks.append(times)
        end_chunks.append(ends)
        remaining -= int(cumulative[-1])
        clock_s = float(ends[-1])
        state = int((state + size) % 2)
    all_ends = np.concatenate(end_chunks)
    return Mmpp2Arrivals(
        np.concatenate(arrival_chunks), all_ends[:-1], first_state, float(all_ends[-1])
    )


def _csv_rows(
    path: str | os.PathLike[str], columns: Sequence[str]
) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(line_number, values)`` for each non-blank data row of a CSV file.

    ``values`` are the raw strings of ``columns``, in that order, located by the header row
    (any column order, extra columns ignored). Line numbers are 1-based (the header is line
    1). Raises WorkloadError for a missing header, a missing or repeated column, or a row
    too short to hold the columns; OSError propagates if the file cannot be read.
    """
    name = os.fspath(path)
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise WorkloadError(f"{name}: line 1: missing header row")
        names = [field.strip() for field in header]
        indices: list[int] = []
        for column in columns:
            if column not in names:
                raise WorkloadError(f"{name}: missing column {column!r} (header: {names})")
            if names.count(column) > 1:
                raise WorkloadError(f"{name}: line 1: column {column!r} appears more than once")
            indices.append(names.index(column))
        needed = max(indices) + 1
        for row in reader:
            if not row or all(not field.strip() for field in row):
                continue
            if len(row) < needed:
                raise WorkloadError(
                    f"{name}: line {reader.line_num}: expected at least {needed} fields, "
                    f"got {len(row)}"
                )
            yield reader.line_num, [row[index] for index in indices]


def _parse_token_count(raw: str, where: str, column: str) -> int:
    """Parse a token count written as ``"374"`` or ``"374.0"``; it must be an integer >= 1.

    ``where`` is the ``"file: line N"`` prefix used in the WorkloadError message.
    """
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number.is_integer()):
            raise WorkloadError(
                f"{where}: {column}: expected a positive integer, got {raw!r}"
            ) from None
        value = int(number)
    if value < 1:
        raise WorkloadError(f"{where}: {column}: expected a positive integer (>= 1), got {raw!r}")
    return value


def _parse_arrival(raw: str, where: str) -> float:
    """Parse an ``arrived_at`` value (seconds); it must be a finite number."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise WorkloadError(f"{where}: {ARRIVED_AT}: expected a finite number, got {raw!r}")
    return value


def read_trace_csv(path: str | os.PathLike[str], time_scale: float = 1.0) -> Trace:
    """Read a timed trace (``arrived_at``, ``num_prefill_tokens``, ``num_decode_tokens``).

    Other columns are ignored and the columns may come in any order. Every row is kept, in
    file order (no dedup, no filtering). ``arrival_s = (arrived_at - first arrived_at) *
    time_scale``: a ``time_scale`` > 1 stretches the trace (lower load), < 1 compresses it;
    it must be finite and > 0 (ValueError). Rows must be sorted by ``arrived_at`` and token
    counts must be integers >= 1 (``"374"`` or ``"374.0"``); a violation raises WorkloadError
    naming the file and the line.
    """
    _require_positive_finite("time_scale", time_scale)
    name = os.fspath(path)
    arrivals: list[float] = []
    prompts: list[int] = []
    decodes: list[int] = []
    for line, (raw_arrival, raw_prompt, raw_decode) in _csv_rows(
        path, (ARRIVED_AT, PREFILL_TOKENS, DECODE_TOKENS)
    ):
        where = f"{name}: line {line}"
        arrival = _parse_arrival(raw_arrival, where)
        if arrivals and arrival < arrivals[-1]:
            raise WorkloadError(
                f"{where}: {ARRIVED_AT}: {raw_arrival.strip()} is earlier than the previous "
                f"row's {arrivals[-1]!r}; rows must be sorted by arrival"
            )
        arrivals.append(arrival)
        prompts.append(_parse_token_count(raw_prompt, where, PREFILL_TOKENS))
        decodes.append(_parse_token_count(raw_decode, where, DECODE_TOKENS))
    arrival_s = np.array(arrivals, dtype=np.float64)
    if len(arrival_s):
        arrival_s = (arrival_s - arrival_s[0]) * time_scale
    return Trace(arrival_s, np.array(prompts, dtype=np.int64), np.array(decodes, dtype=np.int64))


def read_lengths_csv(path: str | os.PathLike[str]) -> tuple[IntArray, IntArray]:
    """Read a length-only trace: ``(prompt_tokens, decode_tokens)`` as int64, in file order.

    Uses the ``num_prefill_tokens`` and ``num_decode_tokens`` columns (others ignored, any
    order), with the same validation and WorkloadError messages as ``read_trace_csv``.
    """
    name = os.fspath(path)
    prompts: list[int] = []
    decodes: list[int] = []
    for line, (raw_prompt, raw_decode) in _csv_rows(path, (PREFILL_TOKENS, DECODE_TOKENS)):
        where = f"{name}: line {line}"
        prompts.append(_parse_token_count(raw_prompt, where, PREFILL_TOKENS))
        decodes.append(_parse_token_count(raw_decode, where, DECODE_TOKENS))
    return np.array(prompts, dtype=np.int64), np.array(decodes, dtype=np.int64)


def lengths_with_arrivals(
    prompt_tokens: IntArray, decode_tokens: IntArray, arrival_s: FloatArray
) -> Trace:
    """Pair request lengths with generated arrival times (s).

    Row ``i`` gets ``arrival_s[i]`` and the lengths at ``i mod len(prompt_tokens)``: lengths
    cycle when there are more arrivals than lengths and are truncated when there are fewer.
    Shuffle the lengths beforehand (with your own rng) for a random pairing. The two length
    arrays must match in length, and be non-empty unless ``arrival_s`` is empty.
    """
    if len(prompt_tokens) != len(decode_tokens):
        raise ValueError(
            f"prompt_tokens ({len(prompt_tokens)}) and decode_tokens ({len(decode_tokens)}) "
            "differ in length"
        )
    if len(arrival_s) and not len(prompt_tokens):
        raise ValueError("prompt_tokens is empty but arrival_s is not")
    rows = np.arange(len(arrival_s)) % max(len(prompt_tokens), 1)
    return Trace(arrival_s, np.asarray(prompt_tokens)[rows], np.asarray(decode_tokens)[rows])


def trace_time_scale_for_rate(trace: Trace, target_rate_per_s: float) -> float:
    """Factor to multiply ``trace``'s arrival times by so its mean rate is the target.

    The mean rate of a trace is ``(n - 1) / (last arrival - first arrival)`` (req/s); the
    trace needs at least two rows and a positive span (ValueError otherwise).
    """
    _require_positive_finite("target_rate_per_s", target_rate_per_s)
    if len(trace) < 2:
        raise ValueError(f"trace needs at least 2 rows to have a rate, got {len(trace)}")
    span_s = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if span_s <= 0.0:
        raise ValueError("trace arrivals span zero time; its rate is undefined")
    current_rate = (len(trace) - 1) / span_s
    return current_rate / target_rate_per_s


def bear_ttft_targets_s(prompt_tokens: IntArray, rng: np.random.Generator) -> FloatArray:
    """Per-request TTFT targets in seconds (BEAR paper, App. A.2).

    In milliseconds, ``tau = min(1120, max(150, u + (155 + 3.5e-3 * p) * v))`` with
    ``u ~ U(1, 5)``, ``v ~ U(0.98, 1.02)`` drawn per request and ``p`` the prompt tokens
    (>= 0). The result is ``tau / 1000``. Since ``u + 155 v >= 152.9``, the 150 ms floor
    only matters for negative ``p``, which is rejected.
    """
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    if prompts.size and prompts.min() < 0:
        raise ValueError("prompt_tokens must be >= 0")
    u_ms = rng.uniform(1.0, 5.0, size=prompts.shape)
    v = rng.uniform(0.98, 1.02, size=prompts.shape)
    tau_ms = np.minimum(1120.0, np.maximum(150.0, u_ms + (155.0 + 3.5e-3 * prompts) * v))
    return tau_ms / 1000.0


@dataclass(frozen=True, slots=True)
class SloClass:
    """A service-level objective class: TTFT and TPOT targets (s) and a mixing weight (>= 0)."""

    name: str
    ttft_s: float
    tpot_s: float
    weight: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SloClass.name must be non-empty")
        _require_positive_finite("SloClass.ttft_s", self.ttft_s)
        _require_positive_finite("SloClass.tpot_s", self.tpot_s)
        if not (math.isfinite(self.weight) and self.weight >= 0.0):
            raise ValueError(f"SloClass.weight must be finite and >= 0, got {self.weight!r}")


TIGHT = SloClass("tight", 0.175, 0.0397, 1.0)
"""Calibrate-then-Route paper's tight class: 175 ms TTFT, 39.7 ms TPOT."""

LOOSE = SloClass("loose", 0.525, 0.1191, 1.0)
"""Three times ``TIGHT`` on both targets."""


def assign_slo_classes(
    num_requests: int, classes: Sequence[SloClass], rng: np.random.Generator
) -> IntArray:
    """Draw an SLO class per request: int64 indices into ``classes``, P(i) proportional to weight.

    ``classes`` must be non-empty with a positive total weight.
    """
    _require_count("num_requests", num_requests)
    if not classes:
        raise ValueError("classes must be non-empty")
    weights = np.array([slo.weight for slo in classes], dtype=np.float64)
    total = float(weights.sum())
    if total <= 0.0:
        raise ValueError("classes must have a positive total weight")
    draws = rng.choice(len(classes), size=num_requests, p=weights / total)
    return np.asarray(draws, dtype=np.int64)


def predicted_decode_tokens(
    decode_tokens: IntArray, noise: float, rng: np.random.Generator
) -> IntArray:
    """Noisy predictions of output lengths (tokens), as int64.

    ``noise == 0`` returns a copy of ``decode_tokens`` (an oracle). Otherwise each
    prediction is ``U((1 - noise) * o, (1 + noise) * o)`` rounded to the nearest integer and
    raised to at least 1. ``noise`` must be in [0, 1) and every ``o`` >= 1 (ValueError).
    """
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must be in [0, 1), got {noise!r}")
    _require_integer_dtype("decode_tokens", decode_tokens)
    true = np.array(decode_tokens, dtype=np.int64, copy=True)
    if true.size and true.min() < 1:
        raise ValueError("decode_tokens must be >= 1")
    if noise == 0.0:
        return true
    drawn = rng.uniform((1.0 - noise) * true, (1.0 + noise) * true)
    return np.maximum(np.rint(drawn), 1.0).astype(np.int64)


def predicted_quality(quality: FloatArray, noise: float, rng: np.random.Generator) -> FloatArray:
    """Noisy predictions of response quality in [0, 1]: ``quality`` plus an independent
    uniform error in [-``noise``, +``noise``] per entry, clipped to [0, 1]; ``noise == 0``
    returns a copy. ``noise`` must be in [0, 1] (ValueError)."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise!r}")
    q = np.array(quality, dtype=np.float64, copy=True)
    if noise == 0.0:
        return q
    result: FloatArray = np.clip(q + rng.uniform(-noise, noise, size=q.shape), 0.0, 1.0)
    return result


def build_requests(
    trace: Trace,
    ttft_target_s: FloatArray,
    predicted: IntArray,
    tpot_target_s: FloatArray | None = None,
    slo_class: Sequence[str] | None = None,
) -> list[Request]:
    """Turn a trace and per-row targets into ``Request`` objects.

    ``request_id`` is the row index. Every per-row argument must have ``len(trace)``
    entries (ValueError naming the argument otherwise). Fields hold plain Python ints and
    floats; ``tpot_target_s`` None leaves the TPOT target unset and ``slo_class`` None uses
    ``"default"``. A trace's block hashes go with their rows.
    """
    n = len(trace)
    per_row: dict[str, int] = {"ttft_target_s": len(ttft_target_s), "predicted": len(predicted)}
    if tpot_target_s is not None:
        per_row["tpot_target_s"] = len(tpot_target_s)
    if slo_class is not None:
        per_row["slo_class"] = len(slo_class)
    for argument, length in per_row.items():
        if length != n:
            raise ValueError(f"{argument} has {length} entries but the trace has {n} rows")
    arrivals = trace.arrival_s.tolist()
    prompts = trace.prompt_tokens.tolist()
    decodes = trace.decode_tokens.tolist()
    _require_integer_dtype("predicted", predicted)
    ttfts = np.asarray(ttft_target_s, dtype=np.float64).tolist()
    predictions = np.asarray(predicted, dtype=np.int64).tolist()
    tpots = None if tpot_target_s is None else np.asarray(tpot_target_s, np.float64).tolist()
    hashes = trace.block_hashes
    return [
        Request(
            request_id=i,
            arrival_s=arrivals[i],
            prompt_tokens=prompts[i],
            decode_tokens=decodes[i],
            predicted_decode_tokens=predictions[i],
            ttft_target_s=ttfts[i],
            tpot_target_s=None if tpots is None else tpots[i],
            slo_class="default" if slo_class is None else str(slo_class[i]),
            block_hashes=None if hashes is None else hashes[i],
        )
        for i in range(n)
    ]
