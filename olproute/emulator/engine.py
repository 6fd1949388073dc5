"""One emulated vLLM-like engine, run in real time on the event loop.

A request is admitted with the number of tokens it will generate (``output_tokens``, at
most ``max_tokens``: where its model stops, ``olproute.emulator.lengths``), and the engine
runs exactly that many, as the simulator's engine runs a request's true decode length:
batches, KV blocks, ``vllm:generation_tokens`` and the batch records all follow it. The
length it is told to expect (``SimEngine``'s predicted length) is ``max_tokens``, all
that a vLLM engine knows in advance.

A ``SimEngine`` (the compiled batch-formation core: continuous batching, chunked prefill,
paged KV, preemption by recompute) forms each batch; the simulator's ground-truth timer
(``RooflineTiming`` of the instance's model and GPU, seeded noise) gives its duration,
times ``time_scale``; the loop sleeps that long, commits the batch and hands every produced
token to its request. Batches are laid back to back on a virtual clock, so the loop's
wake-up jitter does not accumulate while the engine is busy.

Disaggregated pools (``olproute.routing.disagg``, as vLLM with its NIXL connector): a decode
request whose prompt's KV cache comes from a prefill instance (``receive_kv`` then
``submit_decode``) waits the transfer time (``olproute.routing.disagg.KvTransfer``, times
``time_scale``); the engine then admits it as ``olproute.routing.disagg.decode_admission`` says:
the whole prompt, all but its last token computed, and all its outputs. Its first step
recomputes the last prompt token and samples the first output token, which is the
client's first token; every token the decode instance streams is new. While its KV
is in transfer the request is not in the engine (vLLM would already hold its blocks and
count it as waiting).

Prefix caching (vLLM's automatic prefix caching, when the spec has
``enable_prefix_caching``): a request admitted with its prompt's block hashes
(``block_hashes``: the HTTP face names its prompt's blocks, of words or of token ids,
with ``olproute.routing.prefix_index.prompt_block_hashes``, as the router does) starts
after the longest prefix the engine's cache holds, so a repeated prompt's first token comes sooner.
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` count the tokens looked up and
found, and a finished request's ``cached_tokens`` holds the prompt tokens it found cached
when it was first scheduled (vLLM's ``num_cached_tokens``). A decode request whose KV came
from a prefill instance is admitted without hashes.

KV events (``kv_events``, a ``olproute.emulator.kv_publisher.KvPublisher``): the engine
then names a prompt's blocks as vLLM does (``WordTokenizer`` ids, or the request's token
ids; ``BlockHasher`` of ``kv_hash_algo`` with vLLM's seed), gives their ``block_key``s to
its core as the block hashes, and after each commit (and each abort) publishes the core's
prefix-cache events as one batch of vLLM's ``BlockStored`` / ``BlockRemoved``
(``olproute.emulator.kv_blocks``); a core log that overflowed is published as
``AllBlocksCleared`` then the cache's contents. The router's exact index of such an
engine (``olproute.server.kv_subscriber``, tokenizer ``words``) holds what its cache holds.

Metrics of a decode request are those of any request, as vLLM reports them on a decode
instance: its first token is a normal first token, the time to it counted from the
request's arrival at the instance (so it includes the KV transfer wait: vLLM stamps the
arrival before the request waits for its remote KV), ``vllm:prompt_tokens`` counts its
whole prompt (vLLM counts the prompt length, computed here or received), and
``vllm:generation_tokens`` all of its outputs. The prefill instance
counts its prompt and its one (discarded) token likewise; the batch records
(``num_prefill_tokens``) show that a decode instance computed one prompt token per
request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from olproute.core_ref import FINISHED
from olproute.emulator.kv_blocks import BlockNamer, KvEventFeed, NamedBlocks
from olproute.emulator.kv_publisher import KvPublisher
from olproute.emulator.lengths import OutputLengths
from olproute.emulator.metrics import EngineMetrics
from olproute.routing.block_hash import BlockHasher, WordTokenizer
from olproute.routing.disagg import KvTransfer, decode_admission
from olproute.routing.prefix_index import IntArray, prompt_block_hashes
from olproute.sim.engine import BATCH_LOG_COLUMNS, BatchTimer, SimEngine
from olproute.types import InstanceSpec

# A busy engine that falls this far behind its virtual clock (a stalled event loop)
# restarts the clock at now instead of running the backlog in a burst.
_MAX_LAG_S = 0.05


@dataclass(frozen=True, slots=True)
class KvTransferRecord:
    """One prompt's KV cache received from a prefill instance: its tokens, the
    (scaled) seconds the transfer took, and the prefill engine it came from."""

    prompt_tokens: int
    delay_s: float
    remote_engine_id: str | None


class EmulatedRequest:
    """One request inside the engine; its handler waits on it for tokens.

    It generates ``output_tokens`` (<= ``max_tokens``) tokens: where its model stops
    (``olproute.emulator.lengths``), or all ``max_tokens``. ``num_tokens`` grows as
    batches commit; ``done`` is set when it finished all its tokens, was aborted, or the
    engine stopped (``failed``)."""

    __slots__ = ("_changed", "_finished", "aborted", "arrival_s", "cached_tokens", "done",
                 "failed", "first_token_s", "max_tokens", "num_tokens", "output_tokens",
                 "prompt_tokens", "request_id", "slot")

    def __init__(self, request_id: int, prompt_tokens: int, max_tokens: int,
                 arrival_s: float, output_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.output_tokens = max_tokens if output_tokens is None else output_tokens
        if not 1 <= self.output_tokens <= max_tokens:
            raise ValueError(f"output_tokens must be in [1, max_tokens={max_tokens}], "
                             f"got {self.output_tokens}")
        self.arrival_s = arrival_s
        self.slot = -1
        self.num_tokens = 0
        self.first_token_s: float | None = None
        self.cached_tokens = 0   # prompt tokens found in the prefix cache, once finished
        self.done = False
        self.aborted = False
        self.failed = False
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()

    @property
    def finish_reason(self) -> str:
        """``"length"`` when it generates all ``max_tokens``, else ``"stop"`` (its EOS)."""
        return "length" if self.output_tokens == self.max_tokens else "stop"

    async def wait_done(self) -> None:
        """Return once the request is done (finished, aborted or failed)."""
        await self._finished.wait()

    async def wait_beyond(self, num_tokens: int) -> None:
        """Return once more than ``num_tokens`` tokens exist, or the request is done."""
        while self.num_tokens <= num_tokens and not self.done:
            self._changed.clear()
            await self._changed.wait()

    async def wait_to_send(self, sent: int, interval: int = 1) -> int:
        """The number of tokens a stream that has sent ``sent`` should have sent after its
        next write, once that write is due (vLLM's ``--stream-interval``): the first token
        at once, then ``interval`` more (or all that exist by then), and the rest when the
        request is done. Check ``failed`` / ``aborted`` after it."""
        await self.wait_beyond(sent + interval - 1 if sent else 0)
        return self.num_tokens

    def _notify(self) -> None:
        self._changed.set()

    def _end(self, *, aborted: bool = False, failed: bool = False) -> None:
        self.done = True
        self.aborted |= aborted
        self.failed |= failed
        self._changed.set()
        self._finished.set()


class EmulatedInstance:
    """A vLLM-like engine timed in real time by the simulator's ground truth.

    ``timer`` maps batch sums to seconds (``olproute.sim.timing``); ``time_scale``
    multiplies every batch duration (< 1 runs faster than the modelled GPU).
    ``max_model_len`` caps prompt + output tokens (default: the KV capacity).
    Records of the last ``batch_log_size`` batches are kept for ``batch_records``.
    ``kv_transfer`` times the KV caches it receives from prefill instances (needed to
    take remote prefills); ``kv_transfers`` records the last ``batch_log_size`` of them
    and ``num_remote_decode_prefills`` counts the prefills it ran for a remote decode.
    ``clock`` gives the time in seconds that every timestamp of the engine is on (arrivals,
    first tokens, batch starts); the loop waits with ``asyncio.sleep``, so an event loop
    whose ``time()`` is virtual runs the engine in virtual time when ``clock`` is that
    loop's ``time`` (the tests do). Default: ``time.monotonic``.
    ``lengths`` says where each request the HTTP face admits stops (default: draws from
    the default trace, seed 0); ``exact_lengths`` makes every request generate all its
    ``max_tokens`` instead. ``stream_interval`` (>= 1) is vLLM's ``--stream-interval``:
    a stream sends its first token at once, then whenever ``stream_interval`` more tokens
    exist, and the rest when the request ends. ``prompt_tokens_details`` is vLLM's
    ``--enable-prompt-tokens-details`` (off by default, as in vLLM): the HTTP face
    reports a request's cached prompt tokens in its usage.
    ``kv_events`` (with prefix caching) publishes the prefix cache's events there as
    vLLM does (``olproute.emulator.kv_blocks``): prompts are named with ``WordTokenizer``
    (or their token ids) and vLLM's block hashes of ``kv_hash_algo``, and each commit's
    events go out as one batch. Without it, prompts are named as the router's
    approximate index names them, and nothing is published.
    """

    def __init__(self, spec: InstanceSpec, timer: BatchTimer, *, index: int = 0,
                 time_scale: float = 1.0, model_name: str | None = None,
                 max_model_len: int | None = None, batch_log_size: int = 65_536,
                 kv_transfer: KvTransfer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 lengths: OutputLengths | None = None, exact_lengths: bool = False,
                 stream_interval: int = 1, prompt_tokens_details: bool = False,
                 kv_events: KvPublisher | None = None,
                 kv_hash_algo: str = "sha256") -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        if exact_lengths:
            lengths = OutputLengths([1], exact=True)
        self.lengths = lengths if lengths is not None else OutputLengths.from_trace()
        self.stream_interval = stream_interval
        self.prompt_tokens_details = prompt_tokens_details
        self.spec = spec
        self.index = index
        self.time_scale = time_scale
        self.model_name = model_name or spec.model
        cap = spec.kv_capacity_tokens
        self.max_model_len = cap if max_model_len is None else min(max_model_len, cap)
        self.metrics = EngineMetrics(self.model_name)
        self.metrics.cache_config(spec, kv_hash_algo)
        self._timer = timer
        self._sums: Sequence[float] = ()
        self.kv_hash_algo = kv_hash_algo
        self.kv_events = kv_events if spec.enable_prefix_caching else None
        self.kv_feed = None if self.kv_events is None else KvEventFeed(
            BlockNamer(WordTokenizer(), BlockHasher(kv_hash_algo), spec.block_size),
            self.kv_events.publish)
        self._engine = SimEngine(index, spec, self._timed,
                                 kv_events=self.kv_events is not None)
        self._requests: dict[int, EmulatedRequest] = {}
        self._by_slot: dict[int, EmulatedRequest] = {}
        self._pending_aborts: list[EmulatedRequest] = []
        self._ids = itertools.count()
        self._log: deque[tuple[float, ...]] = deque(maxlen=batch_log_size)
        self.kv_transfer = kv_transfer
        self.kv_transfers: deque[KvTransferRecord] = deque(maxlen=batch_log_size)
        self.num_remote_decode_prefills = 0
        self._num_batches = 0
        self._in_batch = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.clock = clock
        self.t0 = clock()  # the clock of batch records starts here
        self.started_unix_s = time.time()

    def _timed(self, sums: Sequence[float]) -> float:
        self._sums = sums
        return self._timer(sums) * self.time_scale

    # -- state ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self._engine.core.num_running

    @property
    def num_waiting(self) -> int:
        return self._engine.core.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self._engine.core.num_free_blocks / self.spec.num_kv_blocks

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's counter)."""
        return self._engine.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found cached (vLLM's counter)."""
        return self._engine.prefix_cache_hits

    @property
    def num_batches(self) -> int:
        return self._num_batches

    def batch_records(self, since: int = 0) -> tuple[int, list[tuple[float, ...]]]:
        """(index of the first returned record, records since batch ``since``), in the
        columns of ``BATCH_COLUMNS``; the oldest ones may have been dropped."""
        first = self._num_batches - len(self._log)
        start = max(since, first)
        return start, list(itertools.islice(self._log, start - first, None))

    # -- requests ------------------------------------------------------------------------
    def block_hashes(self, text: str | None, prompt_tokens: int,
                     ids: Sequence[int] | None = None,
                     chat: Sequence[Mapping[str, Any]] | None = None
                     ) -> IntArray | NamedBlocks | None:
        """The names of a prompt's blocks (at most the full blocks of ``prompt_tokens``)
        for this engine's prefix cache; None: no prompt, or no prefix caching. With KV
        events, vLLM's (``NamedBlocks``: of the chat's ``messages`` when given, else the
        token ids, else the text); without, the router's approximate names of the text
        or else the token ids."""
        if not self.spec.enable_prefix_caching:
            return None
        if self.kv_feed is not None:
            return self.kv_feed.namer.name(text, ids, chat,
                                           prompt_tokens // self.spec.block_size)
        return prompt_block_hashes(text, ids, self.spec.block_size, prompt_tokens)

    def submit(self, prompt_tokens: int, max_tokens: int,
               output_tokens: int | None = None,
               block_hashes: IntArray | NamedBlocks | None = None) -> EmulatedRequest:
        """Queue a request that generates ``output_tokens`` (default: all ``max_tokens``),
        its prompt's ``block_hashes`` (``block_hashes()``) looked up in the prefix cache;
        raises ValueError if it could never fit in the KV cache."""
        return self._admit(prompt_tokens, max_tokens, output_tokens, 0, self.clock(),
                           block_hashes)

    def _admit(self, prompt_tokens: int, max_tokens: int, output_tokens: int | None,
               computed_tokens: int, arrival_s: float,
               block_hashes: IntArray | NamedBlocks | None = None) -> EmulatedRequest:
        if self._task is None:
            raise RuntimeError("the engine is not running")
        named, keys = ((block_hashes, block_hashes.keys)
                       if isinstance(block_hashes, NamedBlocks) else (None, block_hashes))
        req = EmulatedRequest(next(self._ids), prompt_tokens, max_tokens, arrival_s,
                              output_tokens)
        # the engine's truth is the real length; like vLLM, it is told only max_tokens
        req.slot = self._engine.admit(req.request_id, prompt_tokens, req.output_tokens,
                                      max_tokens, computed_tokens, keys)
        if named is not None and self.kv_feed is not None:
            self.kv_feed.admitted(req.request_id, named)
        self._requests[req.request_id] = req
        self._by_slot[req.slot] = req
        self._wake.set()
        return req

    async def receive_kv(self, prompt_tokens: int, remote_engine_id: str | None) -> float:
        """Wait while a prompt's KV cache moves here from a prefill instance
        (``kv_transfer.seconds(prompt_tokens) x time_scale``); record it and return the
        delay in seconds. Raises ValueError without a transfer model."""
        if self.kv_transfer is None:
            raise ValueError(f"instance {self.spec.name!r} has no KV transfer model")
        delay = self.kv_transfer.seconds(prompt_tokens) * self.time_scale
        await asyncio.sleep(delay)
        self.kv_transfers.append(KvTransferRecord(prompt_tokens, delay, remote_engine_id))
        return delay

    def submit_decode(self, prompt_tokens: int, max_tokens: int,
                      arrival_s: float | None = None,
                      output_tokens: int | None = None) -> EmulatedRequest:
        """Queue a request whose prompt's KV cache arrived from a prefill instance,
        admitted as ``decode_admission`` says (all but the last prompt token computed, all
        ``output_tokens`` outputs, default ``max_tokens``, to generate). ``arrival_s`` (on
        ``clock``, default now) is when it reached this instance, before its KV transfer:
        the start of its time to first token. Raises ValueError if it could never fit in
        the KV cache."""
        prompt, output, computed = decode_admission(
            prompt_tokens, max_tokens if output_tokens is None else output_tokens)
        return self._admit(prompt, max_tokens, output, computed,
                           self.clock() if arrival_s is None else arrival_s)

    def abort(self, req: EmulatedRequest) -> None:
        """Drop an unfinished request (its client went away): frees its slot and KV
        blocks now, or right after the batch in flight commits. No-op once done."""
        if req.done:
            return
        req._end(aborted=True)
        if self._in_batch:
            self._pending_aborts.append(req)
        else:
            self._drop(req)

    def _drop(self, req: EmulatedRequest) -> None:
        if self._requests.pop(req.request_id, None) is not None:
            self._engine.abort(req.request_id)
            del self._by_slot[req.slot]
            self.metrics.aborted()
            if self.kv_feed is not None:
                self._publish_kv()
                self.kv_feed.left(req.request_id)

    def _publish_kv(self) -> None:
        """The core's KV events since the last take, as one published batch."""
        assert self.kv_feed is not None
        self.kv_feed.commit(*self._engine.take_kv_events(), self._engine.cache_contents)

    def cache_contents(self) -> list[tuple[int, int]]:
        """Sorted (block key, copies) of the engine's prefix cache."""
        return self._engine.cache_contents()

    # -- the loop ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"emulator-{self.spec.name}")

    async def close(self) -> None:
        """Stop the loop; requests still resident end as ``failed``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # without re-raising the task's cancellation
        for req in self._requests.values():
            req._end(failed=True)
        self._requests.clear()
        if self.kv_feed is not None:
            self.kv_feed.close()

    async def _run(self) -> None:
        clock = self.clock()  # virtual end of the last batch
        while True:
            idled = self._engine.num_resident == 0
            if idled:
                self._wake.clear()
                await self._wake.wait()
            now = self.clock()
            # a busy engine starts the next batch where the last one ended; one that
            # idled starts now (never before the request that woke it arrived)
            start = clock if not idled and now - clock <= _MAX_LAG_S else now
            self._in_batch = True
            duration = self._engine.start_batch(start - self.t0)
            if duration is None:  # nothing schedulable; only reachable defensively
                self._in_batch = False
                self._wake.clear()
                await self._wake.wait()
                continue
            slots = self._engine.core.batch()[0].tolist()
            self._log.append((float(self.index), start - self.t0, duration,
                              *self._sums))
            self._num_batches += 1
            clock = start + duration
            while (left := clock - self.clock()) > 0:
                await asyncio.sleep(left)
            self._commit(slots, self.clock())
            self._in_batch = False
            for req in self._pending_aborts:
                self._drop(req)
            self._pending_aborts.clear()

    def _commit(self, slots: list[int], now: float) -> None:
        """Apply the batch and hand each produced token to its request."""
        produced = 0
        finished = self._engine.finish_batch()
        feed = self.kv_feed
        if feed is not None:
            self._publish_kv()   # before the finished requests release their names
        for request_id, flags, preemptions in finished:
            if flags & FINISHED:
                req = self._requests.pop(request_id)
                del self._by_slot[req.slot]
                if feed is not None:
                    feed.left(request_id)
                req.cached_tokens = self._engine.cached_prompt_tokens.pop(request_id, 0)
                produced += self._advance(req, req.output_tokens, now)
                if req.aborted:  # its client left during this, its last batch
                    self.metrics.aborted()
                else:
                    self.metrics.finished(now - req.arrival_s, preemptions,
                                          req.finish_reason)
                req._end()
        core = self._engine.core
        for slot in slots:
            req_or_none = self._by_slot.get(slot)
            if req_or_none is not None:
                produced += self._advance(req_or_none, core.request(slot)[1], now)
        self.metrics.generated(produced)

    def _advance(self, req: EmulatedRequest, num_tokens: int, now: float) -> int:
        new = num_tokens - req.num_tokens
        if new <= 0 or req.aborted:
            return 0
        if req.num_tokens == 0:
            req.first_token_s = now
            self.metrics.first_token(now - req.arrival_s, req.prompt_tokens)
        req.num_tokens = num_tokens
        req._notify()
        return new


BATCH_COLUMNS = BATCH_LOG_COLUMNS
