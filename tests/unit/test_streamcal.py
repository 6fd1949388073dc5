"""Calibration from streams (olproute.estimate.streamcal): rows from event sequences made by
replaying a known engine (the plain-Python batch-formation core timed by a known linear
beta, token events at batch ends), and the intervals that must make no row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest

from olproute.core_ref import FINISHED, ReferenceCore
from olproute.estimate.streamcal import (
    DISPATCH,
    END,
    TOKEN,
    RowBuilder,
    StepRow,
    StreamCalibrator,
    StreamFit,
    StreamRecorder,
    decode_row,
    fit_rows,
    identified,
    prefill_row,
    rows_mape,
)
from olproute.estimate.sweep import sse_tokens
from olproute.server.proxy import _tokens_in

BETA = (5e-3, 2e-5, 1e-7, 2e-9)
BUDGET, SEQS = 512, 16


@dataclass(frozen=True)
class Arrival:
    time_s: float
    prompt: int
    output: int
    streamed: bool = True


@dataclass
class Replay:
    """What a replayed engine did: its batches' (duration, sums), and each request's
    dispatch and end times."""

    batches: list[tuple[float, tuple[float, ...]]]
    lives: dict[int, tuple[float, float]]


def _time(beta: Sequence[float], sums: Sequence[float]) -> float:
    return beta[0] + beta[1] * sums[1] + beta[2] * sums[3] + beta[3] * sums[5]


def replay(arrivals: Sequence[Arrival], recorder: StreamRecorder, clock: list[float],
           beta: Sequence[float] = BETA) -> Replay:
    """Run the reference core as an engine: a batch starts when the last one ends (when
    idle, at the next arrival), lasts the linear model's time, and a request arriving
    during a batch joins the queue at its end. The recorder hears each dispatch at its
    arrival, each streamed request's tokens at the end of the batch that made them (an
    opaque one's all at its end), each end there."""
    core = ReferenceCore(1 << 16, 16, SEQS, BUDGET)
    slot_rid: dict[int, int] = {}
    out = Replay([], {})
    queue = sorted(enumerate(arrivals), key=lambda x: x[1].time_s)
    i, t = 0, 0.0

    def arrive(limit_s: float, inclusive: bool) -> list[int]:
        nonlocal i
        came = []
        while i < len(queue) and (queue[i][1].time_s <= limit_s if inclusive
                                  else queue[i][1].time_s < limit_s):
            rid, a = queue[i]
            clock[0] = a.time_s
            recorder.dispatched(rid, a.prompt, a.streamed)
            out.lives[rid] = (a.time_s, np.inf)
            came.append(rid)
            i += 1
        return came

    def admit(rids: list[int]) -> None:
        for rid in rids:
            slot_rid[core.add_request(arrivals[rid].prompt, arrivals[rid].output)] = rid

    while i < len(queue) or core.num_running or core.num_waiting:
        if not (core.num_running or core.num_waiting):
            t = max(t, queue[i][1].time_s)
        admit(arrive(t, inclusive=True))
        _, sums = core.schedule()
        duration = _time(beta, sums)
        out.batches.append((duration, sums))
        slots = core.batch()[0].tolist()
        before = {s: core.request(s)[1] for s in slots}
        late = arrive(t + duration, inclusive=False)
        core.commit()
        t += duration
        clock[0] = t
        for s in slots:
            rid = slot_rid[s]
            new = core.request(s)[1] - before[s]
            if new and arrivals[rid].streamed:
                recorder.token(rid, new)
        for s, flags in core.event_list():
            if flags & FINISHED:
                rid = slot_rid.pop(s)
                if not arrivals[rid].streamed:
                    recorder.token(rid, arrivals[rid].output)
                recorder.ended(rid)
                out.lives[rid] = (out.lives[rid][0], t)
                core.release_slot(s)
        admit(late)
    return out


def poisson(seed: int, num: int, rate_per_s: float, opaque_every: int = 0) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for j in range(num):
        t += rng.exponential(1.0 / rate_per_s)
        out.append(Arrival(t, int(rng.integers(16, 600)), int(rng.integers(8, 80)),
                           streamed=not (opaque_every and j % opaque_every == 0)))
    return out


def rows_of(arrivals: Sequence[Arrival], min_decode_steps: int = 4
            ) -> tuple[list[StepRow], Replay, RowBuilder]:
    clock = [0.0]
    rec = StreamRecorder(clock=lambda: clock[0])
    run = replay(arrivals, rec, clock)
    builder = RowBuilder(BUDGET, SEQS, min_decode_steps)
    return builder.feed(rec.drain()) + builder.flush(), run, builder


def predicted(beta: Sequence[float], row: StepRow) -> float:
    return float(np.dot(beta, row.regressors))


def step_time(beta: Sequence[float], n: int, context: float) -> float:
    return beta[0] + beta[1] * n + beta[2] * context


# -- one row ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("prompt", "num_decoders"),
                         [(16, 0), (700, 0), (512, 1), (1500, 7), (300, 15), (2000, 3)])
def test_a_prefill_row_is_the_schedulers_steps(prompt: int, num_decoders: int) -> None:
    """The chunks and the decoders in every step of a prompt's prefill, as the batch-
    formation core schedules them, plus half of the step running at dispatch."""
    core = ReferenceCore(1 << 16, 16, SEQS, BUDGET)
    decoders = [core.add_request(100 + 37 * k, 10_000) for k in range(num_decoders)]
    while any(core.request(s)[1] == 0 for s in decoders):
        core.schedule()
        core.commit()
    context = sum(core.request(s)[0] + core.request(s)[1] - 1 for s in decoders)
    new = core.add_request(prompt, 5)
    total = np.zeros(4)
    while core.request(new)[1] == 0:
        _, sums = core.schedule()
        total += (1.0, sums[1], sums[3], sums[5])
        core.commit()
    row = prefill_row(prompt, BUDGET, num_decoders, context - num_decoders, 1.0)
    assert row is not None
    half = 0.5 * np.array([1.0, num_decoders, context - num_decoders, 0.0]) \
        if num_decoders else np.zeros(4)
    np.testing.assert_allclose(row.regressors, total + half, rtol=1e-12)


def test_a_decode_row_sums_its_steps() -> None:
    core = ReferenceCore(1 << 16, 16, SEQS, BUDGET)
    slots = [core.add_request(50 + 11 * k, 10_000) for k in range(5)]
    while any(core.request(s)[1] == 0 for s in slots):
        core.schedule()
        core.commit()
    context = sum(core.request(s)[0] + core.request(s)[1] - 1 for s in slots)
    total = np.zeros(4)
    for _ in range(9):
        _, sums = core.schedule()
        total += (1.0, sums[1], sums[3], sums[5])
        core.commit()
    np.testing.assert_allclose(decode_row(5, context, 9, 1.0).regressors, total)


def test_decoders_leaving_no_budget_make_no_prefill_row() -> None:
    assert prefill_row(100, 8, 8, 500.0, 1.0) is None


# -- rows from a replayed engine -----------------------------------------------------------------
def test_rows_of_a_replayed_engine_are_its_batches() -> None:
    """A decode row is exact but for one context token per step of each decoder whose
    event of a step comes after the reference's; a prefill row is off by at most half of
    the step that ran at its dispatch (counted as half a step)."""
    rows, _, builder = rows_of(poisson(seed=1, num=300, rate_per_s=12))
    pre = [r for r in rows if r.kind == "prefill"]
    dec = [r for r in rows if r.kind == "decode"]
    assert len(pre) >= 60 and len(dec) >= 150 and builder.num_lost == 0
    for r in dec:
        n = r.num_tokens / r.num_steps
        assert abs(predicted(BETA, r) - r.duration_s) <= BETA[2] * (n - 1) * r.num_steps + 1e-12
    for r in pre:
        half = 0.5 * step_time(BETA, r.num_decoders, r.decode_context) if r.num_decoders else 0
        assert abs(predicted(BETA, r) - r.duration_s) <= half + 1e-12
    # the residual averages out: unbiased to a few percent
    bias = np.mean([predicted(BETA, r) / r.duration_s - 1.0 for r in pre])
    assert abs(bias) < 0.03


def test_the_fit_predicts_the_engines_batch_times() -> None:
    rows, run, _ = rows_of(poisson(seed=2, num=300, rate_per_s=12))
    fit = fit_rows(rows)
    times = np.array([d for d, _ in run.batches])
    pred = np.array([_time(fit.beta, s) for _, s in run.batches])
    assert float(np.mean(np.abs(pred / times - 1.0))) < 0.02
    assert fit.overhead_s < 0.1 * BETA[0]   # there is none in a replay
    assert rows_mape(fit, rows) < 0.05


def test_no_row_spans_an_opaque_request() -> None:
    """A request whose tokens come whole at its end hides its progress: no row while it
    is in flight."""
    arrivals = poisson(seed=3, num=300, rate_per_s=12, opaque_every=10)
    rows, run, _ = rows_of(arrivals)
    assert len(rows) >= 50
    opaque = [run.lives[k] for k, a in enumerate(arrivals) if not a.streamed]
    for r in rows:
        start = r.end_s - r.duration_s
        assert not any(a < r.end_s and start < b for a, b in opaque), r
    # and the rows there are still the engine's
    for r in rows:
        if r.kind == "decode":
            assert predicted(BETA, r) == pytest.approx(r.duration_s, rel=1e-3)


# -- scripted event sequences ------------------------------------------------------------------
class Script:
    """Events on a settable clock, fed to a builder."""

    def __init__(self, min_decode_steps: int = 2, maxlen: int = 1 << 10) -> None:
        self.t = 0.0
        self.rec = StreamRecorder(maxlen=maxlen, clock=lambda: self.t)
        self.builder = RowBuilder(BUDGET, SEQS, min_decode_steps)

    def at(self, t: float) -> Script:
        self.t = t
        return self

    def rows(self) -> list[StepRow]:
        return self.builder.feed(self.rec.drain()) + self.builder.flush()


def _decode(s: Script, rids: Sequence[int], t0: float, steps: int, step_s: float) -> float:
    for k in range(1, steps + 1):
        for rid in rids:
            s.at(t0 + k * step_s).rec.token(rid)
    return t0 + steps * step_s


def test_an_idle_prefill_is_a_row_and_crowded_ones_are_not() -> None:
    s = Script()
    s.at(0.0).rec.dispatched(1, 100)
    s.at(0.010).rec.token(1)                      # idle prefill: 10 ms
    t = _decode(s, [1], 0.010, 3, 0.004)
    s.at(t + 0.001).rec.dispatched(2, 50)         # 2 and 3 queue together:
    s.at(t + 0.002).rec.dispatched(3, 50)         # neither prefill is clean
    s.at(t + 0.012).rec.token(1)
    s.at(t + 0.012).rec.token(2)
    s.at(t + 0.016).rec.token(3)
    t = _decode(s, [1, 2, 3], t + 0.016, 3, 0.005)
    s.at(t + 0.001).rec.dispatched(4, 80)         # 4's prefill ...
    s.at(t + 0.002).rec.ended(2)                  # ... under a changing batch
    s.at(t + 0.012).rec.token(4)
    _decode(s, [1, 3, 4], t + 0.012, 2, 0.005)
    pre = [r for r in s.rows() if r.kind == "prefill"]
    assert [(r.prompt_tokens, r.num_decoders, r.duration_s) for r in pre] == [(100, 0, 0.010)]


def test_a_burst_of_held_back_events_ends_no_row() -> None:
    """Steps of 10 ms; the stream stalls after step 4 and delivers steps 5 to 8 at once,
    at step 8's end (steps 5 to 7 late): rows end only at timely events."""
    s = Script(min_decode_steps=2)
    s.at(0.0).rec.dispatched(1, 100)
    s.at(0.010).rec.token(1)
    for k in range(1, 5):
        s.at(0.010 + 0.010 * k).rec.token(1)
    for k in range(5, 9):                         # a burst at 0.090
        s.at(0.090 + 1e-6 * k).rec.token(1)
    for k in range(9, 14):
        s.at(0.010 + 0.010 * k).rec.token(1)
    rows = [r for r in s.rows() if r.kind == "decode"]
    assert rows and sum(r.num_steps for r in rows) >= 8
    for r in rows:   # each row's time per step is the engine's, burst or not
        assert r.duration_s / r.num_steps == pytest.approx(0.010, abs=2e-5)


def test_a_late_end_drops_the_row_that_counted_its_request() -> None:
    """1's last token comes with 2's at 40 ms; 2's next tokens (50, 60 ms) end steps 1
    was not in, but 1's end is only reported after them: no row may count 1 past 40 ms."""
    s = Script(min_decode_steps=1)
    s.at(0.0).rec.dispatched(1, 100)
    s.at(0.010).rec.token(1)
    s.at(0.011).rec.dispatched(2, 100)
    s.at(0.020).rec.token(1)
    s.at(0.020).rec.token(2)                      # 2 began last: it times the steps
    _decode(s, [1, 2], 0.020, 2, 0.010)           # to 40 ms
    s.at(0.050).rec.token(2)
    s.at(0.060).rec.token(2)
    s.at(0.0605).rec.ended(1)
    _decode(s, [2], 0.060, 4, 0.010)
    rows = [r for r in s.rows() if r.kind == "decode"]
    assert {r.num_tokens / r.num_steps for r in rows} == {1.0, 2.0}
    for r in rows:
        assert r.num_tokens == r.num_steps or r.end_s <= 0.040 + 1e-9


def test_lost_events_resynchronise_once_the_backend_is_known_again() -> None:
    """Events dropped by the recorder's bound: the builder forgets its requests and makes
    rows again only once every request in flight is one it saw dispatched."""
    s = Script(min_decode_steps=2, maxlen=12)
    s.at(0.0).rec.dispatched(1, 100)
    s.at(0.010).rec.token(1)
    _decode(s, [1], 0.010, 20, 0.005)             # overflows: 1's dispatch is lost
    events = s.rec.drain()
    assert events[0][0] > 0
    assert s.builder.feed(events) == []
    s.at(0.2).rec.dispatched(2, 100)
    s.at(0.212).rec.token(2)
    _decode(s, [1, 2], 0.212, 4, 0.005)
    assert s.builder.feed(s.rec.drain()) == []    # 1 is unknown: nothing is clean
    s.at(0.30).rec.ended(1)
    _decode(s, [2], 0.30, 8, 0.005)
    rows = s.builder.feed(s.rec.drain()) + s.builder.flush()
    assert s.builder.num_lost > 0
    assert rows and all(r.kind == "decode" and r.num_tokens == r.num_steps for r in rows)


def test_the_recorder_keeps_order_and_counts_in_flight() -> None:
    t = [0.0]
    rec = StreamRecorder(clock=lambda: t[0])
    rec.dispatched(7, 30)
    rec.dispatched(8, 40, streamed=False)
    rec.token(7, 3)
    rec.ended(7)
    assert rec.drain() == [(0, DISPATCH, 7, 0.0, 30, 1), (1, 1, 8, 0.0, 40, 2),
                           (2, TOKEN, 7, 0.0, 3, 2), (3, END, 7, 0.0, 0, 1)]
    rec.enabled = False
    rec.dispatched(9, 10)
    assert rec.drain() == []


# -- refits --------------------------------------------------------------------------------------
def test_refits_wait_for_prefill_and_decode_rows_and_then_find_beta() -> None:
    rows, _, _ = rows_of(poisson(seed=4, num=300, rate_per_s=12))
    initial = (1.0, 1.0, 1.0, 1.0)
    cal = StreamCalibrator(initial, BUDGET, SEQS, refit_every=8, min_prefill_rows=16,
                           min_decode_rows=16)
    assert not cal.add([r for r in rows if r.kind == "decode"])
    assert cal.beta == initial and cal.num_refits == 0
    assert cal.add([r for r in rows if r.kind == "prefill"])
    assert rows_mape(StreamFit(cal.beta, cal.overhead_s), rows) < 0.05


def test_rows_that_do_not_identify_beta_leave_it() -> None:
    """One decoder's steps and one idle prompt, over and over: the steps and the tokens
    are the same column, nothing can tell beta0 from beta1."""
    same = [decode_row(1, 0.0, 1, 0.004, 0.0)] * 20
    idle = prefill_row(1, BUDGET, 0, 0.0, 0.004)
    assert idle is not None
    assert not identified(same + [idle] * 20)
    cal = StreamCalibrator((1.0, 1.0, 1.0, 1.0), BUDGET, SEQS, refit_every=1,
                           min_prefill_rows=2, min_decode_rows=2)
    assert not cal.add(same + [idle] * 20)
    assert cal.beta == (1.0, 1.0, 1.0, 1.0)


def test_noisy_rows_do_not_replace_a_better_beta() -> None:
    """Rows whose times carry heavy noise (lognormal, sigma 0.8: a busy machine) identify
    beta on paper, but a fit of them predicts held-back rows worse than the engine's own
    beta, which is kept; a wrong beta is still replaced."""
    rows, _, _ = rows_of(poisson(seed=6, num=300, rate_per_s=12))
    rng = np.random.default_rng(0)
    noisy = [replace(r, duration_s=r.duration_s * float(rng.lognormal(0.0, 0.8)))
             for r in rows]
    assert identified(noisy)
    kept = StreamCalibrator(BETA, BUDGET, SEQS, refit_every=32)
    assert not kept.add(noisy) and kept.beta == BETA and kept.num_refits == 0
    wrong = StreamCalibrator((1e-3, 1e-6, 1e-9, 1e-12), BUDGET, SEQS, refit_every=32)
    assert wrong.add(noisy) and wrong.num_refits > 0


def test_a_window_forgets_old_rows_of_each_kind() -> None:
    rows, _, _ = rows_of(poisson(seed=5, num=120, rate_per_s=12))
    cal = StreamCalibrator(BETA, BUDGET, SEQS, window=16, refit_every=1000)
    cal.add(rows)
    kept = rows[-16:]
    assert cal.rows() == kept
    assert cal.num_prefill_rows == sum(r.kind == "prefill" for r in kept)
    assert cal.num_decode_rows == sum(r.kind == "decode" for r in kept)


# -- counting tokens in streams ----------------------------------------------------------------
@pytest.mark.parametrize(("line", "tokens"), [
    (b'data: {"choices": [{"text": " w1 w2", "token_ids": [5, 6]}]}', 2),
    (b'data: {"choices": [{"text": " w1", "token_ids": null}]}', 1),
    (b'data: {"choices": [{"delta": {"content": "hi"}}]}', 1),
    (b'data: {"choices": [], "usage": {"completion_tokens": 3}}', 0),
    (b"data: [DONE]", 0),
    (b": keep-alive", 0),
])
def test_the_proxy_and_the_sweep_count_every_token_of_an_event(line: bytes,
                                                               tokens: int) -> None:
    assert _tokens_in(line) == tokens
    assert sse_tokens(line)[0] == tokens
