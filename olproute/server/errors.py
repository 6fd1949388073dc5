"""One error shape for every answer of the router that is not a success, OpenAI's:
``{"error": {"message", "type", "param", "code"}}``. The handlers answer their own errors in it
(:func:`olproute.server.proxy.error_response`); :func:`json_errors` puts in it what
aiohttp would answer in plain text — 404, 405, 413 (body too large), 408 (body too
slow) — and an unexpected exception (500, logged with its traceback).

Errors aiohttp's HTTP parser answers before the application sees a request (a malformed
request line or header) stay aiohttp's plain-text 400.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from olproute.server.proxy import error_response

LOG = logging.getLogger("olproute.server")

# an answer to these leaves the request's body unread (partly sent, or too large): the
# connection cannot carry another request (a 413's is closed once aiohttp has read and
# dropped the rest of the body, or after 10 s, so the client sees the answer)
CLOSE_AFTER = (408, 413)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # a redirect, not an error
        resp = _from_http(request, exc)
        if exc.status == 408:
            # the client stopped sending: answer and close now, not after aiohttp's
            # lingering wait (up to 10 s) for the rest of the body
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()
        return resp
    except Exception:
        if request.writer.output_size > 0:
            raise  # an answer already started: too late to send another
        LOG.exception("error handling %s %s", request.method, request.path)
        return error_response(500, "internal error (logged by the router)",
                              kind="server_error")


def _from_http(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status in (404, 405):
        message = f"{exc.reason}: {request.method} {request.path[:200]}"
    else:
        message = exc.text or exc.reason
    # keep what the exception says beyond its body (Allow on a 405)
    headers = {k: v for k, v in exc.headers.items()
               if k.lower() not in ("content-type", "content-length")}
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    resp = error_response(exc.status, message, kind=kind, headers=headers)
    if exc.status in CLOSE_AFTER:
        resp.force_close()
    return resp
