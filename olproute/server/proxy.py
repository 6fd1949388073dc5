"""The OpenAI-compatible proxy: decide, hold or shed, forward to the chosen backend, and
pass the answer back (server-sent events chunk by chunk when ``stream`` is true), while
the tracker follows every token.

Failures: a connect error or a 5xx before the first byte, or a stream that fails
before its first token (read before the client is answered), is retried once on the
next-best instance (the failed one is marked unhealthy and probed with backoff); a
stream cut after it ends with an error event to the client, and no ``[DONE]``
(``stream_error_event``). A request is recorded as
finished (an outcome with ``finish_s``, an end-to-end latency sample) only when its
backend's whole answer reached the client: a failure, a backend's 4xx or a client that
left is an outcome with ``finish_s=None`` (its first token kept if the client got one).

Disaggregated prefill/decode pools (a decision with a ``decode_instance``), as vLLM's
disaggregated proxy does with its NIXL connector: the prefill request (``max_tokens: 1``,
not streamed, ``kv_transfer_params: {"do_remote_decode": true}``) goes to the prefill
backend, and its one token is discarded; then the client's request, with the
``kv_transfer_params`` the prefill answer returned, goes to the decode backend, whose
answer (streamed or not) is relayed: its first token is the request's first token (TTFT,
labelled by the decode instance), its tokens the request's output. A failure of either is
not retried: the client gets a 502 naming the backend.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from olproute.policies.admission import patience_s
from olproute.routing.router import prediction_source
from olproute.server.schema import (
    BadRequest,
    ChatBody,
    CompletionBody,
    dump_json,
    error_doc,
    explanation_doc,
    parse_json,
    prediction_doc,
    prompt_ids_of,
    prompt_tokens_of,
    validate,
)
from olproute.server.state import STATE, ServerState
from olproute.server.tracker import Flight
from olproute.types import Decision, Outcome, Request

JSON_HEADERS = {"Content-Type": "application/json"}
# a client asks for the decision's explanation with x-olproute-explain: 1 (or true); it
# comes back as JSON in x-olproute-explanation, with the request's prediction. Unasked,
# nothing on the proxy path reads it (a policy may build it lazily), except the live
# certificate's capture
EXPLAIN_HEADER = "x-olproute-explain"
EXPLANATION_HEADER = "x-olproute-explanation"
_ASKED = frozenset(("1", "true"))


def decision_headers(request: web.Request, decision: Decision, req: Request,
                     max_tokens: int, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` and, when the client asked for it, the decision's explanation and the
    prediction ``req`` (of ``max_tokens`` at most) carries."""
    asked = request.headers.get(EXPLAIN_HEADER)
    if asked is not None and asked.strip().lower() in _ASKED:
        prediction = prediction_doc(req, request.app[STATE].router.models, max_tokens,
                                    prediction_source(req, given=False))
        headers[EXPLANATION_HEADER] = orjson.dumps(
            explanation_doc(decision.explanation, prediction)).decode()
    return headers


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None,
                   code: str | None = None) -> web.Response:
    """An error answer in the router's one JSON shape (``schema.error_doc``)."""
    return web.json_response(error_doc(message, kind, param, code), status=status,
                             headers=headers)


def model_not_found(model: str) -> web.Response:
    """The 404 of a ``model`` no backend serves, as OpenAI answers it."""
    return error_response(404, f"model {_ascii(model, 100)!r} is not served here (GET "
                          "/v1/models lists the models served)", param="model",
                          code="model_not_found")


async def _post(st: ServerState, g: int, path: str, body: dict[str, Any]
                ) -> tuple[aiohttp.ClientResponse | None, str | None]:
    """POST to backend ``g``: (its response, unless the connection failed; why it failed,
    if it did: a connect error, no answer within ``server.first_byte_timeout_s``, or a
    5xx), the response still unread. An answer ends the backend's failure streak."""
    limit = st.loaded.config.server.first_byte_timeout_s
    try:
        async with asyncio.timeout(limit):
            upstream = await _send(st, st.tracker.backends[g].url + path, body)
    except aiohttp.ClientError as exc:   # first: aiohttp's connect timeout is one too
        return None, f"connect: {type(exc).__name__}"
    except TimeoutError:
        return None, f"no answer within {limit:g} s (first_byte_timeout_s)"
    if upstream.status >= 500:
        return upstream, f"status {upstream.status}"
    st.tracker.mark_answered(g)
    return upstream, None

async def _send(st: ServerState, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST ``body``; one sent on a kept-alive connection the backend was closing (an
    idle one: uvicorn closes them after 5 s, and such a request was never read) is sent
    once more, on a new connection."""
    data = dump_json(body)
    try:
        return await st.session.post(url, data=data, headers=JSON_HEADERS)
    except aiohttp.ServerDisconnectedError:
        return await st.session.post(url, data=data, headers=JSON_HEADERS)


# a body larger than this is parsed in the default executor: orjson takes about a
# millisecond per 100 KiB of it, which on the loop would delay every other request
OFF_LOOP_BYTES = 256 * 1024


async def read_json(request: web.Request, limit: int, timeout_s: float) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (checked while reading, after its
    Content-Encoding is undone), 408 when the whole body has not arrived within
    ``timeout_s`` (e.g. shorter than its Content-Length); both close the connection
    (``errors.json_errors``). A body whose Content-Encoding (gzip, deflate) does not
    decode is a BadRequest. A body past ``OFF_LOOP_BYTES`` is parsed off the loop."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        raw = await _read_body(request, limit, timeout_s)
    except RequestPayloadError as exc:   # aiohttp's decoding of gzip or deflate failed
        raise BadRequest("", f"body does not decode: {_ascii(str(exc), 100)}") from None
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)
    return parse_json(raw)


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The body's bytes (``read_json``'s limits)."""
    content = request.content
    if content.is_eof():   # all of it came with the headers: no timer, no reading loop
        whole = content.read_nowait()
        if len(whole) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(whole))
        return whole
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in content.iter_chunked(65536):
                raw.extend(chunk)
                if len(raw) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the body did not arrive within {timeout_s:g} s "
                 f"({len(raw)} of {request.content_length or '?'} bytes)") from None
    return bytes(raw)


def _ttft_target_s(request: web.Request, default_ms: float) -> float:
    raw = request.headers.get("x-slo-ttft-ms")
    if raw is None:
        return default_ms / 1e3
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest("x-slo-ttft-ms",
                         f"must be a number of milliseconds, got {raw!r}") from None
    if not 0 < value <= 3_600_000:
        raise BadRequest("x-slo-ttft-ms", "must be > 0 and at most one hour")
    return value / 1e3


def _ascii(text: str, limit: int = 200) -> str:
    return text.encode("ascii", "replace").decode("ascii")[:limit]


def client_gone(request: web.Request) -> bool:
    """Has the client closed its connection?"""
    transport = request.transport
    return transport is None or transport.is_closing()


async def decide_until_dispatch(st: ServerState, req: Request, client: web.Request,
                                exclude: frozenset[int] = frozenset()) -> Decision | None:
    """The policy's decision; while it holds the request, the request waits in the
    central buffer (``olproute.server.holding``), re-scored every slot. A request the
    policy would hold when the buffer is full is refused; None when the client left
    while it was held (the policy then forgets it)."""
    d = st.decide(req, exclude)
    st.first_decision(req, d)
    if d.action != "hold":
        return d
    holding = st.holding
    assert holding is not None
    if holding.full():
        st.metrics.held_full.inc()
        return Decision(req.request_id, "shed", None,
                        f"the central buffer is full ({holding.max_held} requests held)",
                        refusal="buffer_full")
    st.metrics.held.inc()
    held: Decision | None = None
    try:
        held = await holding.wait(req, exclude, patience_s(st.loaded.config.admission, req),
                                  st.decide, lambda: client_gone(client),
                                  st.decide_held if st.router.policy.joint_release else None)
    finally:
        st.metrics.held.dec()
        # None, or cancelled (aiohttp cancels the handler of a client that leaves): its
        # client left, so nothing is to be decided for it any more
        if held is None:
            st.metrics.held_dropped.inc()
            st.forget(req.request_id)
    return held


def _tokens_in_chunk(pending: bytes, chunk: bytes) -> tuple[int, bytes]:
    """Output tokens announced by the whole lines of ``pending + chunk`` (``pending``:
    the start of a line an earlier chunk left open), and the line this one leaves open."""
    lines = (pending + chunk).split(b"\n") if pending else chunk.split(b"\n")
    rest = lines.pop()
    return sum(_tokens_in(line) for line in lines if line), rest


def _tokens_in(line: bytes) -> int:
    """Output tokens announced by one SSE line: its ``token_ids`` where the backend sends
    them (vLLM's ``return_token_ids``: an event may carry several), else 1 per chunk
    carrying text."""
    if not line.startswith(b"data:"):
        return 0
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return 0
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(chunk, dict):
        return 0
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        if ids and isinstance(ids, list):
            return len(ids)
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content"):
            return 1
    return 0


async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    server = st.loaded.config.server
    chat = request.path.endswith("/chat/completions")
    try:
        data = await read_json(request, server.max_body_bytes, server.body_timeout_s)
        body: CompletionBody | ChatBody = validate(ChatBody if chat else CompletionBody, data)
        ttft_s = _ttft_target_s(request, server.default_ttft_ms)
    except BadRequest as exc:
        return web.json_response(exc.as_json(), status=400)
    # a model the pool serves (by its profile's name or the name a backend answers to)
    # constrains the choice; any other is unknown, or with server.any_model an alias
    exclude = st.model_exclude(body.model)
    if exclude is None:
        return model_not_found(str(body.model))
    max_tokens = body.max_completion_tokens or body.max_tokens or server.default_max_tokens
    data["max_tokens"] = max_tokens  # the backend generates exactly what was accounted for
    prompt_tokens, text = prompt_tokens_of(body)
    # a chat's messages, for the backends that name its blocks as their engine does
    messages = ([m.model_dump(exclude_none=True) for m in body.messages]
                if isinstance(body, ChatBody) and any(st.router.namers) else None)
    # the instances whose engines would refuse it as too long (a prompt's words are
    # at most its tokens): none left is a 400, never a wait
    unfit = st.router.too_long(prompt_tokens, max_tokens)
    if unfit | exclude == frozenset(range(len(st.router.specs))):
        st.metrics.refused.labels("context").inc()
        return never_servable(st, prompt_tokens, max_tokens, exclude)
    exclude |= unfit
    req = st.router.new_request(st.now(), prompt_tokens, max_tokens, ttft_s,
                                request.headers.get("x-slo-class", "default"), text,
                                prompt_ids=prompt_ids_of(body), chat=messages)
    decision = await decide_until_dispatch(st, req, request, exclude)
    if decision is None:   # the client left while its request was held: nobody reads this
        return web.Response(status=499)
    if decision.action == "shed":   # load only: a request nothing could serve is a 400
        st.observe(_outcome(req, None, None, None, None, 0))
        refusal = decision.refusal or "patience"
        st.metrics.refused.labels(refusal).inc()
        return error_response(429, f"request refused: {decision.reason}", kind="rate_limited",
                              code=refusal,
                              headers=decision_headers(request, decision, req, max_tokens, {
                                  "Retry-After": str(server.retry_after_s),
                                  "x-olproute-reason": _ascii(decision.reason)}))
    if decision.decode_instance is not None:
        return await _forward_pair(request, st, req, decision, data, body.stream)
    return await _forward(request, st, req, decision, data, body.stream, exclude)


def never_servable(st: ServerState, prompt_tokens: int, max_tokens: int,
                   exclude: frozenset[int]) -> web.Response:
    """The 400 of a request no instance (of those serving its model) could ever hold, as
    vLLM answers a prompt past its context: naming ``prompt`` when the prompt alone
    leaves no room for output, else ``max_tokens``."""
    limits = st.router.context_limits
    limit = max(limits[g] for g in range(len(limits)) if g not in exclude)
    if prompt_tokens + 1 > limit:
        return error_response(400, f"the prompt has at least {prompt_tokens} tokens; the "
                              f"most any instance holds is {limit} tokens, prompt and "
                              "output (its model's context, its KV cache)", param="prompt",
                              code="context_length_exceeded")
    return error_response(400, f"the most any instance holds is {limit} tokens; "
                          f"{prompt_tokens} prompt + {max_tokens} requested tokens exceed "
                          "it", param="max_tokens", code="context_length_exceeded")


async def _forward(request: web.Request, st: ServerState, req: Request, decision: Decision,
                   data: dict[str, Any], stream: bool,
                   exclude: frozenset[int]) -> web.StreamResponse:
    tried: set[int] = set()
    while True:
        g = decision.instance
        assert g is not None
        backend = st.tracker.backends[g]
        data["model"] = backend.served_model  # the name the backend answers to
        now = st.now()
        # the prefix index: where its prompt went, and what of it the index expects
        # cached there (the tracker's snapshots count it computed while it waits)
        cached = st.router.routed(g, req)
        st.tracker.dispatched(g, req, now, streamed=stream, cached_tokens=cached)
        try:
            upstream, head, failure, kind = await _attempt(st, g, req, request.path, data,
                                                           stream)
        except asyncio.CancelledError:   # the client left before the backend answered
            st.tracker.finished(g, req.request_id)
            st.observe(_outcome(req, g, now, None, None, 0))
            raise
        if failure is None:
            break
        if upstream is not None:
            upstream.close()   # a stream that stalled: the backend stops generating it
        st.tracker.finished(g, req.request_id)
        st.mark_failure(g)
        st.metrics.errors.labels(backend.spec.name, kind).inc()
        tried.add(g)
        if len(tried) > 1:
            st.observe(_outcome(req, g, now, None, None, 0))
            return error_response(502, f"backends failed: {failure}", kind="backend_error")
        retry = await decide_until_dispatch(st, req, request, exclude | frozenset(tried))
        if retry is None:
            return web.Response(status=499)
        decision = retry
        if decision.action != "dispatch":
            st.observe(_outcome(req, None, None, None, None, 0))
            return error_response(503, f"backend {backend.spec.name} failed ({failure}), "
                                  f"and no other: {decision.reason}", kind="backend_error")
    assert upstream is not None
    headers = decision_headers(request, decision, req, data["max_tokens"], {
        "x-olproute-instance": backend.spec.name, "x-olproute-reason": _ascii(decision.reason)})
    completed = False
    try:
        resp, completed = await _relay(request, st, g, req, upstream, headers, head)
        return resp
    finally:
        upstream.release()
        flight = st.tracker.finished(g, req.request_id)
        if flight is not None:
            _record(st, req, g, None, flight, completed)


async def _attempt(st: ServerState, g: int, req: Request, path: str, data: dict[str, Any],
                   stream: bool
                   ) -> tuple[aiohttp.ClientResponse | None, _Head | None, str | None, str]:
    """Send the request to backend ``g`` and, for a stream it answers with a 200, read it
    up to its first token (nothing reaches the client before, so a failure until then
    may be retried elsewhere): (the response, the stream's head, why it failed if it
    did, the failure's kind for ``olproute_backend_errors_total``). Cancelled (the
    client left), it closes the backend's response."""
    upstream, failure = await _post(st, g, path, data)
    if failure is not None or not stream or upstream is None or upstream.status != 200:
        return upstream, None, failure, "before_first_byte"
    try:
        return upstream, await _read_head(st, g, req, upstream), None, ""
    except (TimeoutError, aiohttp.ClientError, _Stalled) as exc:
        why = str(exc) if isinstance(exc, _Stalled) else type(exc).__name__
        return upstream, None, f"stream ended before its first token: {why}", \
            "before_first_token"
    except asyncio.CancelledError:
        upstream.close()
        raise


@dataclass(slots=True)
class _Head:
    """What a backend's stream sent up to its first token (or its end, if it had none),
    not yet relayed: its chunks and the line they leave open."""

    chunks: list[bytes]
    pending: bytes
    ended: bool   # the stream ended, cleanly, before any token


async def _read_head(st: ServerState, g: int, req: Request,
                     upstream: aiohttp.ClientResponse) -> _Head:
    """Read a stream up to the chunk carrying its first token (counted), or its end: its
    first chunk within ``server.first_byte_timeout_s``, each next within
    ``read_timeout_s``; a backend that sends none in time raises _Stalled."""
    server = st.loaded.config.server
    limit = server.first_byte_timeout_s
    chunks: list[bytes] = []
    pending = b""
    while True:
        try:
            async with asyncio.timeout(limit):
                chunk = await upstream.content.readany()
        except TimeoutError:
            raise _Stalled(limit) from None
        if not chunk:
            return _Head(chunks, pending, ended=True)
        limit = server.read_timeout_s
        chunks.append(chunk)
        n, pending = _tokens_in_chunk(pending, chunk)
        if n:
            st.tracker.token(g, req.request_id, st.now(), n)
            return _Head(chunks, pending, ended=False)


def _record(st: ServerState, req: Request, g: int, decode_instance: int | None,
            flight: Flight, completed: bool) -> None:
    """Feed back to the policy the outcome of a request whose tokens ``flight`` followed
    on backend ``g`` (on pools: ``g`` its prefill backend, ``flight`` its decode on
    ``decode_instance``); sample its TTFT if the client got a first token, and its
    end-to-end latency if ``completed`` (its whole answer reached the client)."""
    name = st.loaded.specs[g if decode_instance is None else decode_instance].name
    end = st.now() if completed else None
    first = flight.first_token_s
    dispatch = flight.dispatch_s if flight.origin is None else flight.origin.dispatch_s
    st.observe(_outcome(req, g, dispatch, first, end, flight.tokens, decode_instance))
    if first is not None:
        st.metrics.latency(name, first - req.arrival_s,
                           None if end is None else end - req.arrival_s)


async def _relay(request: web.Request, st: ServerState, g: int, req: Request,
                 upstream: aiohttp.ClientResponse, headers: dict[str, str],
                 head: _Head | None) -> tuple[web.StreamResponse, bool]:
    """Relay a backend's answer: chunk by chunk when it streams a 200 (``head``: what it
    sent up to its first token, read already), else whole; (the client's response,
    whether the answer completed)."""
    if head is not None:
        return await _relay_stream(request, st, g, req, upstream, headers, head)
    return await _relay_whole(st, g, req, upstream, headers)


async def _relay_stream(request: web.Request, st: ServerState, g: int, req: Request,
                        upstream: aiohttp.ClientResponse, headers: dict[str, str],
                        head: _Head) -> tuple[web.StreamResponse, bool]:
    """Relay the backend's stream: its ``head`` at once, then chunk by chunk as it
    arrives (one write for the lines of a chunk, counting the tokens they announce);
    (the response, True if the backend's stream ended cleanly and all of it went to the
    client). A client that leaves stops the relay without blaming the backend; a
    backend stream that fails marks it, and the client's stream ends with an error
    event (``stream_error_event``)."""
    resp = web.StreamResponse(status=200, headers={
        **headers, "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache"})
    await resp.prepare(request)
    limit = st.loaded.config.server.read_timeout_s
    pending = head.pending   # the start of a line the next chunk ends
    chunk = b"".join(head.chunks)
    try:
        while chunk:
            try:
                await resp.write(chunk)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                # the client went away: not the backend's fault; stop its generation
                upstream.close()
                return resp, False
            if head.ended:
                break
            try:
                async with asyncio.timeout(limit):
                    chunk = await upstream.content.readany()
            except TimeoutError:
                raise _Stalled(limit) from None
            n, pending = _tokens_in_chunk(pending, chunk)
            if n:
                st.tracker.token(g, req.request_id, st.now(), n)
    except (TimeoutError, aiohttp.ClientError, _Stalled) as exc:
        st.mark_failure(g)
        kind = "stalled" if isinstance(exc, _Stalled) else "mid_stream"
        st.metrics.errors.labels(st.loaded.specs[g].name, kind).inc()
        why = str(exc) if isinstance(exc, _Stalled) else type(exc).__name__
        try:
            await resp.write(stream_error_event(f"backend stream ended early: {why}"))
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return resp, False
    if _tokens_in(pending):   # a last line without its newline
        st.tracker.token(g, req.request_id, st.now(), 1)
    try:
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return resp, False
    return resp, True


async def _relay_whole(st: ServerState, g: int, req: Request,
                       upstream: aiohttp.ClientResponse,
                       headers: dict[str, str]) -> tuple[web.Response, bool]:
    """Relay the backend's whole answer; (the response, True if it is a 200 answer read
    whole). A body that fails to arrive (within ``server.read_timeout_s``) is a 502 and
    marks the backend."""
    try:
        async with asyncio.timeout(st.loaded.config.server.read_timeout_s):
            raw = await upstream.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        st.mark_failure(g)
        name = st.loaded.specs[g].name
        st.metrics.errors.labels(name, "mid_stream").inc()
        return error_response(502, f"backend {name} failed mid-answer: "
                              f"{type(exc).__name__}", kind="backend_error",
                              headers=headers), False
    if upstream.status == 200:
        try:
            usage = orjson.loads(raw).get("usage") or {}
            tokens = int(usage.get("completion_tokens", 0))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            tokens = 0
        if tokens:
            st.tracker.token(g, req.request_id, st.now(), tokens)
    return web.Response(body=raw, status=upstream.status, headers={
        **headers, "Content-Type": upstream.headers.get("Content-Type", "application/json")}
    ), upstream.status == 200


def stream_error_event(message: str) -> bytes:
    """The event that ends a stream cut short, as OpenAI ends one: a ``data:`` event
    whose JSON is the router's error shape, and no ``[DONE]`` after it (the ``openai``
    client raises ``APIError`` on an event with an ``error`` key)."""
    return b"data: " + orjson.dumps(error_doc(message, "backend_error")) + b"\n\n"


class _Stalled(Exception):
    """A backend stream sent no chunk within the limit."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"no chunk within {limit_s:g} s")


def _outcome(req: Request, g: int | None, dispatch: float | None, first: float | None,
             finish: float | None, tokens: int, decode_instance: int | None = None) -> Outcome:
    return Outcome(request_id=req.request_id, instance=g, arrival_s=req.arrival_s,
                   dispatch_s=dispatch, first_token_s=first,
                   finish_s=finish if first is not None else None,
                   prompt_tokens=req.prompt_tokens, decode_tokens=tokens,
                   predicted_decode_tokens=req.predicted_decode_tokens,
                   decode_instance=decode_instance)


# -- disaggregated prefill/decode -------------------------------------------------------------
# what vLLM's disaggregated proxy sends its prefill instance (NIXL connector)
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(data: dict[str, Any], model: str) -> dict[str, Any]:
    """The prefill request: the client's body for one token, not streamed, asking the
    prefill backend to keep the KV cache for a remote decode."""
    body = {k: v for k, v in data.items() if k not in ("stream", "stream_options")}
    body.update(model=model, max_tokens=1, stream=False,
                kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def decode_kv_params(answer: Any, prefill_name: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` for the decode request: those the prefill answer
    returned, else a remote prefill from the prefill backend named ``prefill_name``."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if isinstance(params, dict) and params:
        return params
    return {"do_remote_prefill": True, "remote_engine_id": prefill_name}


def decode_body(data: dict[str, Any], model: str, kv_params: dict[str, Any]) -> dict[str, Any]:
    """The decode request: the client's body (its ``max_tokens``, ``stream``) with the
    KV transfer parameters."""
    return {**data, "model": model, "kv_transfer_params": kv_params}


class _Failed(Exception):
    """A backend of a disaggregated pair failed; ``response`` is the client's answer."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


async def _prefill(st: ServerState, p: int, path: str, body: dict[str, Any],
                   headers: dict[str, str]) -> Any:
    """Post the prefill request and return its answer's JSON; raises _Failed with the
    client's response (the backend's own 4xx, else a 502 naming it)."""
    backend = st.tracker.backends[p]
    name = backend.spec.name
    limit = st.loaded.config.server.first_byte_timeout_s
    try:
        async with asyncio.timeout(limit):
            upstream = await _send(st, backend.url + path, body)
            async with upstream:
                raw = await upstream.read()
                status = upstream.status
                ctype = upstream.headers.get("Content-Type", "application/json")
    except aiohttp.ClientError as exc:   # first: aiohttp's connect timeout is one too
        status, raw, ctype = 0, f"connect: {type(exc).__name__}".encode(), ""
    except TimeoutError:
        status, raw, ctype = 0, f"no answer within {limit:g} s".encode(), ""
    if 400 <= status < 500:
        raise _Failed(web.Response(body=raw, status=status,
                                   headers={**headers, "Content-Type": ctype}))
    answer: Any = None
    if status == 200:
        try:
            answer = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            status, raw = -1, b"an answer that is not JSON"
    if status != 200:
        failure = raw.decode(errors="replace") if status <= 0 else f"status {status}"
        st.mark_failure(p)
        st.metrics.errors.labels(name, "prefill").inc()
        raise _Failed(error_response(502, f"prefill backend {name} failed: {failure}",
                                     kind="backend_error", headers=headers))
    st.tracker.mark_answered(p)
    return answer


async def _forward_pair(request: web.Request, st: ServerState, req: Request,
                        decision: Decision, data: dict[str, Any],
                        stream: bool) -> web.StreamResponse:
    """Prefill on the decision's instance, then decode on its decode instance; the
    tracker's bookkeeping of both is released however it ends."""
    p, q = decision.instance, decision.decode_instance
    assert p is not None and q is not None
    bp, bq = st.tracker.backends[p], st.tracker.backends[q]
    headers = decision_headers(request, decision, req, data["max_tokens"], {
        "x-olproute-instance": bp.spec.name, "x-olproute-decode-instance": bq.spec.name,
        "x-olproute-reason": _ascii(decision.reason)})
    rid = req.request_id
    dispatch = st.now()
    completed = False
    st.tracker.dispatched_pair(p, q, req, dispatch)
    st.router.routed(p, req)   # its prefill backend computes (and caches) the prompt
    try:
        answer = await _prefill(st, p, request.path, prefill_body(data, bp.served_model),
                                headers)
        st.tracker.prefilled(p, q, rid, st.now())
        body = decode_body(data, bq.served_model, decode_kv_params(answer, bp.spec.name))
        st.tracker.decode_sent(q, rid, st.now(), stream)
        upstream, head, failure, kind = await _attempt(st, q, req, request.path, body,
                                                       stream)
        try:
            if failure is not None:
                st.mark_failure(q)
                st.metrics.errors.labels(bq.spec.name, kind).inc()
                return error_response(502, f"decode backend {bq.spec.name} failed after the "
                                      f"prefill on {bp.spec.name}: {failure}",
                                      kind="backend_error", headers=headers)
            assert upstream is not None
            resp, completed = await _relay(request, st, q, req, upstream, headers, head)
            return resp
        finally:
            if upstream is not None:
                upstream.release()
    except _Failed as failed:
        return failed.response
    finally:
        _, decode, handoff = st.tracker.released_pair(p, q, rid)
        if decode is not None:
            _record(st, req, p, q, decode, completed)
        else:  # the decode never started: no token reached the client
            st.observe(_outcome(req, p, dispatch, None, None, 0, q))
        if handoff is not None and handoff.handoff_s is not None:
            st.metrics.handoff_seconds.labels(bq.spec.name).observe(handoff.handoff_s)
