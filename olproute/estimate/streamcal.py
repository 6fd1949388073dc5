"""Calibration of the 4-term batch-time model from what a router sees of a backend: its
dispatches, the tokens its streams announce, and their ends.

A real engine (vLLM) does not publish its batches; its streams show them. Every engine
step gives each running decoder one token, so a stream's token events are step ends, and
between two of them, while nothing else changed on the backend, the engine ran a known
number of steps of known composition. ``RowBuilder`` turns the event sequence of one
backend into regression rows of the batch-time model summed over the steps an interval
spans (``StepRow``: duration, steps, tokens, decode context, prefill attention), from two
kinds of *clean* interval:

* **decode**: all requests on the backend decoding (none waiting or in prefill, none
  whose tokens are hidden), no dispatch and no end. One request (the segment's
  *reference*) times the steps: each of its events ends a step of the n decoders, so a
  row of k steps (``min_decode_steps`` or more) is k batches of n tokens whose contexts
  (prompt + tokens so far - 1 each) grow by n per step. One row per step boundary of one
  request, not one per request: a step is counted once. (The contexts are those known
  at the reference's event: a decoder whose event of the same step comes after it
  counts one token short.)
* **prefill**: a request dispatched while every other request there was decoding, with
  no other dispatch and no end until its first token. Its time to first token is the
  chunked prefill of its prompt (``max_num_batched_tokens`` less the running decoders'
  tokens per step, the decoders in every step) plus, when decoders were running, the
  expected rest of the step running at dispatch (half a step, as regressors: the row's
  step count is then fractional).

Rows carry the step count as the model's constant column (``StepRow.regressors``), so
they are fitted like batch records (NNLS on relative error), with one more column: 1 for a
prefill row. A time to first token holds more than the engine's steps: the request's way
into the engine (HTTP, the API server, its queue to the engine) and its first token's way
out, which the gaps between tokens do not hold. Fitted alone (``StreamFit.overhead_s``;
about 8 ms against 4 ms steps on vLLM's CPU build), it stays out of beta, which remains
the batch-time model. ``StreamCalibrator`` keeps a window of rows and refits only when
both kinds are there (beta3 and the overhead need prefill rows, beta1 apart from beta0
both), otherwise it keeps its beta.

``StreamRecorder`` is the request path's half: each backend's dispatches, token events and
ends appended to a bounded deque with a sequence number and the backend's number of
requests in flight (so the builder detects lost events and resynchronises). Its clock is
``time.perf_counter`` (the event loop's clock counts whole milliseconds under uvloop).

Assumptions (what makes an interval clean): the router is the backend's only client (the
snapshot assumes it too); one token per step per decoder (no speculative decoding); no
preemption; the prompt token counts are those the router knows (exact for token-id
prompts); a stream reports every token, counted by ``token_ids`` where the backend returns
them (vLLM's ``return_token_ids``) and else one per event with text.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from olproute.estimate.calibration import Beta, CalibrationError, fit_nonnegative

FloatArray = npt.NDArray[np.float64]
RowKind = Literal["decode", "prefill"]

# event kinds: a streamed dispatch, a dispatch whose tokens come whole at its end
# (opaque: its progress is unseen), tokens announced, an end
DISPATCH, OPAQUE, TOKEN, END = 0, 1, 2, 3
# a decode row is final once an event comes this many of its steps after its end: a
# decoder's end, reported after its last token, comes sooner and drops the rows that
# counted it in steps after that token
SETTLE_STEPS = 2.0
# (sequence number, kind, request id, time s, value, requests in flight after it); value:
# the prompt tokens of a dispatch, the tokens of a token event, 0 for an end
Event = tuple[int, int, int, float, int, int]


@dataclass(frozen=True, slots=True)
class StepRow:
    """One clean interval as a row of the batch-time model, summed over its steps.

    ``num_steps`` is the constant column (fractional for a prefill row that counts half
    of the step running at its dispatch). ``end_s``: when the interval ended, on the
    recorder's clock (it began ``duration_s`` before). A prefill row also keeps its
    prompt and the decoders running at dispatch (their number and context sum), for the
    prefill throughput."""

    kind: RowKind
    duration_s: float
    num_steps: float
    num_tokens: float
    sum_decode_context: float
    sum_prefill_attention: float
    end_s: float = 0.0
    prompt_tokens: int = 0
    num_decoders: int = 0
    decode_context: float = 0.0

    @property
    def regressors(self) -> tuple[float, float, float, float]:
        return (self.num_steps, self.num_tokens, self.sum_decode_context,
                self.sum_prefill_attention)


def decode_row(num_decoders: int, decode_context: float, num_steps: int,
               duration_s: float, end_s: float = 0.0) -> StepRow:
    """``num_steps`` steps of ``num_decoders`` decoders whose contexts sum to
    ``decode_context`` at the first step and grow by one each per step."""
    n, k = float(num_decoders), float(num_steps)
    return StepRow("decode", duration_s, k, n * k,
                   k * decode_context + n * k * (k - 1.0) / 2.0, 0.0, end_s)


def prefill_row(prompt_tokens: int, max_num_batched_tokens: int, num_decoders: int,
                decode_context: float, duration_s: float,
                end_s: float = 0.0) -> StepRow | None:
    """The time to first token of a prompt dispatched while ``num_decoders`` decoders
    (context sum ``decode_context`` in the step running then) ran: half that step when
    there were decoders, then the prompt in chunks of the budget less one token per
    decoder, the decoders in every step. None when the decoders leave no budget."""
    n = num_decoders
    chunk_budget = max_num_batched_tokens - n
    if chunk_budget < 1 or prompt_tokens < 1:
        return None
    half = 0.5 if n else 0.0
    tokens, context, attention = half * n, half * decode_context, 0.0
    computed = steps = 0
    while computed < prompt_tokens:
        chunk = min(prompt_tokens - computed, chunk_budget)
        steps += 1
        tokens += n + chunk
        context += decode_context + n * steps   # each decoder one token further per step
        attention += float(chunk) * computed + chunk * (chunk + 1) / 2.0
        computed += chunk
    return StepRow("prefill", duration_s, half + steps, tokens, context, attention, end_s,
                   prompt_tokens, n, decode_context)


def row_arrays(rows: Sequence[StepRow]) -> tuple[FloatArray, FloatArray]:
    """(x (n, 5), durations (n,)) of rows: the four regressors, then 1 for a prefill row
    (its dispatch overhead's column)."""
    x = np.array([(*r.regressors, 1.0 if r.kind == "prefill" else 0.0) for r in rows],
                 dtype=np.float64).reshape(len(rows), 5)
    y = np.array([r.duration_s for r in rows], dtype=np.float64)
    return x, y


@dataclass(frozen=True, slots=True)
class StreamFit:
    """Beta fitted to stream rows, and the dispatch overhead: the time to first token
    beyond the engine's steps (the request's way into the engine, its first token's way
    out), fitted beside it so that beta stays the batch-time model."""

    beta: Beta
    overhead_s: float

    def predict(self, rows: Sequence[StepRow]) -> FloatArray:
        x, _ = row_arrays(rows)
        out: FloatArray = x @ np.array([*self.beta, self.overhead_s], dtype=np.float64)
        return out


def fit_rows(rows: Sequence[StepRow]) -> StreamFit:
    """beta >= 0 and the dispatch overhead >= 0 fitted to the rows by NNLS on relative
    error (``olproute.estimate.calibration.fit_nonnegative``, the steps as beta0's column)."""
    x, y = row_arrays(rows)
    b = fit_nonnegative(x, y)
    return StreamFit((float(b[0]), float(b[1]), float(b[2]), float(b[3])), float(b[4]))


def rows_mape(fit: StreamFit, rows: Sequence[StepRow]) -> float:
    """Mean absolute percentage error (as a fraction) of a fit's row durations."""
    if not rows:
        return float("nan")
    _, y = row_arrays(rows)
    return float(np.mean(np.abs(fit.predict(rows) / y - 1.0)))


def median_ape(fit: StreamFit, rows: Sequence[StepRow]) -> float:
    """Median absolute percentage error (as a fraction) of a fit's row durations."""
    _, y = row_arrays(rows)
    return float(np.median(np.abs(fit.predict(rows) / y - 1.0)))


def identified(rows: Sequence[StepRow]) -> bool:
    """Do the rows determine beta and the overhead (full column rank once each column is
    scaled to unit norm)?"""
    if len(rows) < 5:
        return False
    x, _ = row_arrays(rows)
    norms = np.linalg.norm(x, axis=0)
    if np.any(norms == 0):
        return False
    return int(np.linalg.matrix_rank(x / norms, tol=1e-9)) == 5


# -- the request path's half -------------------------------------------------------------
class StreamRecorder:
    """One backend's dispatches, token events and ends, appended to a bounded deque (cheap:
    the request path calls it). ``drain`` empties it from any thread (a deque's appends
    and pops are atomic). ``enabled = False`` stops recording (a backend whose batch
    records are read instead)."""

    def __init__(self, maxlen: int = 1 << 17,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._events: deque[Event] = deque(maxlen=maxlen)
        self._seq = 0
        self._in_flight = 0
        self._clock = clock
        self.enabled = True

    def dispatched(self, request_id: int, prompt_tokens: int, streamed: bool = True) -> None:
        """A request sent to the backend now; ``streamed=False``: its tokens are only
        known at its end."""
        if self.enabled:
            self._in_flight += 1
            self._append(DISPATCH if streamed else OPAQUE, request_id, prompt_tokens)

    def token(self, request_id: int, count: int = 1) -> None:
        """``count`` tokens of the request arrived now."""
        if self.enabled:
            self._append(TOKEN, request_id, count)

    def ended(self, request_id: int) -> None:
        """The request's answer ended now (whole, failed or cut)."""
        if self.enabled:
            self._in_flight -= 1
            self._append(END, request_id, 0)

    def _append(self, kind: int, request_id: int, value: int) -> None:
        self._events.append((self._seq, kind, request_id, self._clock(), value,
                             self._in_flight))
        self._seq += 1

    def drain(self) -> list[Event]:
        """The events recorded since the last drain, oldest first (some may have been
        lost to the bound: their sequence numbers are missing)."""
        out = []
        pop = self._events.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out

    def clear(self) -> None:
        self._events.clear()


# -- from events to rows -------------------------------------------------------------------
@dataclass(slots=True)
class _Req:
    prompt: int
    opaque: bool
    tokens: int = 0
    first_token_s: float = -1.0
    last_token_s: float = -1.0


@dataclass(slots=True)
class _Boundary:
    time_s: float
    tokens: int            # the reference's tokens after this step
    decode_context: float  # every decoder's context sum for the next step


@dataclass(slots=True)
class _Segment:
    """A stable stretch: the same decoders, nothing else, timed by its reference's step
    ends: the first one, the start of the next row (a timely one) and the latest one
    (not judged yet: judged by the gap to the next)."""

    reference: int
    num_decoders: int
    first: _Boundary | None = None
    start: _Boundary | None = None
    pending: _Boundary | None = None


@dataclass(slots=True)
class _Candidate:
    """A request whose time to first token may make a prefill row."""

    request_id: int
    dispatch_s: float
    num_decoders: int
    decode_context: float


@dataclass(slots=True)
class _PendingPrefill:
    """A prefill row whose first token is judged timely or not at the request's next
    event."""

    request_id: int
    row: StepRow
    first_token_s: float


class RowBuilder:
    """Clean intervals of one backend's event sequence as ``StepRow`` s (module docstring).

    ``feed(events)`` returns the rows settled by those events; the state (requests in
    flight, the open segment, rows that wait to be settled) carries over to the next
    call.

    Only *timely* events end a row. A stream that fell behind (a busy API server, a busy
    client) delivers held-back tokens in a burst: the burst's last event is timely, the
    others are late by up to the stall. An event is taken as timely when the same
    request's next event comes at least ``burst_fraction`` of a step later (the step:
    the segment's mean so far once it spans ``min_decode_steps`` steps, else the recent
    rows' mean). A decode row is held until an event ``SETTLE_STEPS`` of its steps after
    its end shows that no decoder had ended before it (an end is reported after its last
    token)."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int,
                 min_decode_steps: int = 4, burst_fraction: float = 0.25) -> None:
        if min(max_num_batched_tokens, max_num_seqs, min_decode_steps) < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and min_decode_steps "
                             "must be >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.min_decode_steps = min_decode_steps
        self.burst_fraction = burst_fraction
        self._reqs: dict[int, _Req] = {}
        self._num_unclear = 0          # requests waiting, in prefill, or opaque
        self._decode_context = 0.0     # decoders' context sum for their next step
        self._expected = 0
        self._synced = True
        self._segment: _Segment | None = None
        self._candidate: _Candidate | None = None
        self._prefill: _PendingPrefill | None = None
        self._held: list[tuple[float, StepRow]] = []   # (end time, decode row)
        self._step_s = 0.0             # recent decode rows' mean step, 0 before any
        self._out: list[StepRow] = []
        self.num_events = 0
        self.num_lost = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)

    def feed(self, events: Iterable[Event]) -> list[StepRow]:
        for ev in events:
            self._event(ev)
        out, self._out = self._out, []
        return out

    def _event(self, ev: Event) -> None:
        seq, kind, rid, t, value, in_flight = ev
        if seq != self._expected:
            self._lose(seq - self._expected)
        self._expected = seq + 1
        self.num_events += 1
        self._settle(t)
        if kind == TOKEN:
            self._token(rid, t, value)
        elif kind == END:
            self._end(rid)
        else:
            self._dispatch(rid, t, value, kind == OPAQUE)
        self._check_sync(in_flight)

    # -- the events ----------------------------------------------------------------------
    def _dispatch(self, rid: int, t: float, prompt: int, opaque: bool) -> None:
        self._segment = None    # the next step may hold the new request
        clean = (self._synced and self._num_unclear == 0 and not opaque
                 and len(self._reqs) < self.max_num_seqs)
        self._candidate = (_Candidate(rid, t, len(self._reqs), self._decode_context)
                           if clean else None)
        self._reqs[rid] = _Req(prompt, opaque)
        self._num_unclear += 1

    def _token(self, rid: int, t: float, count: int) -> None:
        r = self._reqs.get(rid)
        if r is None or count <= 0:
            return          # a request from before lost events
        if r.opaque:
            r.tokens += count
            return
        if r.tokens == 0:
            self._first_token(rid, r, t, count)
            return
        pending = self._prefill
        if pending is not None and pending.request_id == rid:
            self._prefill = None
            if self._timely(t - pending.first_token_s, count):
                self._out.append(pending.row)
        r.tokens += count
        r.last_token_s = t
        self._decode_context += count
        seg = self._segment
        if seg is not None and seg.reference == rid:
            self._step_end(seg, _Boundary(t, r.tokens, self._decode_context))

    def _first_token(self, rid: int, r: _Req, t: float, count: int) -> None:
        r.tokens = count
        r.first_token_s = r.last_token_s = t
        self._num_unclear -= 1
        self._decode_context += r.prompt + count - 1
        cand = self._candidate
        self._candidate = None
        # a first event of two tokens hides the end of the prefill
        if cand is not None and cand.request_id == rid and self._synced and count == 1:
            row = prefill_row(r.prompt, self.max_num_batched_tokens, cand.num_decoders,
                              cand.decode_context, t - cand.dispatch_s, t)
            if row is not None and row.duration_s > 0:
                self._prefill = _PendingPrefill(rid, row, t)
        self._segment = None
        if self._num_unclear == 0 and self._synced:
            # the step that gave the first token ended the prefill: decode steps follow
            seg = self._segment = _Segment(rid, len(self._reqs))
            self._step_end(seg, _Boundary(t, r.tokens, self._decode_context))

    def _end(self, rid: int) -> None:
        r = self._reqs.pop(rid, None)
        if r is None:
            return
        self._candidate = None      # the composition changed under any prefill
        if self._prefill is not None and self._prefill.request_id == rid:
            self._prefill = None
        if r.opaque or r.tokens == 0:
            self._num_unclear -= 1
        else:
            self._decode_context -= r.prompt + r.tokens - 1
            # rows that end after its last token counted it in a step it was not in
            self._held = [(end, row) for end, row in self._held if end <= r.last_token_s]
        self._reopen()

    # -- segments --------------------------------------------------------------------------
    def _reopen(self) -> None:
        """After an end: a new segment if every request left is decoding, timed by the
        one that began last (the likeliest to decode longest); it starts at its next
        event."""
        self._segment = None
        if not self._synced or self._num_unclear or not self._reqs:
            return
        ref = max(self._reqs, key=lambda k: self._reqs[k].first_token_s)
        self._segment = _Segment(ref, len(self._reqs))

    def _timely(self, gap_s: float, steps: int, step_s: float = 0.0) -> bool:
        """Was the event that began a gap of ``steps`` steps timely: is the gap at least
        ``burst_fraction`` of a step (``step_s``, else the recent rows' step; with
        neither, yes)?"""
        ref = step_s or self._step_s
        return ref <= 0 or gap_s >= self.burst_fraction * ref * steps

    def _step_end(self, seg: _Segment, b: _Boundary) -> None:
        """The reference's step end ``b``: it judges the one before it."""
        p, first = seg.pending, seg.first
        seg.pending = b
        if p is None or first is None:
            seg.first = b
            return
        span = b.tokens - first.tokens
        mean = (b.time_s - first.time_s) / span if span >= self.min_decode_steps else 0.0
        if self._timely(b.time_s - p.time_s, b.tokens - p.tokens, mean):
            self._row_end(seg, p)

    def _row_end(self, seg: _Segment, b: _Boundary) -> None:
        """A timely step end: a row from the last one if it spans enough steps."""
        start = seg.start
        if start is None:
            seg.start = b
            return
        steps = b.tokens - start.tokens
        if steps < self.min_decode_steps:
            return
        seg.start = b
        row = decode_row(seg.num_decoders, start.decode_context, steps,
                         b.time_s - start.time_s, b.time_s)
        if row.duration_s > 0:
            self._held.append((b.time_s, row))
            step = row.duration_s / steps
            self._step_s = step if self._step_s <= 0 else 0.9 * self._step_s + 0.1 * step

    def _settle(self, t: float) -> None:
        """Held decode rows ending more than ``SETTLE_STEPS`` of their steps before ``t``
        are final."""
        if not self._held:
            return
        keep = []
        for end, row in self._held:
            if t - end > SETTLE_STEPS * row.duration_s / row.num_steps:
                self._out.append(row)
            else:
                keep.append((end, row))
        self._held = keep

    # -- consistency ---------------------------------------------------------------------
    def _lose(self, num_lost: int) -> None:
        """Events were lost: forget everything; wait until the backend's requests in
        flight are all known again (``_check_sync``)."""
        self.num_lost += max(num_lost, 0)
        self._reqs.clear()
        self._num_unclear = 0
        self._decode_context = 0.0
        self._segment = None
        self._candidate = None
        self._prefill = None
        self._held.clear()
        self._synced = False

    def _check_sync(self, in_flight: int) -> None:
        """The recorder's count of requests in flight against the builder's."""
        known = len(self._reqs) == in_flight
        if known and not self._synced:
            self._synced = True
            self._reopen()
        elif not known and self._synced:
            self._synced = False
            self._segment = None
            self._candidate = None
            self._prefill = None
            self._held.clear()

    def flush(self) -> list[StepRow]:
        """The held decode rows, final now (the event sequence is over)."""
        out = [row for _, row in self._held]
        self._held.clear()
        return out


# -- online refit ------------------------------------------------------------------------------
class StreamCalibrator:
    """Beta refitted from one backend's stream rows over a rolling window.

    ``consume(events)`` builds rows (``RowBuilder``) and adds them; every ``refit_every``
    new rows it refits by NNLS, but only when the window holds at least
    ``min_prefill_rows`` prefill and ``min_decode_rows`` decode rows, they identify all
    four coefficients, and a fit of three rows in four predicts the fourth no worse than
    the current beta (``refit``): otherwise beta keeps its value (the initial one until a
    refit)."""

    def __init__(self, initial: Beta, max_num_batched_tokens: int, max_num_seqs: int,
                 window: int = 4096, refit_every: int = 64, min_prefill_rows: int = 16,
                 min_decode_rows: int = 16, min_decode_steps: int = 4) -> None:
        if window < 8 or refit_every < 1 or min(min_prefill_rows, min_decode_rows) < 2:
            raise ValueError("window must be >= 8, refit_every >= 1, min rows >= 2")
        self.beta = initial
        self.overhead_s = 0.0
        self.builder = RowBuilder(max_num_batched_tokens, max_num_seqs, min_decode_steps)
        self._rows: deque[StepRow] = deque(maxlen=window)
        self._num = {"decode": 0, "prefill": 0}
        self._since = 0
        self._refit_every = refit_every
        self._min = {"decode": min_decode_rows, "prefill": min_prefill_rows}
        self.num_refits = 0
        self.num_rows_total = 0

    @property
    def num_prefill_rows(self) -> int:
        """Prefill rows in the window."""
        return self._num["prefill"]

    @property
    def num_decode_rows(self) -> int:
        """Decode rows in the window."""
        return self._num["decode"]

    def consume(self, events: Iterable[Event]) -> bool:
        """Rows from the events, added; True if beta was refitted."""
        return self.add(self.builder.feed(events))

    def add(self, rows: Iterable[StepRow]) -> bool:
        """Add rows (refitting every ``refit_every`` of them when identified); True if
        beta was refitted."""
        refitted = False
        for row in rows:
            if len(self._rows) == self._rows.maxlen:
                self._num[self._rows[0].kind] -= 1
            self._rows.append(row)
            self._num[row.kind] += 1
            self.num_rows_total += 1
            self._since += 1
            if self._since >= self._refit_every and self.ready():
                refitted = self.refit() or refitted
        return refitted

    def ready(self) -> bool:
        """Enough rows of each kind for a refit."""
        return all(self._num[k] >= self._min[k] for k in self._num)

    def refit(self) -> bool:
        """Refit on the window now; True if beta moved. The new beta is adopted only if
        the window's rows identify it and a fit on three rows in four predicts the
        fourth (median relative error) at least as well as the current beta does: noisy
        rows that identify beta on paper do not move it to a worse one."""
        rows = list(self._rows)
        self._since = 0
        held = rows[3::4]
        kept = [r for i, r in enumerate(rows) if i % 4 != 3]
        if not identified(rows) or not identified(kept):
            return False
        try:
            trial = fit_rows(kept)
            fit = fit_rows(rows)
        except CalibrationError:
            return False
        if median_ape(trial, held) > median_ape(StreamFit(self.beta, self.overhead_s), held):
            return False
        self.beta, self.overhead_s = fit.beta, fit.overhead_s
        self.num_refits += 1
        return True

    def rows(self) -> list[StepRow]:
        return list(self._rows)
