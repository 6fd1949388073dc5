"""The OpenAI-compatible wire format of the emulator: request parsing and validation,
response and stream-chunk bodies, errors. Pure functions, no I/O.

What the emulator generates: as many tokens as its model would before its EOS, at most
``max_tokens`` (``olproute.emulator.lengths``; with exact lengths, all ``max_tokens``);
``finish_reason`` is ``"length"`` when that is ``max_tokens``, else ``"stop"``. Token i
is the filler word ``FILLER[i % len(FILLER)]`` preceded by a space. Prompt tokens are
counted simply: the number of whitespace-separated words of a string prompt (of every
message's text for chat), the length of a token-id list, or the extension field
``prompt_tokens`` when given. A chat's prompt text is its messages' texts (a list of
content parts: their texts joined by a space) joined by a newline, roles left out: the
words the router counts and hashes for the same body
(``olproute.server.schema.prompt_tokens_of``), so both name its blocks alike.

With ``cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``), a response's usage
reports the prompt tokens found in the prefix cache as
``usage.prompt_tokens_details.cached_tokens``, when there are any, as vLLM does.

Disaggregated prefill/decode (vLLM's NIXL connector): ``kv_transfer_params`` with
``do_remote_decode`` asks a prefill instance to keep the KV cache for a decode instance
(its answer carries ``kv_transfer_params`` for the decode request, ``prefill_kv_params``);
with ``do_remote_prefill`` a decode instance takes the prompt's KV cache from a prefill
instance instead of computing it (all but the last token: ``olproute.routing.disagg``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
          "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et")
DEFAULT_MAX_TOKENS = 16

Kind = Literal["completion", "chat"]


class ApiError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None}}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request."""

    kind: Kind
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    remote_decode: bool = False         # kv_transfer_params.do_remote_decode
    remote_prefill: bool = False        # kv_transfer_params.do_remote_prefill
    remote_engine_id: str | None = None  # the prefill instance the KV comes from
    prompt_text: str | None = None      # what its prompt tokens are the words of
    prompt_ids: tuple[int, ...] | None = None   # or its token ids, when given as ids


def token_text(index: int) -> str:
    """Text of the index-th generated token (0-based)."""
    return " " + FILLER[index % len(FILLER)]


def generated_text(num_tokens: int) -> str:
    return "".join(token_text(i) for i in range(num_tokens))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_prompt(prompt: object) -> tuple[int, str | None, tuple[int, ...] | None]:
    """(prompt tokens, text, token ids) of a completion ``prompt`` (one prompt only:
    text, or token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return len(prompt.split()), prompt, None
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return len(prompt), None, tuple(prompt)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per "
                        "request)", "prompt")


def _message_text(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text", ""), str)):
                raise ApiError(400, f"messages[{i}].content parts must be objects with a "
                                    "text field", f"messages[{i}].content")
            parts.append(part.get("text", ""))
        return " ".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of parts",
                   f"messages[{i}].content")


def _count_messages(messages: object) -> tuple[int, str]:
    """(prompt tokens, text) of a chat's ``messages``: the words of their texts joined
    by a newline."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    texts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role",
                           f"messages[{i}]")
        texts.append(_message_text(m.get("content"), i))
    text = "\n".join(texts)
    return len(text.split()), text


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def parse_request(body: dict[str, Any], kind: Kind, served_model: str,
                  max_model_len: int) -> GenerationRequest:
    """Validate a request body; raises ApiError (400, or 404 for an unknown model)."""
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model",
                       "NotFoundError")
    field = "prompt" if kind == "completion" else "messages"
    if field not in body:
        raise ApiError(400, f"{field} is required", field)
    counted, text, ids = (_count_prompt(body[field]) if kind == "completion"
                          else (*_count_messages(body[field]), None))
    prompt_tokens = body.get("prompt_tokens", counted)
    if not _is_int(prompt_tokens) or prompt_tokens < 1:
        param = "prompt_tokens" if "prompt_tokens" in body else field
        raise ApiError(400, f"{param} must have at least one token", param)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ApiError(400, f"{key} must be an integer >= 1, got {max_tokens!r}", key)
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options can only be given when stream is true",
                           "stream_options")
        if not isinstance(options, dict) or not isinstance(
                options.get("include_usage", False), bool):
            raise ApiError(400, "stream_options.include_usage must be a boolean",
                           "stream_options")
        include_usage = bool(options.get("include_usage", False))
    if prompt_tokens + 1 > max_model_len:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens, more than this "
                            f"instance's maximum length of {max_model_len - 1} (KV cache "
                            "and context limit, one token left for output)", field)
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"this instance's maximum length is {max_model_len} tokens; "
                            f"{prompt_tokens} prompt + {max_tokens} requested tokens exceed "
                            f"it", key)
    remote_decode, remote_prefill, remote_engine_id = _kv_transfer(
        body.get("kv_transfer_params"))
    return GenerationRequest(kind, model, prompt_tokens, max_tokens, stream, include_usage,
                             remote_decode, remote_prefill, remote_engine_id, text, ids)


def _kv_transfer(params: object) -> tuple[bool, bool, str | None]:
    """(do_remote_decode, do_remote_prefill, remote_engine_id) of ``kv_transfer_params``."""
    if params is None:
        return False, False, None
    if not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    flags = []
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = params.get(key)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"kv_transfer_params.{key} must be a boolean",
                           f"kv_transfer_params.{key}")
        flags.append(bool(value))
    if all(flags):
        raise ApiError(400, "kv_transfer_params: do_remote_decode and do_remote_prefill "
                            "cannot both be true", "kv_transfer_params")
    engine = params.get("remote_engine_id")
    if engine is not None and not isinstance(engine, str):
        raise ApiError(400, "kv_transfer_params.remote_engine_id must be a string",
                       "kv_transfer_params.remote_engine_id")
    return flags[0], flags[1], engine


def check_role(req: GenerationRequest, role: str) -> None:
    """A prefill instance does not take a remote prefill, a decode instance does not
    prefill for a remote decode, and a prefill kept for a remote decode is answered
    whole (its ``kv_transfer_params`` ride on the response body)."""
    if req.remote_prefill and role == "prefill":
        raise ApiError(400, "kv_transfer_params.do_remote_prefill: this is a prefill "
                            "instance; send the decode request to a decode instance",
                       "kv_transfer_params.do_remote_prefill")
    if req.remote_decode and role == "decode":
        raise ApiError(400, "kv_transfer_params.do_remote_decode: this is a decode "
                            "instance; send the prefill request to a prefill instance",
                       "kv_transfer_params.do_remote_decode")
    if req.remote_decode and req.stream:
        raise ApiError(400, "kv_transfer_params.do_remote_decode needs a non-streamed "
                            "request (the answer carries the KV transfer parameters)",
                       "stream")


def prefill_kv_params(engine_id: str, host: str | None, port: int | None,
                      prompt_tokens: int, block_size: int, tp_size: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill instance returns for the decode request,
    shaped like vLLM's NIXL connector's: where the prompt's KV blocks are (the block ids
    are the request's blocks numbered from 0, the emulator having no real ones)."""
    num_blocks = -(-prompt_tokens // block_size)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_block_ids": list(range(num_blocks)),
            "remote_host": host, "remote_port": port, "tp_size": tp_size}


# -- bodies -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with ``cached_tokens`` > 0, vLLM's
    ``prompt_tokens_details.cached_tokens`` too (the caller passes it only where vLLM
    would report it: ``--enable-prompt-tokens-details``)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def finish_reason(req: GenerationRequest, num_tokens: int) -> str:
    """``"length"`` for a request that generated all its ``max_tokens``, else ``"stop"``
    (it stopped at its EOS first)."""
    return "length" if num_tokens >= req.max_tokens else "stop"


def response_body(req: GenerationRequest, request_id: str, created: int,
                  num_tokens: int,
                  kv_transfer_params: dict[str, Any] | None = None,
                  cached_tokens: int | None = None) -> dict[str, Any]:
    """The non-streaming response of a request that generated ``num_tokens``: the whole
    text, ``finish_reason`` and ``usage`` (and ``kv_transfer_params`` when given: a
    prefill for a remote decode; ``cached_tokens``: as ``usage`` takes them)."""
    text = generated_text(num_tokens)
    reason = finish_reason(req, num_tokens)
    choice: dict[str, Any]
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    body = {"id": request_id, "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage(req.prompt_tokens, num_tokens, cached_tokens)}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


class ChunkWriter:
    """Server-sent-event bytes of a stream of ``num_tokens`` tokens (default: all
    ``max_tokens``): one ``data:`` event per token, the last one with ``finish_reason``, a
    usage event if asked, then ``data: [DONE]``.

    The JSON frame of a chunk is serialised once per request and each token's text once
    per process, so a token costs a few byte concatenations (``chunk_dict`` is the same
    chunk as a dict, for reference)."""

    def __init__(self, req: GenerationRequest, request_id: str,
                 num_tokens: int | None = None) -> None:
        self.req = req
        self.num_tokens = req.max_tokens if num_tokens is None else num_tokens
        self._reason = finish_reason(req, self.num_tokens)
        chat = req.kind == "chat"
        self._head = {"id": request_id,
                      "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": int(time.time()), "model": req.model}
        self._prefix = (b"data: " + _dumps(self._head)[:-1] + b',"choices":[{"index":0,'
                        + (b'"delta":{' if chat else b'"text":'))
        self._suffix = b"}]" + (b',"usage":null' if req.include_usage else b"") + b"}\n\n"

    def chunk_dict(self, index: int) -> dict[str, Any]:
        last = index == self.num_tokens - 1
        choice: dict[str, Any] = {"index": 0}
        if self.req.kind == "chat":
            # the role rides on the first token's delta, so that chunks == tokens
            choice["delta"] = ({"role": "assistant", "content": token_text(index)}
                               if index == 0 else {"content": token_text(index)})
        else:
            choice["text"] = token_text(index)
        choice["logprobs"] = None
        choice["finish_reason"] = self._reason if last else None
        usage_null = {"usage": None} if self.req.include_usage else {}
        return {**self._head, "choices": [choice], **usage_null}

    def token(self, index: int) -> bytes:
        text = _TOKEN_JSON[index % len(FILLER)]
        if self.req.kind == "chat":
            text = (b'"role":"assistant","content":' if index == 0 else b'"content":') \
                + text + b"}"
        reason = (b'"' + self._reason.encode() + b'"' if index == self.num_tokens - 1
                  else b"null")
        return (self._prefix + text + b',"logprobs":null,"finish_reason":' + reason
                + self._suffix)

    def end(self, num_tokens: int, cached_tokens: int | None = None) -> bytes:
        """The usage event if asked (``cached_tokens`` as ``usage`` takes them), then
        ``[DONE]``."""
        tail = b""
        if self.req.include_usage:
            tail = _event({**self._head, "choices": [],
                           "usage": usage(self.req.prompt_tokens, num_tokens, cached_tokens)})
        return tail + b"data: [DONE]\n\n"


_TOKEN_JSON = tuple(json.dumps(token_text(i)).encode() for i in range(len(FILLER)))


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"
