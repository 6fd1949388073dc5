"""A profiling sweep of a live backend over HTTP, as the BEAR paper profiles its engines:
prompt lengths x concurrency, each phase a closed loop of streamed completions, whose
stream timings become regression rows of the batch-time model (``olproute.estimate.streamcal``,
the mechanism the server's online recalibration uses too).

Each request is a completion of a prompt given as token ids (distinct per request and
below 1000, so that P is exact without a tokenizer and a prefix cache never hits) with
``max_tokens`` fixed, ``ignore_eos`` (vLLM's extension: every request decodes all its
tokens), ``return_token_ids`` (vLLM's: each event's tokens counted exactly) and
``stream_options.include_usage``. A phase (P, c) keeps c requests in flight until it has
sent ``c + max(c, extra_requests)``; a request is sent only once the previous one has its
first token, so every prefill starts with the others decoding (a clean prefill row) and
the backend is never left idle long.

From the rows: beta (NNLS, ``streamcal.fit_rows``), the mean decode step (TPOT), the
prefill throughput (prompt tokens over the prefill rows' time less the expected rest of
the step running at dispatch), and from the phases at the sweep's largest concurrency
(the saturated ones) the LPS concurrency k (time-average requests in flight) and service
rate mu (requests completed per busy second). ``service_scv`` is left unknown: every
request decodes the same number of tokens.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
import orjson

from olproute.estimate.calibration import CalibrationError, InstanceCalibration
from olproute.estimate.streamcal import (
    RowBuilder,
    StepRow,
    StreamFit,
    StreamRecorder,
    fit_rows,
    rows_mape,
)
from olproute.types import InstanceSpec

# token ids a prompt is drawn from: past the usual special ids, below any vocabulary's size
MIN_TOKEN_ID, MAX_TOKEN_ID = 3, 1000


class SweepError(CalibrationError):
    """A backend could not be profiled (unreachable, refused a request, no model)."""


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What a sweep sends: every prompt length (tokens) at every concurrency (capped by
    ``max_num_seqs``); a phase (P, c) sends c ramp requests of ``max_tokens + ramp_tokens
    * c`` output tokens (long enough to be all decoding together once the ramp is over:
    ``ramp_tokens`` is about the decode steps one ramp dispatch takes), then
    ``max(c, extra_requests)`` of ``max_tokens``. Prompts are capped so that the longest
    request fits the backend's context. ``min_decode_steps``: the shortest decode row
    (longer rows average out the stream's timing jitter)."""

    prompt_tokens: tuple[int, ...] = (16, 64, 256, 512)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_tokens: int = 64
    ramp_tokens: int = 4
    extra_requests: int = 4
    seed: int = 0
    min_decode_steps: int = 8

    def phases(self, spec: InstanceSpec, max_model_len: int) -> list[tuple[int, int]]:
        """(prompt tokens, concurrency) of each phase, in order."""
        conc = sorted({min(c, spec.max_num_seqs) for c in self.concurrency})
        longest = max_model_len - self.ramp_max_tokens(conc[-1])
        if longest < 1:
            raise SweepError(f"{self.ramp_max_tokens(conc[-1])} output tokens leave no room "
                             f"for a prompt in a context of {max_model_len} tokens")
        prompts = sorted({min(p, longest) for p in self.prompt_tokens})
        return [(p, c) for p in prompts for c in conc]

    def ramp_max_tokens(self, concurrency: int) -> int:
        return self.max_tokens + self.ramp_tokens * concurrency


QUICK_PLAN = SweepPlan(prompt_tokens=(16, 128, 512), concurrency=(1, 4, 16), max_tokens=32,
                       extra_requests=2)


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """One phase: its prompt and concurrency, and over its saturation window (after the
    ramp, while the closed loop keeps ``concurrency`` requests in flight): requests
    completed, the window's seconds and the integral of requests in flight over it."""

    prompt_tokens: int
    concurrency: int
    num_completed: int
    window_s: float
    request_seconds: float


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A backend's sweep: its rows, phases, the calibration fitted from them, the
    dispatch overhead fitted beside beta (``streamcal.StreamFit``), the fit's MAPE on
    its own rows (a fraction), wall time, and the stream events that carried
    more than one token (the stream fell behind the engine)."""

    name: str
    rows: tuple[StepRow, ...]
    phases: tuple[PhaseStats, ...]
    calibration: InstanceCalibration
    overhead_s: float
    fit_mape: float
    duration_s: float
    num_events: int
    num_multi_token_events: int

    @property
    def num_prefill_rows(self) -> int:
        return sum(1 for r in self.rows if r.kind == "prefill")

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.kind == "decode")


# -- one request -----------------------------------------------------------------------------
def sse_tokens(line: bytes) -> tuple[int, bool]:
    """(output tokens announced, whether it is the stream's usage or [DONE]) by one SSE
    line: ``token_ids``' length where the backend returns them, else one per choice event
    with text."""
    if not line.startswith(b"data:"):
        return 0, False
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return 0, True
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return 0, False
    if not isinstance(doc, dict):
        return 0, False
    n = 0
    for choice in doc.get("choices") or []:
        ids = choice.get("token_ids")
        if ids:
            n += len(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            n += 1
    return n, doc.get("usage") is not None


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    raw = await resp.read()
    try:
        doc = orjson.loads(raw)
        msg = doc["error"]["message"] if isinstance(doc.get("error"), dict) else doc["error"]
        return str(msg)[:500]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return raw.decode(errors="replace")[:500]


class _Client:
    """Streams completions to one backend and reports them to a recorder."""

    def __init__(self, session: aiohttp.ClientSession, name: str, url: str, model: str,
                 recorder: StreamRecorder, max_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.session, self.name, self.url, self.model = session, name, url.rstrip("/"), model
        self.recorder = recorder
        self.max_tokens = max_tokens
        self.num_events = 0
        self.num_multi = 0
        self.step_s = 0.0      # the last gap between two token events of one request

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, object]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "return_token_ids": True, "temperature": 0.0}

    async def complete(self, rid: int, prompt: list[int], first: asyncio.Event,
                       max_tokens: int | None = None) -> int:
        """Stream one completion (of ``max_tokens``, by default the plan's); sets
        ``first`` at its first token; raises SweepError unless it streamed them all."""
        want = self.max_tokens if max_tokens is None else max_tokens
        rec = self.recorder
        rec.dispatched(rid, len(prompt))
        tokens = 0
        last_s = None
        try:
            async with self.session.post(self.url + "/v1/completions",
                                         json=self.body(prompt, want)) as resp:
                if resp.status != 200:
                    raise SweepError(f"backend {self.name} at {self.url} answered "
                                     f"{resp.status}: {await _error_message(resp)}")
                pending = b""
                async for chunk in resp.content.iter_any():
                    lines = (pending + chunk).split(b"\n")
                    pending = lines.pop()
                    counts = [sse_tokens(line)[0] for line in lines if line]
                    self.num_multi += sum(1 for k in counts if k > 1)
                    n = sum(counts)
                    self.num_events += sum(1 for k in counts if k)
                    if n:
                        rec.token(rid, n)
                        tokens += n
                        first.set()
                        now = self.clock()
                        if last_s is not None:
                            self.step_s = (now - last_s) / n
                        last_s = now
        except aiohttp.ClientError as exc:
            raise SweepError(f"backend {self.name} at {self.url}: {type(exc).__name__}: "
                             f"{exc}") from exc
        finally:
            rec.ended(rid)
        if tokens != want:
            raise SweepError(f"backend {self.name}: a request streamed {tokens} tokens, "
                             f"{want} asked (ignore_eos ignored, or a stream that does not "
                             "announce every token)")
        return tokens


# -- a phase ---------------------------------------------------------------------------------
class _Phase:
    """``concurrency`` requests sent one at a time, each once the previous one has its
    first token (the ramp: every prefill starts with the others decoding; they decode
    together once it is over), then the rest as a closed loop: a request as soon as one
    ends. Each is sent after a random fraction of the last step seen (a request sent
    at a step's end would find the next step just begun). The saturation window runs
    from the first request after the ramp to the last one sent."""

    def __init__(self, client: _Client, prompts: list[list[int]], concurrency: int,
                 ramp_max_tokens: int, first_rid: int, clock: Callable[[], float],
                 rng: np.random.Generator) -> None:
        self.client = client
        self.rng = rng
        self.prompts = prompts
        self.ramp_max_tokens = ramp_max_tokens
        self.concurrency = concurrency
        self.first_rid = first_rid
        self.clock = clock
        self._changes: list[tuple[float, int]] = []   # (time, +1 sent / -1 ended)

    async def _request(self, rid: int, prompt: list[int], first: asyncio.Event,
                       max_tokens: int | None) -> None:
        self._changes.append((self.clock(), +1))
        try:
            await self.client.complete(rid, prompt, first, max_tokens)
        finally:
            self._changes.append((self.clock(), -1))

    async def run(self) -> PhaseStats:
        running: set[asyncio.Task[None]] = set()
        window_start = self.clock()
        try:
            for i, prompt in enumerate(self.prompts):
                while len(running) >= self.concurrency:
                    done, running = await asyncio.wait(
                        running, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
                if running:
                    # out of step with the engine: the step running at dispatch is then
                    # half over on average, as the prefill rows count it
                    await asyncio.sleep(self.rng.uniform(0.0, self.client.step_s))
                if i == self.concurrency:
                    window_start = self.clock()
                first = asyncio.Event()
                ramp = i < self.concurrency
                task = asyncio.create_task(self._request(
                    self.first_rid + i, prompt, first, self.ramp_max_tokens if ramp else None))
                running.add(task)
                if ramp:
                    waiter = asyncio.create_task(first.wait())
                    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if task.done():
                        running.discard(task)
                        task.result()
            window_end = self.clock()
            for result in await asyncio.gather(*running, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
            running.clear()
        finally:
            for task in running:
                task.cancel()
        return self._stats(window_start, window_end)

    def _stats(self, start_s: float, end_s: float) -> PhaseStats:
        """Completions and requests in flight over the saturation window (the whole
        phase if the window is empty)."""
        if end_s <= start_s:
            start_s, end_s = self._changes[0][0], self._changes[-1][0]
        in_flight, last, area, done = 0, start_s, 0.0, 0
        for t, delta in sorted(self._changes):
            if start_s < t <= end_s:
                area += in_flight * (t - last)
                last = t
                done += delta < 0
            in_flight += delta
        area += in_flight * (end_s - last) if last < end_s else 0.0
        return PhaseStats(len(self.prompts[0]), self.concurrency, done, end_s - start_s,
                          area)


# -- the sweep -------------------------------------------------------------------------------
async def backend_model(session: aiohttp.ClientSession, name: str, url: str,
                        spec: InstanceSpec, model: str | None = None
                        ) -> tuple[str, int | None]:
    """(the model name to send, the backend's max_model_len if it says) from
    ``/v1/models``: ``model`` if given, else the instance's model if listed, else the
    only one listed. SweepError if the backend cannot be reached, or no name is known."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models") as resp:
            if resp.status != 200:
                if model is not None:
                    return model, None
                raise SweepError(f"backend {name} at {url}: /v1/models answered "
                                 f"{resp.status}: {await _error_message(resp)}; give --model")
            doc = orjson.loads(await resp.read())
    except aiohttp.ClientError as exc:
        raise SweepError(f"backend {name} at {url}: cannot connect: "
                         f"{type(exc).__name__}: {exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise SweepError(f"backend {name} at {url}: /v1/models is not JSON") from exc
    cards = [c for c in doc.get("data") or [] if isinstance(c, dict) and "id" in c] \
        if isinstance(doc, dict) else []
    ids = [str(c["id"]) for c in cards]
    want = model or (spec.model if spec.model in ids else None)
    if want is None and len(ids) == 1:
        want = ids[0]
    if want is None:
        raise SweepError(f"backend {name} at {url} serves {', '.join(ids) or 'no model'}; "
                         "give --model")
    length = cards[ids.index(want)].get("max_model_len") if want in ids else None
    return want, int(length) if isinstance(length, int) else None


def _prompts(rng: np.random.Generator, num: int, tokens: int) -> list[list[int]]:
    return [rng.integers(MIN_TOKEN_ID, MAX_TOKEN_ID, tokens).tolist() for _ in range(num)]


async def _warm_up(client: _Client, rng: np.random.Generator,
                   phases: Sequence[tuple[int, int]]) -> None:
    """A request of the longest and of the shortest prompt, then a few at once, unrecorded
    (an engine's first requests pay its compilations: 20 s on vLLM's CPU build)."""
    recorder, client.recorder = client.recorder, StreamRecorder()
    try:
        prompts = [p for p, _ in phases]
        for p in (max(prompts), min(prompts)):
            await client.complete(-1, _prompts(rng, 1, p)[0], asyncio.Event())
        num = min(4, max(c for _, c in phases))
        await asyncio.gather(*(client.complete(-2 - i, prompt, asyncio.Event())
                               for i, prompt in enumerate(_prompts(rng, num, min(prompts)))))
    finally:
        client.recorder = recorder


async def sweep_backend(session: aiohttp.ClientSession, name: str, url: str, model: str,
                        spec: InstanceSpec, max_model_len: int, plan: SweepPlan,
                        progress: Callable[[str], None] | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> SweepResult:
    """Profile one backend (instance ``spec``, serving ``model``) with ``plan``."""
    phases = plan.phases(spec, max_model_len)
    recorder = StreamRecorder(clock=clock)
    client = _Client(session, name, url, model, recorder, plan.max_tokens, clock)
    rng = np.random.default_rng(plan.seed)
    start = clock()
    if progress is not None:
        progress(f"{name}: warming up")
    await _warm_up(client, rng, phases)
    stats: list[PhaseStats] = []
    rid = 0
    for i, (p, c) in enumerate(phases, start=1):
        if progress is not None:
            progress(f"{name}: phase {i}/{len(phases)}: prompt {p} tokens, concurrency {c}")
        prompts = _prompts(rng, c + max(c, plan.extra_requests), p)
        stats.append(await _Phase(client, prompts, c, plan.ramp_max_tokens(c), rid,
                                  clock, rng).run())
        rid += len(prompts)
    builder = RowBuilder(spec.max_num_batched_tokens, spec.max_num_seqs,
                         plan.min_decode_steps)
    rows = builder.feed(recorder.drain()) + builder.flush()
    cal, fit = sweep_calibration(rows, stats)
    return SweepResult(name, tuple(rows), tuple(stats), cal, fit.overhead_s,
                       rows_mape(fit, rows), clock() - start, client.num_events,
                       client.num_multi)


def sweep_calibration(rows: Sequence[StepRow], phases: Sequence[PhaseStats]
                      ) -> tuple[InstanceCalibration, StreamFit]:
    """(the calibration fitted from a sweep's rows and phases, the rows' fit)."""
    pre = [r for r in rows if r.kind == "prefill"]
    dec = [r for r in rows if r.kind == "decode"]
    if len(pre) < 3 or len(dec) < 3:
        raise SweepError(f"the sweep gave {len(pre)} prefill and {len(dec)} decode rows: "
                         "too few to fit beta (a stream that reports tokens in bursts?)")
    fit = fit_rows(rows)
    tpot = sum(r.duration_s for r in dec) / sum(r.num_steps for r in dec)
    top = max(p.concurrency for p in phases)
    sat = [p for p in phases if p.concurrency == top]
    window = sum(p.window_s for p in sat)
    cal = InstanceCalibration(
        beta=fit.beta, prefill_tokens_per_s=prefill_throughput(fit, pre), tpot_s=tpot,
        mean_batch_seqs=sum(p.request_seconds for p in sat) / window,
        service_rate_per_s=sum(p.num_completed for p in sat) / window, service_scv=None)
    return cal, fit


def prefill_throughput(fit: StreamFit, rows: Sequence[StepRow]) -> float:
    """Prompt tokens per second of prefill: the rows' prompts over their time less the
    dispatch overhead and the expected rest of the step running at each dispatch (half a
    decode step of the decoders then, by beta)."""
    b0, b1, b2, _ = fit.beta
    rest = sum(fit.overhead_s + (0.5 * (b0 + b1 * r.num_decoders + b2 * r.decode_context)
                                 if r.num_decoders else 0.0) for r in rows)
    seconds = sum(r.duration_s for r in rows) - rest
    return sum(r.prompt_tokens for r in rows) / seconds if seconds > 0 else math.nan
