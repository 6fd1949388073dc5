"""HTTP face of an emulated instance (aiohttp) and the helpers that start several.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI-compatible,
streaming or not; formats in ``protocol``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus, vLLM names) and ``GET /olproute/batches?since=N`` (the batch
records, for recalibrating beta). An instance's role (``InstanceSpec.role``) decides which
side of a disaggregated prefill/decode request (``kv_transfer_params``) it takes: a
prefill instance answers ``do_remote_decode`` with the ``kv_transfer_params`` for the
decode request; a decode (or mixed) instance takes ``do_remote_prefill`` by waiting the KV
transfer time of the config's ``transfer`` section, then decoding with all but the last
prompt token computed (``olproute.routing.disagg.decode_admission``): every token it sends is
new, the first one included.

A request generates as many tokens as ``olproute.emulator.lengths`` says for its prompt
and the served model (its model's EOS, capped at ``max_tokens``; all ``max_tokens`` with
exact lengths), decided when it arrives, on a decode instance from the same prompt text
the prefill instance saw. A stream sends one SSE event per token; with a stream interval
N > 1 (vLLM's ``--stream-interval``) it writes them in groups: the first token at once,
then every N tokens, the rest when the request ends.

With KV events (``start_emulators(kv_events_base_port=...)``, ``olproute emulate
--kv-events-base-port``), each instance's publisher binds its PUB and replay sockets when
its application starts and closes them when it stops (``olproute.emulator.kv_publisher``).

Stopping an emulator is abrupt, like killing a vLLM process: requests in flight are
dropped and their connections closed without a final chunk or ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from olproute.config.loader import LoadedConfig, Profiles, SimConfig, load_config
from olproute.emulator.engine import BATCH_COLUMNS, EmulatedInstance, EmulatedRequest
from olproute.emulator.kv_publisher import KvPublisher
from olproute.emulator.lengths import OutputLengths, describe_lengths, output_lengths
from olproute.emulator.protocol import (
    ApiError,
    ChunkWriter,
    Kind,
    check_role,
    parse_body,
    parse_request,
    prefill_kv_params,
    response_body,
)
from olproute.routing.disagg import KvTransfer
from olproute.sim.engine import BatchTimer
from olproute.sim.scenario import streams
from olproute.sim.timing import LinearTiming, RooflineTiming
from olproute.types import InstanceSpec

INSTANCE_KEY = web.AppKey("instance", EmulatedInstance)
INSTANCE_HEADER = "x-olproute-instance"
MAX_BODY_BYTES = 1 << 20
MAX_BATCH_ROWS = 10_000


# -- handlers ---------------------------------------------------------------------------
def _error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body too large: {exc.text}") from None


def _cut(request: web.Request) -> None:
    """Close the connection mid-response, as a killed server would."""
    if request.transport is not None:
        request.transport.close()


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    inst = request.app[INSTANCE_KEY]
    try:
        body = parse_body(await _read_body(request))
        gen = parse_request(body, kind, inst.model_name, inst.max_model_len)
        check_role(gen, inst.spec.role)
        # where the model stops: decided by the prompt, so a decode instance given the
        # same prompt as its prefill instance decides the same
        output, _ = inst.lengths.tokens_of_body(body, inst.model_name, gen.max_tokens, kind)
        if gen.remote_prefill:
            if inst.kv_transfer is None:
                raise ApiError(400, "kv_transfer_params.do_remote_prefill: this instance has "
                                    "no KV transfer model", "kv_transfer_params")
            arrival = inst.clock()
            await inst.receive_kv(gen.prompt_tokens, gen.remote_engine_id)
            req = inst.submit_decode(gen.prompt_tokens, gen.max_tokens, arrival, output)
        else:
            chat = body["messages"] if kind == "chat" and inst.kv_feed is not None \
                else None
            req = inst.submit(gen.prompt_tokens, gen.max_tokens, output,
                              inst.block_hashes(gen.prompt_text, gen.prompt_tokens,
                                                gen.prompt_ids, chat))
    except ApiError as err:
        return _error(err)
    except RuntimeError:  # the engine is stopping
        return _error(ApiError(503, "the engine is shutting down", None, "server_error"))
    request_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    headers = {INSTANCE_HEADER: inst.spec.name}
    try:
        if gen.stream:
            return await _stream(request, req, ChunkWriter(gen, request_id, output), headers,
                                 inst.stream_interval, inst.prompt_tokens_details)
        await req.wait_done()
        if req.failed:
            _cut(request)
            return web.Response(status=503)
        kv_params = None
        if gen.remote_decode:
            inst.num_remote_decode_prefills += 1
            kv_params = prefill_kv_params(inst.spec.name, request.url.host, request.url.port,
                                          gen.prompt_tokens, inst.spec.block_size,
                                          inst.spec.tensor_parallel)
        body = response_body(gen, request_id, int(time.time()), req.num_tokens, kv_params,
                             req.cached_tokens if inst.prompt_tokens_details else None)
        return web.json_response(body, headers=headers)
    finally:
        inst.abort(req)  # no-op when it finished; frees slot and KV when the client left


async def _stream(request: web.Request, req: EmulatedRequest, writer: ChunkWriter,
                  headers: dict[str, str], interval: int = 1,
                  cached_tokens: bool = False) -> web.StreamResponse:
    """Send the tokens as they come, one SSE event each, in one write per ``interval``
    new tokens (vLLM's ``--stream-interval``: the first token at once, then whenever
    ``interval`` more exist, the rest when the request ends), then the end events (with
    ``cached_tokens``, the usage event reports the request's cached prompt tokens).
    Unlike vLLM, which puts the text of a write's tokens in one event, each token keeps
    its event, so whoever counts tokens by events (the router's proxy) counts right."""
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sent = 0
    try:
        while sent < req.output_tokens:
            n = await req.wait_to_send(sent, interval)
            if req.failed or req.aborted:
                _cut(request)
                return resp
            await resp.write(b"".join(writer.token(i) for i in range(sent, n)))
            sent = n
        await resp.write(writer.end(sent, req.cached_tokens if cached_tokens else None))
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the caller aborts the request
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE_KEY]
    card = {"id": inst.model_name, "object": "model", "created": int(inst.started_unix_s),
            "owned_by": "olproute", "root": inst.model_name,
            "max_model_len": inst.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE_KEY]
    text = inst.metrics.render(inst.num_running, inst.num_waiting, inst.kv_cache_usage,
                               inst.prefix_cache_queries, inst.prefix_cache_hits)
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def batches(request: web.Request) -> web.Response:
    """Batch records from index ``since`` on (at most ``limit``), each an object with the
    simulator's batch-log columns; ``first`` is the index of the first one returned (older
    ones may have been dropped), ``next`` the index to ask for next time. ``start_s``
    counts from ``started_unix_s`` (monotonic clock); ``duration_s`` is the real (scaled)
    batch time; the rest are the batch sums."""
    inst = request.app[INSTANCE_KEY]
    values: dict[str, int] = {}
    for name, default in (("since", 0), ("limit", MAX_BATCH_ROWS)):
        raw = request.query.get(name, str(default))
        try:
            values[name] = int(raw)
        except ValueError:
            values[name] = -1
        if values[name] < 0:
            return _error(ApiError(400, f"{name} must be an integer >= 0, got {raw!r}", name))
    first, rows = inst.batch_records(values["since"])
    rows = rows[:values["limit"]]
    return web.json_response({
        "instance": inst.spec.name, "first": first, "next": first + len(rows),
        "started_unix_s": inst.started_unix_s, "time_scale": inst.time_scale,
        "batches": [dict(zip(BATCH_COLUMNS, r, strict=True)) for r in rows]})


# -- the application ----------------------------------------------------------------------
def init_app(instance: EmulatedInstance, *, max_body_bytes: int = MAX_BODY_BYTES,
             batch_records: bool = True) -> web.Application:
    """The aiohttp application of one emulated instance; its engine loop runs while the
    application does. Run it with ``handler_cancellation=True`` so that a client leaving a
    non-streaming request aborts it too (streams notice on their next write anyway).
    ``batch_records=False``: no ``/olproute/batches`` (404, as on a real vLLM)."""
    app = web.Application(client_max_size=max_body_bytes)
    app[INSTANCE_KEY] = instance

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        inst = app[INSTANCE_KEY]
        if inst.kv_events is not None:
            await inst.kv_events.start()
        try:
            await inst.start()
            yield
            await inst.close()
        finally:
            if inst.kv_events is not None:
                await inst.kv_events.close()

    async def drop_inflight(app: web.Application) -> None:
        # before the server waits for open handlers: end them now (abrupt stop)
        await app[INSTANCE_KEY].close()

    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(drop_inflight)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if batch_records:
        app.router.add_get("/olproute/batches", batches)
    return app


def ground_truth_timers(specs: Sequence[InstanceSpec], profiles: Profiles, sim: SimConfig,
                        seed: int | None = None) -> list[BatchTimer]:
    """Per-instance batch timers built exactly as the simulator builds them
    (``olproute.sim.scenario.build_timers``): same models, same seeding."""
    engine_seeds = streams(sim.seed if seed is None else seed, len(specs)).engine_seeds
    timers: list[BatchTimer] = []
    for spec, ss in zip(specs, engine_seeds, strict=True):
        rng = np.random.default_rng(ss)
        if sim.timing == "linear":
            timers.append(LinearTiming(sim.linear_beta, sim.noise_cv, rng))
        else:
            timers.append(RooflineTiming(
                profiles.models[spec.model], profiles.gpus[spec.gpu], spec.tensor_parallel,
                sim.batch_overhead_ms / 1e3, sim.noise_cv, rng))
    return timers


@dataclass(slots=True)
class RunningEmulator:
    """One started emulator: its instance, and its base URL (the OpenAI base URL is
    ``url + "/v1"``)."""

    instance: EmulatedInstance
    runner: web.AppRunner
    url: str

    @property
    def name(self) -> str:
        return self.instance.spec.name

    @property
    def kv_events(self) -> KvPublisher | None:
        """Its KV-events publisher (``endpoint``, ``replay_endpoint``, ``topic``), or
        None when it publishes none."""
        return self.instance.kv_events

    async def stop(self) -> None:
        """Stop serving (abruptly: in-flight requests are cut). Idempotent."""
        await self.runner.cleanup()


async def start_emulators(
    specs: Sequence[InstanceSpec],
    *,
    loaded: LoadedConfig | None = None,
    timers: Sequence[BatchTimer] | None = None,
    seed: int | None = None,
    host: str = "127.0.0.1",
    base_port: int = 0,
    time_scale: float = 1.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    exact_lengths: bool = False,
    stream_interval: int = 1,
    lengths: OutputLengths | None = None,
    truth_path: str | os.PathLike[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    batch_records: bool = True,
    prompt_tokens_details: bool = False,
    kv_events_base_port: int | None = None,
    kv_events_hash_algo: str = "sha256",
    kv_events_topic: str = "",
) -> list[RunningEmulator]:
    """Start one emulated instance per spec in the running event loop, instance i on port
    ``base_port + i`` (``base_port=0``: free ports chosen by the OS).

    Batch times come from ``timers`` or else from the ground truth of ``loaded`` (default:
    ``configs/default.yaml``'s profiles and ``sim`` section, seeded by ``seed`` or
    ``sim.seed``). A request stops where ``lengths`` says, by default
    ``olproute.emulator.lengths.output_lengths(loaded, seed=seed, truth_path=truth_path)``
    (the synthetic workload's truth and the truth file's, else trace draws); with
    ``exact_lengths`` it generates all its ``max_tokens``. ``stream_interval``: vLLM's
    ``--stream-interval`` (``EmulatedInstance``). ``clock``: the engines' clock (a
    virtual-time loop's ``time`` in tests). ``batch_records=False``: no
    ``/olproute/batches``, as on a real vLLM. ``prompt_tokens_details``: vLLM's
    ``--enable-prompt-tokens-details`` (cached prompt tokens in the usage).
    ``kv_events_base_port``: each instance with prefix caching publishes its KV events as
    vLLM's ``--kv-events-config`` does, instance i's PUB on ``host`` port ``P + 2i`` and
    its replay ROUTER on ``P + 2i + 1`` (0: free ports), on ``kv_events_topic``, its
    blocks hashed with ``kv_events_hash_algo`` (``RunningEmulator.kv_events`` has the
    endpoints); None (default): no events, no sockets. Stop them with
    ``stop_emulators`` (or use ``emulators(...)``)."""
    if loaded is None:
        loaded = load_config()
    if timers is None:
        timers = ground_truth_timers(specs, loaded.profiles, loaded.config.sim, seed)
    if len(timers) != len(specs):
        raise ValueError(f"{len(specs)} specs but {len(timers)} timers")
    if lengths is None:
        lengths = output_lengths(loaded, seed=seed, truth_path=truth_path,
                                 exact=exact_lengths)
    started: list[RunningEmulator] = []
    try:
        for i, (spec, timer) in enumerate(zip(specs, timers, strict=True)):
            model = loaded.profiles.models.get(spec.model)
            inst = EmulatedInstance(
                spec, timer, index=i, time_scale=time_scale,
                max_model_len=None if model is None else model.max_context_tokens,
                kv_transfer=None if model is None else KvTransfer.of(
                    model, loaded.config.transfer),
                lengths=lengths, exact_lengths=exact_lengths, stream_interval=stream_interval,
                clock=clock, prompt_tokens_details=prompt_tokens_details,
                kv_events=_kv_publisher(i, host, kv_events_base_port, kv_events_topic),
                kv_hash_algo=kv_events_hash_algo)
            runner = web.AppRunner(init_app(inst, max_body_bytes=max_body_bytes,
                                            batch_records=batch_records),
                                   handler_cancellation=True, access_log=None,
                                   shutdown_timeout=1.0)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, base_port + i if base_port else 0).start()
            except BaseException:
                await runner.cleanup()
                raise
            port = runner.addresses[0][1]
            started.append(RunningEmulator(inst, runner, f"http://{_url_host(host)}:{port}"))
    except BaseException:
        await stop_emulators(started)
        raise
    return started


def _kv_publisher(i: int, host: str, base_port: int | None, topic: str
                  ) -> KvPublisher | None:
    """Instance i's KV-events publisher (not yet bound), or None with no base port."""
    if base_port is None:
        return None
    if base_port < 0:
        raise ValueError(f"kv_events_base_port must be >= 0, got {base_port}")
    return KvPublisher(host, base_port + 2 * i if base_port else 0,
                       base_port + 2 * i + 1 if base_port else 0, topic)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def stop_emulators(running: Sequence[RunningEmulator]) -> None:
    await asyncio.gather(*(r.stop() for r in running))


@asynccontextmanager
async def emulators(specs: Sequence[InstanceSpec], **kwargs: object
                    ) -> AsyncIterator[list[RunningEmulator]]:
    """``async with emulators(specs, time_scale=0.5) as running:`` — started, then
    always stopped; keyword arguments as ``start_emulators``."""
    running = await start_emulators(specs, **kwargs)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        await stop_emulators(running)


def emulation_config(loaded: LoadedConfig, num_instances: int | None = None,
                     model_gpu: tuple[str, str] | None = None) -> LoadedConfig:
    """The config with its instances replaced for ``olproute emulate``: ``model_gpu``
    puts every instance on that model and GPU (KV capacity re-derived; an unknown name is
    a ConfigError naming the key); ``num_instances`` keeps the first instance's settings
    with that many replicas."""
    insts = list(loaded.config.instances)
    if model_gpu is not None:
        model, gpu = model_gpu
        insts = [i.model_copy(update={"model": model, "gpu": gpu}) for i in insts]
    if num_instances is not None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        first = insts[0]
        name = f"{first.model}-{first.gpu}" if model_gpu is not None else first.name
        insts = [first.model_copy(update={"replicas": num_instances, "name": name})]
    return loaded.with_updates(instances=insts)


async def serve_emulators(loaded: LoadedConfig, *, host: str, base_port: int,
                          time_scale: float, seed: int | None = None,
                          lengths: OutputLengths | None = None, exact_lengths: bool = False,
                          stream_interval: int = 1,
                          kv_events_base_port: int | None = None) -> None:
    """Run the config's instances as emulators, printing their URLs, until SIGINT or
    SIGTERM (or cancellation); then stop them. Keywords as ``start_emulators``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # explicit handlers: a SIGINT ignored by a parent shell still stops us
        loop.add_signal_handler(sig, stop.set)
    running = await start_emulators(loaded.specs, loaded=loaded, seed=seed, host=host,
                                    base_port=base_port, time_scale=time_scale,
                                    lengths=lengths, exact_lengths=exact_lengths,
                                    stream_interval=stream_interval,
                                    kv_events_base_port=kv_events_base_port)
    try:
        for r in running:
            s = r.instance.spec
            print(f"{s.name:<24} {r.url}  ({s.model} on {s.gpu} x{s.tensor_parallel}, "
                  f"{s.max_num_seqs} seqs, {s.kv_capacity_tokens:,} KV tokens)", flush=True)
            if r.kv_events is not None:
                print(f"{'':<24} KV events {r.kv_events.endpoint}, replay "
                      f"{r.kv_events.replay_endpoint} (topic {r.kv_events.topic!r}, "
                      f"{r.instance.kv_hash_algo}, tokenizer words)", flush=True)
        interval = (f"stream interval {stream_interval}; " if stream_interval > 1 else "")
        print(f"{len(running)} emulated instance(s) serving; "
              f"{describe_lengths(running[0].instance.lengths)}; {interval}Ctrl-C stops",
              flush=True)
        await stop.wait()
    finally:
        await stop_emulators(running)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
