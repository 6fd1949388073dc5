"""The router's aiohttp application: ``init_app(loaded)`` builds it; resources open in a
cleanup context (HTTP session, emulated backends when the config names none, the router
and its tracker) and background tasks run there too: price updates (in a worker thread,
off the event loop), health checks with backoff, scraping the backends' Prometheus
gauges, beta recalibration from the backends' batch records (or, for a backend without
them, from the streams relayed from it: ``olproute.estimate.streamcal``), and the live
certificate of bid_price's prices (``olproute.server.certify_live``) and its re-solves
(``olproute.server.resolving``), each LP in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import re
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from aiohttp import web

from olproute.config.loader import LoadedConfig
from olproute.config.read import ConfigError
from olproute.config.schema import KvEventsConfig
from olproute.estimate.calibration import OnlineCalibrator
from olproute.estimate.streamcal import StreamCalibrator, StreamRecorder
from olproute.routing.assembly import CalibrationSource, served_predictor
from olproute.routing.block_hash import BlockHasher, PromptNamer, PromptTokenizer, load_tokenizer
from olproute.routing.router import Router, prediction_source
from olproute.server import admin, certify_live, dashboard, proxy, resolving
from olproute.server.capture import LiveCapture
from olproute.server.certify import Certifier, LiveCert
from olproute.server.engine_config import (
    EngineConfig,
    cache_config_line,
    engine_spec,
    mismatches,
    parse_labels,
)
from olproute.server.errors import json_errors
from olproute.server.holding import HoldQueue
from olproute.server.kv_subscriber import KvSubscriber
from olproute.server.metrics import ServerMetrics
from olproute.server.resolved import Handover, Resolver
from olproute.server.schema import (
    BadRequest,
    RouteBody,
    count_words,
    explanation_doc,
    openapi,
    prediction_doc,
    validate,
)
from olproute.server.shared import SharedState
from olproute.server.shared_auth import state_secret
from olproute.server.state import STATE, ServerState, log_unpredicted, prediction_status
from olproute.server.tracker import BackendState, Tracker
from olproute.types import EngineSnapshot, PriceView

LOG = logging.getLogger("olproute.server")

if TYPE_CHECKING:
    from olproute.predict import Predictor

VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc")
# vLLM v1's prefix-cache query counter (tokens): going down means the backend restarted
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_COUNTERS = (PREFIX_QUERIES,)
# recalibration from a backend's streams (olproute.estimate.streamcal): the rows' window, a refit
# every so many new rows, once the window holds this many of each kind
STREAM_WINDOW_ROWS = 4096
STREAM_REFIT_EVERY = 32
STREAM_MIN_ROWS = 16
# recalibration from a backend's batch records: a refit every so many new records
BATCH_REFIT_EVERY = 256
BACKEND_URLS = web.AppKey("olproute_backend_urls", list)
# an idle connection to a backend is closed after this: before the server closes it
# (uvicorn, vLLM's server, closes idle connections after 5 s), so that a request is not
# sent on a connection the server is closing (``proxy._post`` also retries that once)
KEEPALIVE_S = 4.0


def init_app(loaded: LoadedConfig, backend_urls: list[str] | None = None,
             calibration: CalibrationSource | None = None,
             certifier: Certifier | None = None,
             predictor: Predictor | None = None,
             resolver: Resolver | None = None,
             progress: Progress | None = None) -> web.Application:
    """The router application. ``backend_urls`` (one per instance, in order) overrides the
    config's backends; with neither, the instances are emulated in-process.
    ``calibration``: what estimating policies read (``olproute.routing.assembly``); without one,
    the config's calibration file (``calibration: auto`` needs the simulator's profiler:
    ``olproute serve`` passes ``olproute.sim.scenario.CalibrationSource``).
    ``certifier``: checks a window of bid_price's prices against the exact LP, in a
    worker process (a picklable function; ``olproute serve`` passes
    ``solvers.live.certify``); without one, no live certificate. ``resolver``: re-solves
    the recent window's LP for bid_price's prices, in a worker process
    (``olproute.server.resolving``; ``olproute serve`` passes
    ``solvers.resolve.resolve_live``); without one, no re-solves. ``predictor``: the one
    ``prediction.serve`` names, already loaded (``olproute serve`` loads it first, so a
    bad folder stops it before anything starts); without one, it is loaded at start-up
    (``olproute.routing.assembly.served_predictor``). ``progress`` is told, in a few
    words, each start-up step that takes time (``olproute serve`` prints them); without
    one, start-up is silent."""
    app = web.Application(client_max_size=loaded.config.server.max_body_bytes,
                          middlewares=[json_errors])  # every error in one JSON shape
    app[BACKEND_URLS] = list(backend_urls or [])
    app.cleanup_ctx.append(_lifecycle(loaded, calibration, certifier, predictor, resolver,
                                      progress or _silent))
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/route", route)
    app.router.add_get("/prices", prices)
    app.router.add_get("/instances", instances)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi_doc)
    app.router.add_get("/debug/loop-lag", loop_lag)
    app.router.add_post("/admin/reload", admin.reload)
    dashboard.add_routes(app)  # /dashboard, /dashboard/data
    return app


def _lifecycle(loaded: LoadedConfig, calibration: CalibrationSource | None,
               certifier: Certifier | None, predictor: Predictor | None,
               resolver: Resolver | None, progress: Progress,
               ) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        server = loaded.config.server
        async with contextlib.AsyncExitStack() as stack:
            urls = app[BACKEND_URLS]
            by_name = {b.name: b for b in server.backends}
            # the name each backend answers to, also when the URLs are given
            served = [by_name[s.name].served_model if s.name in by_name else None
                      for s in loaded.specs]
            if not urls and server.backends:
                urls = [by_name[s.name].url for s in loaded.specs]
            running: list[Any] = []
            if not urls:
                from olproute.emulator import start_emulators

                truth = server.emulator_truth
                progress(f"starting {len(loaded.specs)} emulated engines ...")
                running = await start_emulators(
                    loaded.specs, loaded=loaded, time_scale=server.emulator_time_scale,
                    exact_lengths=server.emulator_exact_lengths,
                    stream_interval=server.emulator_stream_interval,
                    truth_path=None if truth is None else loaded.resolve(truth),
                    kv_events_base_port=0 if server.emulator_kv_events else None)
                stack.push_async_callback(_stop_all, running)
                urls = [r.url for r in running]
            # no cap on the proxy's connections: the policy bounds what is in flight, and
            # a capped pool would queue dispatched requests in the client, unseen
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                               keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=server.request_timeout_s,
                                              sock_connect=server.connect_timeout_s))
            stack.push_async_callback(session.close)
            # health checks, scraping and batch records on connections of their own, so a
            # busy proxy never makes a backend's probe wait
            control = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4 * len(urls) + 4,
                                               keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=5.0, sock_connect=server.connect_timeout_s))
            stack.push_async_callback(control.close)
            loop = asyncio.get_running_loop()
            router = await loop.run_in_executor(None, _build_router, loaded, calibration,
                                                predictor, progress)
            st = ServerState(loaded=loaded, router=router,
                             tracker=Tracker(loaded.specs, urls, served_models=served,
                                             max_backoff_s=server.health_max_backoff_s),
                             metrics=ServerMetrics(),
                             session=session, t0=loop.time(), emulators=running,
                             control=control)
            _recalibrators(st)
            st.tracker.running_from_scrape = server.running_from_scrape
            subscribers = kv_events(st)
            st.holding = HoldQueue(loaded.config.admission.max_held,
                                   loaded.config.router.slot_ms / 1e3,
                                   server.hold_budget_ms / 1e3, st.now)
            _live_jobs(st, stack, certifier, resolver)
            app[STATE] = st
            await _start_shared(st, stack)
            tasks = [asyncio.create_task(_every(period, job, st)) for period, job in (
                (router.tick_s, _tick), (server.health_period_s, _health),
                (server.scrape_period_s, _scrape),
                (server.recalibrate_period_s, _recalibrate),
                (loaded.config.state.sync_ms / 1e3 if st.shared else 0.0, _sync))
                if period > 0]
            tasks.append(asyncio.create_task(st.lag.run(st.metrics.loop_lag_seconds.observe)))
            tasks.extend(asyncio.create_task(s.run()) for s in subscribers)
            if st.live_cert is not None:
                tasks.append(asyncio.create_task(certify_live.run(st)))
            if st.live_resolve is not None:
                tasks.append(asyncio.create_task(resolving.run(st)))
            try:
                yield
            finally:
                await stop_tasks(tasks)
                await st.holding.close()
    return ctx


def kv_events(st: ServerState) -> list[KvSubscriber]:
    """The subscribers of the backends whose config names their KV events (or, for the
    embedded default with ``server.emulator_kv_events``, of the emulators that publish
    theirs), the router's index of each put in exact mode; a tokenizer that does not load
    is a ConfigError naming the backend's key. None without a prefix index (no backend
    caches prefixes)."""
    sources = _event_sources(st)
    namers: list[PromptNamer | None] = [None] * len(st.loaded.specs)
    hashers: list[BlockHasher | None] = [None] * len(st.loaded.specs)
    st.kv_subscribers = [None] * len(st.loaded.specs)
    loaded_tokenizers: dict[str, PromptTokenizer] = {}
    for g, spec in enumerate(st.loaded.specs):
        source = sources[g]
        if source is None:
            continue
        key, ev = source
        path = ev.tokenizer if ev.tokenizer == "words" else str(st.loaded.resolve(ev.tokenizer))
        try:
            tok = loaded_tokenizers.get(path) or load_tokenizer(path)
        except Exception as e:   # a missing file, or tokenizers' own errors
            raise ConfigError(st.loaded.path, [(f"{key}.tokenizer",
                              f"backend {spec.name}: tokenizer {path} does not load: "
                              f"{e}")]) from None
        loaded_tokenizers[path] = tok
        hasher = hashers[g] = BlockHasher(ev.hash_algo, ev.hash_seed)
        namers[g] = PromptNamer(tok, hasher, spec.block_size)
    if st.router.prefixes is None or not any(namers):
        return []
    st.router.set_namers(namers)
    st.tracker.prefill_from_events = st.loaded.config.server.prefill_from_kv_events
    out = []
    for g, spec in enumerate(st.loaded.specs):
        source = sources[g]
        if namers[g] is None or source is None:
            continue
        ev = source[1]
        sub = KvSubscriber(spec.name, g, st.router.prefixes, ev.endpoint, ev.replay_endpoint,
                           ev.topic, hashers[g], ev.replay_timeout_s,
                           on_stored=st.tracker.engine_stored)
        st.kv_subscribers[g] = sub
        out.append(sub)
        LOG.info("backend %s: prefix index exact, from KV events at %s", spec.name,
                 ev.endpoint)
    return out


def _event_sources(st: ServerState) -> list[tuple[str, KvEventsConfig] | None]:
    """Per backend, its KV events' config and where it comes from (a config key, for
    errors), or None: the config's backends', else the embedded emulators' own."""
    server = st.loaded.config.server
    by_name = {b.name: (i, b) for i, b in enumerate(server.backends)}
    emulated = [] if server.backends else st.emulators   # the embedded default's
    out: list[tuple[str, KvEventsConfig] | None] = []
    for g, spec in enumerate(st.loaded.specs):
        i, b = by_name.get(spec.name, (-1, None))
        if b is not None and b.kv_events is not None:
            out.append((f"server.backends[{i}].kv_events", b.kv_events))
            continue
        pub = emulated[g].kv_events if g < len(emulated) else None
        if pub is None or pub.endpoint is None:
            out.append(None)
            continue
        out.append(("server.emulator_kv_events", KvEventsConfig(
            endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic,
            tokenizer="words", hash_algo=emulated[g].instance.kv_hash_algo)))
    return out


def _live_jobs(st: ServerState, stack: contextlib.AsyncExitStack,
               certifier: Certifier | None, resolver: Resolver | None) -> None:
    """The capture and the worker pools of the live certificate and the re-solves (each
    spawns its worker now if it is on), stopped with the server."""
    if certifier is None and resolver is None:
        return
    st.capture = LiveCapture(len(st.loaded.specs), st.loaded.config.prices.certify_max_requests)
    if certifier is not None:
        st.live_cert = LiveCert(certifier,
                                on_result=lambda doc, _: st.metrics.set_certificate(doc))
        stack.callback(st.live_cert.close)
        if st.certifying():
            st.live_cert.start()
    if resolver is not None:
        st.live_resolve = resolving.worker(st, resolver)
        stack.callback(st.live_resolve.close)
        if st.resolving():
            st.live_resolve.start()


# a background task is cancelled again after STOP_WAIT_S and given up (left to the loop's
# end) after STOP_ROUNDS rounds: stopping waits at most 2 s for them (olproute serve
# exits within 5 s of SIGTERM whatever Redis does)
STOP_WAIT_S = 0.5
STOP_ROUNDS = 4


async def stop_tasks(tasks: Sequence[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """Cancel the background tasks and wait for them, boundedly: a task that swallowed
    its cancellation (an ``await`` inside it that completed as it was cancelled, e.g.
    Python 3.11's ``asyncio.wait_for``) is cancelled again every ``STOP_WAIT_S``, and
    after ``STOP_ROUNDS`` rounds it is left behind (logged) rather than awaited for ever.
    Returns the tasks left running."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(STOP_ROUNDS):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=STOP_WAIT_S)
    for t in pending:
        LOG.error("shutdown: background task %s did not stop when cancelled", t.get_name())
    for t in tasks:   # retrieve the exceptions, so that none is logged as never retrieved
        if t.done() and not t.cancelled():
            t.exception()
    return sorted(pending, key=lambda t: t.get_name())


async def _start_shared(st: ServerState, stack: contextlib.AsyncExitStack) -> None:
    """With ``state.url``, this replica's link to the others on Redis, synced once
    before the first request (its price books are the current router's policy's: a
    reload brings new ones)."""
    url = st.loaded.config.state.url
    if url is None:
        return
    st.shared = SharedState(st.loaded.config.state, url, st.tracker,
                            lambda: st.router.policy.price_books(), st.now, st.book_lock,
                            reward=st.loaded.config.reward, secret=state_secret(st.loaded))
    stack.push_async_callback(st.shared.close)
    await st.shared.sync()
    st.metrics.set_shared(st.shared.status)


def _recalibrators(st: ServerState) -> None:
    """Each backend's online calibrators, from the router's calibration: from its batch
    records and from its streams (``olproute.estimate.streamcal``); its beta's source initial."""
    cal = st.router.calibration()
    st.calibrators = [OnlineCalibrator(c.beta, refit_every=BATCH_REFIT_EVERY) for c in cal]
    st.batches_supported = [True] * len(cal)
    st.stream_calibrators = [
        StreamCalibrator(c.beta, s.max_num_batched_tokens, s.max_num_seqs,
                         window=STREAM_WINDOW_ROWS, refit_every=STREAM_REFIT_EVERY,
                         min_prefill_rows=STREAM_MIN_ROWS, min_decode_rows=STREAM_MIN_ROWS)
        for c, s in zip(cal, st.loaded.specs, strict=True)]
    st.beta_sources = ["initial"] * len(cal)


async def _stop_all(running: list[Any]) -> None:
    for r in running:
        await r.stop()


def _build_router(loaded: LoadedConfig, calibration: CalibrationSource | None,
                  predictor: Predictor | None, progress: Progress) -> Router:
    """The router, calibrated now (at start-up, not on the first request), with its
    predictor (``predictor``, else the one the config names, loaded and warmed now), its
    policy's first-call costs paid (``_warm``); each step told to ``progress``."""
    if predictor is None:
        predictor = served_predictor(loaded)
    policy = loaded.config.router.policy
    progress(f"building the router (policy {policy}) ...")
    router = Router(loaded, calibration, predictor=predictor)
    if loaded.config.calibration == "auto":
        progress("calibrating the batch time (calibration: auto, in the simulator) ...")
    router.calibration()
    progress("compiling the price update ..." if router.policy.price_view() is not None
             else f"warming {policy}'s first decision ...")
    _warm(loaded, router.calibration, predictor)
    log_unpredicted(router)
    return router


def _warm(loaded: LoadedConfig, calibration: CalibrationSource,
          predictor: Predictor | None) -> None:
    """Pay at start-up, on a throwaway router, what a policy pays at its first decision
    and first tick: bid_price's first price update compiles its jitted steps (1.4 s, in
    the tick's thread but holding the GIL while it traces, a second of lag while
    serving); the shapes are fixed by the config, so the router's own ticks reuse it. Its
    request has text, so the predictor runs too."""
    warm = Router(loaded, calibration, predictor=predictor)
    tracker = Tracker(loaded.specs, ["http://warm"] * len(loaded.specs))
    req = warm.new_request(0.0, 100, 16, 1.0, text="warm up the router")
    warm.decide(req, 0.0, tracker.loads(0.0), tracker.snapshots(0.0),
                [True] * len(loaded.specs))
    warm.tick(warm.tick_s, tracker.snapshots(warm.tick_s))


async def _every(period_s: float, job: Callable[[ServerState], Awaitable[None]],
                 st: ServerState) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            await job(st)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a background job must not die: log and go on
            print(f"olproute: background {job.__name__} failed: {exc!r}", file=sys.stderr)


# -- background jobs --------------------------------------------------------------------------
async def _tick(st: ServerState) -> None:
    now = st.now()
    snaps = st.tracker.snapshots(now)
    router = st.router
    handover = resolving.take_handover(st, router)
    view, refused = await asyncio.get_running_loop().run_in_executor(
        None, _ticked, router, now, snaps, st.book_lock, handover)
    if handover is not None:
        resolving.applied(st, handover, now, refused)
    if view is not None:
        st.metrics.set_price_sums([s.name for s in st.loaded.specs], view.prices)
    st.metrics.price_updates.inc()
    if st.router is router and view is not None:   # not replaced by a reload meanwhile
        st.ticked(now, view)


def _ticked(router: Router, now_s: float, snapshots: tuple[EngineSnapshot, ...],
            lock: threading.Lock, handover: Handover | None = None
            ) -> tuple[PriceView | None, str | None]:
    """The policy's tick, a re-solve's duals after its update (``handover``: they are
    the prices until the next; why not, if they do not fit), and the prices it left (in
    the tick's worker thread: copying them out took 0.7 ms, and the JSON document of
    them 1.6 ms, of the event loop), holding the price books' lock
    (``ServerState.book_lock``)."""
    with lock:
        router.tick(now_s, snapshots)
        refused = None if handover is None else resolving.warm_start(router, handover, now_s)
        return router.policy.price_view(), refused


async def _sync(st: ServerState) -> None:
    """One exchange with the other replicas (``olproute.server.shared``)."""
    assert st.shared is not None
    await st.shared.sync()
    st.metrics.set_shared(st.shared.status)


async def _health(st: ServerState) -> None:
    loop = asyncio.get_running_loop()

    async def probe(g: int) -> None:
        b = st.tracker.backends[g]
        sent = loop.time()
        ok, timed_out = await _probe_health(st, b.url)
        name = b.spec.name
        if timed_out and _router_lagged(st, sent, loop.time()):
            # the router's own loop ran late: the answer may have been waiting unread
            st.metrics.probes.labels(name, "inconclusive").inc()
            return
        st.metrics.probes.labels(name, "ok" if ok else "failed").inc()
        if ok:
            st.tracker.mark_success(g)
        elif b.healthy or st.now() >= b.next_probe_s:
            st.mark_failure(g)

    await asyncio.gather(*(probe(g) for g in st.tracker.due_for_probe(st.now())))
    st.metrics.set_backends([b.spec.name for b in st.tracker.backends], st.tracker.healthy(),
                            [len(b.flights) + len(b.inbound) for b in st.tracker.backends])


async def _probe_health(st: ServerState, url: str) -> tuple[bool, bool]:
    """(the backend's /health answered 200, the probe timed out). A kept-alive connection
    the backend closed meanwhile is no answer: the probe is sent once more."""
    for attempt in range(2):
        try:
            async with st.control.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(
                        total=st.loaded.config.server.health_timeout_s)) as r:
                return r.status == 200, False
        except aiohttp.ServerDisconnectedError:
            if attempt:
                return False, False
        except TimeoutError:
            return False, True
        except aiohttp.ClientError:
            return False, False
    raise AssertionError("unreachable")


def _router_lagged(st: ServerState, sent: float, now: float) -> bool:
    """Did the router's event loop lag while a probe sent at ``sent`` timed out? Its
    timeout fired late (the loop was busy when it was due), or the loop ran a timer a
    quarter of the probe's timeout late meanwhile."""
    limit = st.loaded.config.server.health_timeout_s
    late = (now - sent) - limit
    return late > 0.25 * limit or st.lag.max_since(sent) > 0.25 * limit


async def _scrape(st: ServerState) -> None:
    async def one(g: int) -> None:
        b = st.tracker.backends[g]
        try:
            async with st.control.get(b.url + "/metrics",
                                      timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (TimeoutError, aiohttp.ClientError):
            return
        gauges = vllm_gauges(text)
        if not gauges and g not in st.gaugeless:
            st.gaugeless.add(g)
            print(f"olproute: backend {b.spec.name}'s /metrics has none of "
                  f"{', '.join(VLLM_GAUGES)} (a vLLM started with --disable-log-stats "
                  "exports none): its KV use is the router's own count", file=sys.stderr)
        st.tracker.set_scraped(g, gauges, st.now())
        st.metrics.set_scraped(b.spec.name, gauges)
        line = cache_config_line(text)
        if line != b.engine_line:   # at start, or after a restart with other flags
            engine_seen(st, g, line)
        queries = vllm_gauges(text, PREFIX_COUNTERS).get(PREFIX_QUERIES)
        if queries is not None and st.tracker.prefix_queries_scraped(g, queries):
            # a restart between two health probes (one that saw it down clears it too)
            print(f"olproute: backend {b.spec.name}'s prefix-cache query counter went "
                  "down (it restarted): its entries in the prefix index are dropped",
                  file=sys.stderr)
            st.router.cache_lost(g)

    await asyncio.gather(*(one(b.index) for b in st.tracker.backends if b.healthy))
    if st.rebuild_wanted:
        await admin.rebuild_on_engines(st)


def engine_seen(st: ServerState, g: int, line: str | None) -> None:
    """Backend g's engine says it runs as ``line`` (its ``vllm:cache_config_info``; None:
    it says nothing): where that differs from the profile, each difference is logged and
    shown, and the tracker, g's exact prefix index and (rebuilt after the scrape) the
    router model the engine (``olproute.server.engine_config``)."""
    b = st.tracker.backends[g]
    profile = st.loaded.specs[g]
    b.engine_line = line
    engine = None if line is None else EngineConfig.of_labels(parse_labels(line))
    source = _event_sources(st)[g]   # the router's hash setting where it reads events
    algo = None if source is None else source[1].hash_algo
    b.engine = engine
    b.engine_mismatches = () if engine is None else tuple(mismatches(profile, engine, algo))
    spec = profile if engine is None else engine_spec(profile, engine)
    st.tracker.set_spec(g, spec)
    if spec != st.engine_specs.get(g, profile):   # the router is rebuilt after the scrape
        if spec == profile:
            st.engine_specs.pop(g, None)
        else:
            st.engine_specs[g] = spec
        st.rebuild_wanted = True
    st.metrics.set_engine_mismatch(profile.name, bool(b.engine_mismatches))
    for problem in b.engine_mismatches:
        print(f"olproute: backend {profile.name}'s engine differs from its profile: "
              f"{problem}; the router models what the engine says", file=sys.stderr)
    index = st.router.prefixes
    if engine is None or index is None or not index.exact[g]:
        return
    size = engine.block_size or index.block_sizes[g]
    capacity = engine.num_gpu_blocks or index.capacity[g]
    if (size, capacity) != (index.block_sizes[g], index.capacity[g]):
        index.set_exact(g, block_size=size, capacity=capacity)   # its names change: empty
        namer = st.router.namers[g]
        if namer is not None:
            namer.block_size = size


def vllm_gauges(text: str, names: tuple[str, ...] = VLLM_GAUGES) -> dict[str, float]:
    """The sums over their label sets of the vLLM gauges (``VLLM_GAUGES``, or other
    ``names``) in a Prometheus text exposition. Only lines that start with one of the
    names are read: the full parser (``prometheus_client.parser``) took milliseconds of
    the event loop for an emulator's page, this takes tens of microseconds."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(names):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name not in names:
            continue   # a longer name that starts with a gauge's
        value = rest.rpartition("}")[2] if "}" in rest else rest
        fields = value.split()
        try:
            found[name] = found.get(name, 0.0) + float(fields[0])
        except (IndexError, ValueError):
            continue
    return found



async def _recalibrate(st: ServerState) -> None:
    """Each backend's beta from its batch records (``/olproute/batches``, the emulator's
    extension; asked until it answers, and a backend that answers 404 is not asked
    again) or, for a backend without them (vLLM), from the streams the proxy relayed
    from it (``olproute.estimate.streamcal``). The rows and refits run in a worker thread."""
    for b in st.tracker.backends:
        if st.batches_supported[b.index] and b.healthy:
            await _from_batches(st, b)
        if not st.batches_supported[b.index]:
            await _from_streams(st, b)


async def _from_batches(st: ServerState, b: BackendState) -> None:
    """New batch records to the backend's calibrator; a backend without them
    (404) is marked so. The first answer turns its stream recorder off."""
    try:
        async with st.control.get(f"{b.url}/olproute/batches?since={b.batches_seen}",
                                  timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            if r.status == 404:
                st.batches_supported[b.index] = False
                return
            if r.status != 200:
                return
            doc = await r.json()
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return
    if b.recorder.enabled:   # its beta comes from its batch records from now on
        b.recorder.enabled = False
        b.recorder.clear()
    rows = doc.get("batches") or []
    cal = st.calibrators[b.index]
    before = cal.num_refits
    # thousands of records and an NNLS refit: in a worker thread, not on the loop
    await asyncio.get_running_loop().run_in_executor(None, _feed, cal, rows)
    b.batches_seen = int(doc.get("next", b.batches_seen + len(rows)))
    if cal.num_refits > before:
        st.beta_sources[b.index] = "batches"
        st.router.set_beta(b.index, cal.beta)
        st.metrics.beta_refits.labels(b.spec.name, "batches").inc()


def _feed(cal: OnlineCalibrator, rows: list[dict[str, Any]]) -> None:
    """A backend's batch records to its calibrator (which refits every so many)."""
    cal.add_many([(float(r["duration_s"]), float(r["num_tokens"]),
                   float(r["sum_decode_context"]), float(r["sum_prefill_attention"]))
                  for r in rows])


async def _from_streams(st: ServerState, b: BackendState) -> None:
    """The backend's recorded stream events to its stream calibrator (rows, and a refit
    when due); a refitted beta goes to the router."""
    cal = st.stream_calibrators[b.index]
    refitted = await asyncio.get_running_loop().run_in_executor(
        None, _consume, cal, b.recorder)
    name = b.spec.name
    st.metrics.calibration_rows.labels(name, "prefill").set(cal.num_prefill_rows)
    st.metrics.calibration_rows.labels(name, "decode").set(cal.num_decode_rows)
    if refitted:
        st.beta_sources[b.index] = "streams"
        st.router.set_beta(b.index, cal.beta)
        st.metrics.beta_refits.labels(name, "streams").inc()


def _consume(cal: StreamCalibrator, recorder: StreamRecorder) -> bool:
    """The events recorded since the last call to the calibrator: True if it refitted."""
    return cal.consume(recorder.drain())


# -- handlers ---------------------------------------------------------------------------------
async def route(request: web.Request) -> web.Response:
    st = request.app[STATE]
    server = st.loaded.config.server
    try:
        data = await proxy.read_json(request, server.max_body_bytes,
                                     server.body_timeout_s)
        body: RouteBody = validate(RouteBody, data)
        if body.prompt_tokens is not None:
            prompt_tokens = body.prompt_tokens
        elif body.prompt is not None:
            prompt_tokens = max(count_words(body.prompt), 1)
        else:
            raise BadRequest("prompt", "give prompt or prompt_tokens")
        # the completions' rule: a model the pool serves, else a 404 (or any_model)
        exclude = st.model_exclude(body.model)
        if exclude is None:
            return proxy.model_not_found(str(body.model))
    except BadRequest as exc:
        return web.json_response(exc.as_json(), status=400)
    max_tokens = body.max_tokens or server.default_max_tokens
    ttft_ms = body.ttft_target_ms or server.default_ttft_ms
    req = st.router.new_request(st.now(), prompt_tokens, max_tokens, ttft_ms / 1e3,
                                body.slo_class, body.prompt, body.predicted_tokens)
    d = st.decide(req, exclude)
    # a decision only: nothing is dispatched, so the policy keeps nothing for it
    st.router.forget(req.request_id)
    names = [s.name for s in st.loaded.specs]
    prediction = prediction_doc(req, st.router.models, max_tokens,
                                prediction_source(req, body.predicted_tokens is not None))
    answer = {"request_id": req.request_id, "action": d.action,
              "instance": None if d.instance is None else names[d.instance],
              "decode_instance": None if d.decode_instance is None
              else names[d.decode_instance],
              "reason": d.reason, "refusal": d.refusal, "policy": st.router.policy_name,
              "instances": names,
              "explanation": explanation_doc(d.explanation, prediction)}   # schema.RouteAnswer
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    """The models the pool serves, in OpenAI's list shape (``schema.ModelList``)."""
    st = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        model_card(name, st.started_unix_s) for name in st.served_models()]})


async def model(request: web.Request) -> web.Response:
    """One model the pool serves (``schema.ModelCard``), else 404 ``model_not_found``."""
    st = request.app[STATE]
    name = request.match_info["model"]
    if name not in st.served_models():
        return proxy.model_not_found(name)
    return web.json_response(model_card(name, st.started_unix_s))


def model_card(name: str, created_s: int) -> dict[str, Any]:
    """A served model as OpenAI describes one (``schema.ModelCard``)."""
    return {"id": name, "object": "model", "created": created_s, "owned_by": "olproute"}


async def prices(request: web.Request) -> web.Response:
    st = request.app[STATE]
    doc = st.router.prices()
    if doc is None:
        doc = {"policy": st.router.policy_name, "instances": [],
               "message": "this policy has no shadow prices"}
    return web.json_response({**doc, **certify_live.certificate_doc(st),
                              **resolving.resolve_doc(st)})


async def instances(request: web.Request) -> web.Response:
    st = request.app[STATE]
    now = st.now()
    loads = st.tracker.loads(now)
    # the beta each backend's replay runs with (None without BEA), its source (initial,
    # batches or streams: olproute.estimate.streamcal), the stream rows in its window and the
    # batch records read
    has_bea = st.router.policy.takes_beta and bool(st.calibrators)
    # blocks the router's prefix index holds per backend (None: it keeps none)
    blocks = st.router.prefix_index_blocks()
    out = []
    for b, load in zip(st.tracker.backends, loads, strict=True):
        out.append({
            "name": b.spec.name, "url": public_url(b.url), "model": b.spec.model,
            "served_model": b.served_model,
            "gpu": b.spec.gpu,
            "role": b.spec.role, "inbound": len(b.inbound), "handoffs": b.num_handoffs,
            "handoff_seconds": b.handoff_seconds,
            "healthy": b.healthy, "failures": b.failures, "in_flight": load.num_outstanding,
            # of which the other replicas' (olproute.server.shared), as last published
            "in_flight_other_replicas": b.remote.num_flights + b.remote.num_inbound,
            "running": load.num_running, "waiting": load.num_waiting,
            "kv_blocks_used": load.num_kv_blocks_used, "kv_blocks": load.num_kv_blocks,
            "max_num_seqs": b.spec.max_num_seqs, "scraped": b.scraped,
            "scraped_age_s": None if b.scraped_at_s is None else now - b.scraped_at_s,
            "beta": [float(x) for x in st.beta(b.index)] if has_bea else None,
            "beta_source": st.beta_sources[b.index],
            "stream_rows": {"prefill": st.stream_calibrators[b.index].num_prefill_rows,
                            "decode": st.stream_calibrators[b.index].num_decode_rows},
            "batch_records": b.batches_seen,
            "prefix_index_blocks": None if blocks is None else blocks[b.index],
            # exact: from the engine's KV events; approximate: from what the router sent
            "prefix_index": _index_mode(st, b.index),
            # what its engine says it runs with (vllm:cache_config_info), and where the
            # profile differs: the router models the engine there
            "engine_config": None if b.engine is None
            else {**b.engine.as_doc(), "mismatches": list(b.engine_mismatches)},
            "kv_events": None if not st.kv_subscribers or st.kv_subscribers[b.index] is None
            else st.kv_subscribers[b.index].status()})
    return web.json_response({"policy": st.router.policy_name, "instances": out,
                              "prediction": prediction_status(st)})


def _index_mode(st: ServerState, g: int) -> str | None:
    """``exact`` or ``approximate`` for backend g (None: the router keeps no index)."""
    index = st.router.prefixes
    if index is None:
        return None
    return "exact" if index.exact[g] else "approximate"


def public_url(url: str) -> str:
    """A backend URL as unauthenticated endpoints show it: scheme, host, port and path;
    no ``user:password@``, query string or fragment (where credentials may ride)."""
    u = urlsplit(url)
    host = u.hostname or ""
    host = f"[{host}]" if ":" in host else host
    try:
        port = u.port
    except ValueError:  # not a number: show no port rather than fail
        port = None
    return urlunsplit((u.scheme, host if port is None else f"{host}:{port}", u.path, "", ""))


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    names = [s.name for s in st.loaded.specs]
    st.metrics.set_prefix_index(names, st.router.prefix_index_blocks())
    index = st.router.prefixes
    st.metrics.set_kv_events(names, None if index is None else index.exact,
                             [None if sub is None else sub.status()
                              for sub in st.kv_subscribers])
    return web.Response(body=st.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def healthz(request: web.Request) -> web.Response:
    st = request.app[STATE]
    healthy = sum(st.tracker.healthy())
    return web.json_response({"status": "ok" if healthy else "degraded",
                              "healthy_backends": healthy,
                              "backends": len(st.tracker.backends),
                              "state": ({"mode": "in-process"} if st.shared is None
                                        else st.shared.as_dict())},
                             status=200 if healthy else 503)


async def loop_lag(request: web.Request) -> web.Response:
    """The event loop's lag over the last ``seconds`` (default 10, at most the monitor's
    memory): samples, p50, p99 and max in milliseconds."""
    st = request.app[STATE]
    raw = request.query.get("seconds", "10")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= st.lag.keep_s:
        return proxy.error_response(400, f"seconds: must be a number in (0, {st.lag.keep_s:g}]"
                                    f", got {raw[:40]!r}", param="seconds")
    summary = st.lag.summary(asyncio.get_running_loop().time() - seconds)
    return web.json_response({"period_ms": st.lag.period_s * 1e3, "window_s": seconds,
                              **asdict(summary)})


async def openapi_doc(request: web.Request) -> web.Response:
    return web.json_response(openapi())


Progress = Callable[[str], None]   # told each slow start-up step, in a few words


def _silent(step: str) -> None:
    """A ``Progress`` that says nothing (tests, embedding)."""


def say(step: str) -> None:
    """A ``Progress`` for ``olproute serve``: one line on stderr, ``olproute: <step>``."""
    print(f"olproute: {step}", file=sys.stderr, flush=True)


def _serving(message: str) -> None:
    """aiohttp's "Running on <url>" when the server listens, as a serve progress line."""
    urls = re.findall(r"https?://\S+", message)
    say(f"serving on {', '.join(urls)} (Ctrl+C stops it)" if urls else message)


GIL_SWITCH_S = 0.0005


async def _freeze_heap(app: web.Application) -> None:
    """Everything start-up made (JAX, the policy, the calibration: ~170,000 objects)
    moves out of the collector's sight: a full collection of it took 43 ms of the loop;
    after ``gc.freeze`` one takes microseconds."""
    gc.collect()
    gc.freeze()


def run_server(loaded: LoadedConfig, host: str | None = None, port: int | None = None,
               calibration: CalibrationSource | None = None,
               certifier: Certifier | None = None,
               predictor: Predictor | None = None,
               resolver: Resolver | None = None) -> None:
    """Serve on uvloop until interrupted; ``calibration``, ``certifier``, ``predictor``
    and ``resolver`` as for ``init_app``."""
    import uvloop

    server = loaded.config.server
    uvloop.install()
    # the price tick runs in a thread: while it holds the GIL the loop waits for it up
    # to the switch interval (5 ms by default) at every turn
    sys.setswitchinterval(GIL_SWITCH_S)
    app = init_app(loaded, calibration=calibration, certifier=certifier, predictor=predictor,
                   resolver=resolver, progress=say)
    app.on_startup.append(_freeze_heap)   # after the lifecycle's start-up
    # a client that leaves cancels its handler: a held request leaves the buffer, a
    # backend request in flight is closed (the backend stops generating for it)
    web.run_app(app,
                host=host or server.host,
                port=server.port if port is None else port, print=_serving,
                handler_cancellation=True)
