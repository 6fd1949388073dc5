"""A router and scriptable fake backends on 127.0.0.1 free ports, run in a background
thread's event loop so that tests (and hypothesis) can talk plain synchronous HTTP.

The fake backend speaks just enough OpenAI: completions and chat completions, streamed
one chunk per token after ``delay_s`` each, or whole; ``/health``; ``/metrics`` with the
vLLM gauge names. Its ``mode`` scripts failures: ``ok``, ``fail500`` (5xx before the
first byte), ``fail400`` (the backend refuses the request), ``cut`` (drops the
connection after ``cut_after`` chunks), ``drop_once`` (closes the connection of its first
request without an answer), ``hang`` (never answers, though ``/health``
does), ``stall`` (streams ``cut_after`` chunks, then nothing while keeping the connection
open). ``cancelled`` counts the requests whose handler was cancelled (the router closed
the connection) before the fake answered or finished. ``extra`` is merged into its whole
(non-streamed) answers (e.g. a prefill's ``kv_transfer_params``). A stream with ``hold``
set stops after ``hold_after`` chunks until the test sets it (``Stack.release``).
With ``preamble`` set a stream starts with a chunk carrying no token (a chat's role
delta, as vLLM sends it; a completion's empty text), so that ``cut`` with ``cut_after``
0 answers 200 and drops the connection before the first token. ``client_gone`` counts
the streams its client (the router) closed before their end.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from olproute.config.loader import LoadedConfig
from olproute.server import init_app
from olproute.server.certify import Certifier
from olproute.server.resolved import Resolver
from olproute.server.state import STATE as ROUTER_STATE
from olproute.sim.scenario import CalibrationSource
from olproute.types import Outcome
from tests.conftest import HANG_S

FAKE = web.AppKey("fake", dict)


@dataclass
class FakeState:
    mode: str = "ok"
    delay_s: float = 0.01
    cut_after: int = 2
    requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    client_gone: int = 0
    cancelled: int = 0
    hold: asyncio.Event | None = None
    hold_after: int = 1
    gauges: bool = True   # False: /metrics without vLLM's gauges (--disable-log-stats)
    prefix_queries: float | None = None   # vllm:prefix_cache_queries_total, when set
    cache_config: dict[str, str] | None = None   # vllm:cache_config_info's labels, when set
    preamble: bool = False   # a stream's first chunk carries no token


STATE = web.AppKey("fake_state", FakeState)


async def _complete(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await request.json()
    st.requests += 1
    st.bodies.append(body)
    if st.mode == "drop_once" and st.requests == 1:
        # closes the connection without an answer, as a server closing an idle kept-alive
        # connection while the request was on its way
        assert request.transport is not None
        request.transport.close()
        return web.Response()
    if st.mode == "fail500":
        return web.json_response({"error": "boom"}, status=500)
    if st.mode == "fail400":
        return web.json_response({"error": {"message": "no", "param": "prompt"}}, status=400)
    if st.mode == "hang":
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            st.cancelled += 1
            raise
    n = int(body.get("max_tokens", 4))
    chat = request.path.endswith("chat/completions")
    if not body.get("stream"):
        await asyncio.sleep(st.delay_s * n)
        text = " ".join(["tok"] * n)
        choice = ({"message": {"role": "assistant", "content": text}} if chat
                  else {"text": text})
        return web.json_response({"id": "x", "object": "text_completion", "model": "fake",
                                  "choices": [{"index": 0, **choice, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                            "total_tokens": n + 1}, **st.extra})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        return await _stream(request, resp, st, n, chat)
    except (ConnectionResetError, asyncio.CancelledError):
        st.client_gone += 1  # a write to a closed connection, or the handler cancelled
        raise


async def _stream(request: web.Request, resp: web.StreamResponse, st: FakeState, n: int,
                  chat: bool) -> web.StreamResponse:
    if st.preamble:
        await resp.write(f"data: {json.dumps(_chunk(chat, '', role=True))}\n\n".encode())
    for i in range(n):
        if st.hold is not None and i == st.hold_after:
            await st.hold.wait()
        await asyncio.sleep(st.delay_s)
        if st.mode == "cut" and i == st.cut_after:
            assert request.transport is not None
            request.transport.close()
            return resp
        if st.mode == "stall" and i == st.cut_after:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                st.cancelled += 1
                raise
        await resp.write(f"data: {json.dumps(_chunk(chat, 'tok '))}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chunk(chat: bool, text: str, role: bool = False) -> dict[str, Any]:
    """One streamed chunk of ``text`` (a chat's with the assistant's role if ``role``)."""
    if chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return {"id": "x", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    if not request.app[STATE].gauges:
        return web.Response(text="# TYPE python_info gauge\npython_info 1.0\n",
                            content_type="text/plain")
    text = ("# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="fake"} 0.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="fake"} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="fake"} 0.0\n')
    queries = request.app[STATE].prefix_queries
    if queries is not None:
        text += ("# TYPE vllm:prefix_cache_queries counter\n"
                 f'vllm:prefix_cache_queries_total{{model_name="fake"}} {queries}\n')
    config = request.app[STATE].cache_config
    if config is not None:
        labels = ",".join(f'{k}="{v}"' for k, v in config.items())
        text += f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{labels}}} 1.0\n"
    return web.Response(text=text, content_type="text/plain")


def fake_backend_app(state: FakeState) -> web.Application:
    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    # as olproute serve runs: a client that leaves cancels its handler
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


class Stack:
    """Fake backends (or given URLs) and a router, in a background event loop."""

    def __init__(self, loaded: LoadedConfig, num_fakes: int,
                 calibration: CalibrationSource | None = None,
                 backend_urls: list[str] | None = None,
                 certifier: Certifier | None = None,
                 resolver: Resolver | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.fakes = [FakeState() for _ in range(num_fakes)]
        self._fake_runners: list[web.AppRunner | None] = []
        self.fake_urls: list[str] = []
        for st in self.fakes:
            runner, url = self.run(_serve(fake_backend_app(st)))
            self._fake_runners.append(runner)
            self.fake_urls.append(url)
        urls = backend_urls if backend_urls is not None else self.fake_urls
        self.app = init_app(loaded, backend_urls=urls or None, calibration=calibration,
                            certifier=certifier, resolver=resolver)
        self._runner, self.url = self.run(_serve(self.app), timeout=120)
        self._router_stopped = False

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = HANG_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrap() -> Any:
            return fn()
        return self.run(wrap())

    def release(self, event: asyncio.Event) -> None:
        """Set an event that the stack's loop waits on (a fake's ``hold``)."""
        self.loop.call_soon_threadsafe(event.set)

    def num_connections(self) -> int:
        """Connections open on the router's side."""
        server = self._runner.server
        assert server is not None
        return int(self.call(lambda: len(server.connections)))

    def kill_backend(self, i: int) -> None:
        runner = self._fake_runners[i]
        if runner is not None:
            self.run(runner.cleanup())
            self._fake_runners[i] = None

    def stop_router(self) -> None:
        """Stop the router only (its backends go on)."""
        if not self._router_stopped:
            self._router_stopped = True
            self.run(self._runner.cleanup())

    def close(self) -> None:
        try:
            self.stop_router()
            for i in range(len(self._fake_runners)):
                self.kill_backend(i)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


def record_outcomes(stack: Stack) -> list[Outcome]:
    """A list the router's outcomes are appended to (as the policy gets them) from now."""
    outcomes: list[Outcome] = []
    router = stack.app[ROUTER_STATE].router
    observe = router.observe

    def recording(outcome: Outcome) -> None:
        outcomes.append(outcome)
        observe(outcome)

    stack.call(lambda: setattr(router, "observe", recording))
    return outcomes


def wait_until(cond: Callable[[], bool], timeout: float = HANG_S, step: float = 0.05) -> bool:
    """Poll ``cond`` until it holds; ``timeout`` (real seconds) only catches a hang, so it
    is generous: a loaded machine may take many times the usual time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()
