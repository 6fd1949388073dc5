"""Request and response bodies of the router's HTTP API, validated by pydantic, and the
OpenAPI document built from them. A bad body raises :class:`BadRequest` whose message
names the field, e.g. ``max_tokens: must be >= 1``.

Bodies are checked strictly: an integer field takes only a JSON integer (not ``true``,
``"5"`` or ``5.0``), a boolean only ``true``/``false``, a number no NaN or infinity; a
body nested deeper than :data:`MAX_DEPTH` or holding an integer too long for Python to
parse is refused before validation (400), never an exception in the handler."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from olproute.config.read import key_path, problem, problems_of
from olproute.types import Request

# Nesting of a request body, counted in arrays and objects. OpenAI bodies nest a few
# levels (messages, content parts, tool schemas); far below where json.dumps, forwarding
# the body to a backend, would hit the interpreter's recursion limit.
MAX_DEPTH = 64
MAX_TOKENS = 1_000_000  # max_tokens and max_completion_tokens: larger is refused (400)


class BadRequest(ValueError):
    """An invalid body: ``field`` is its key path ("" for the body as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)

    def as_json(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return error_doc(str(self), param=self.field or None)


def error_doc(message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, the one of every error the router answers (``ERROR_SCHEMA``):
    ``kind`` is its ``type``, ``param`` the field at fault, ``code`` a machine-readable
    reason (``model_not_found``), each None when there is none."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# strict: no coercion (true is not 1, "5" is not 5); no NaN or infinity
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, frozen=True)


# the router accounts for and schedules one completion per request: n = 3 would make the
# backend generate three times what the policy planned for
ONE_COMPLETION = "one completion per request (the router schedules one)"


# a token id: no vocabulary holds 2^31 ids (vLLM's engine keeps them as int32); a
# backend refuses one past its own vocabulary itself
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Body(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")


class ChatMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class CompletionBody(_Body):
    """The fields of an OpenAI completion request the router reads (others pass through
    to the backend unchecked)."""

    model: str | None = None
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1)]) = Field(
        description="text, a list of one text, or a list of token ids (each in [0, 2^31)):"
                    " " + ONE_COMPLETION)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    # not OpenAI's for completions, but read if given (it wins over max_tokens)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description=ONE_COMPLETION)
    best_of: int | None = Field(default=None, ge=1, le=1, description=ONE_COMPLETION)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        """Several texts would be several completions (OpenAI answers one per text)."""
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str):
            raise PydanticCustomError("one_completion",
                                      f"must be one text, got {len(prompt)}: "
                                      f"{ONE_COMPLETION}")
        return prompt


class ChatBody(_Body):
    """The fields of an OpenAI chat completion request the router reads (others pass
    through to the backend unchecked)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS,
                                              description="wins over max_tokens")
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description=ONE_COMPLETION)


class RouteBody(BaseModel):
    """``POST /route``: the decision alone (nothing is dispatched or counted). Give
    ``prompt`` or ``prompt_tokens`` (the count wins when both are given; the predictor
    reads the prompt's text, so without it the prediction is ``max_tokens``)."""

    model_config = ConfigDict(**_STRICT, extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["prompt_tokens"], "properties": {"prompt_tokens": {"type": "integer"}}},
    ]})
    prompt: str | None = Field(default=None, description="prompt text (or give prompt_tokens)")
    prompt_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    predicted_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS, description="predicted output tokens, if known: "
        "the length on every model in place of the router's prediction (a predictor "
        "that runs on the prompt still gives the quality); the answer's "
        "explanation.prediction.source is then 'request'")
    ttft_target_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    slo_class: str = "default"
    model: str | None = Field(default=None, description="only instances serving this model "
                              "(its profile's name or a backend's served_model); another is "
                              "a 404 (code model_not_found) unless server.any_model")


class ReloadBody(BaseModel):
    """``POST /admin/reload`` (optional): the weight profiles to switch to."""

    model_config = ConfigDict(**_STRICT, extra="forbid")
    weights: str | list[str] | None = Field(
        default=None, description="a profile file (or a list; [] drops them all) under the "
        "config's folder, configs/weights/ or server.reload_weights_dirs, or the name of a "
        "shipped profile; absent: re-read the profiles the router runs with")


class PredictionDoc(BaseModel):
    """Where a request's predictions came from, and what they are."""

    source: Literal["predictor", "request", "max_tokens"] = Field(
        description="predictor: the router's predictor on the prompt text "
        "(prediction.serve); request: /route's predicted_tokens; max_tokens: no "
        "prediction (no predictor, no prompt text, or no model of the pool it knows)")
    max_tokens: int = Field(description="the most the backend generates")
    decode_tokens: dict[str, int] = Field(
        description="predicted output tokens per model of the pool (a model the predictor "
        "does not know: max_tokens)")
    quality: dict[str, float] | None = Field(
        default=None, description="predicted quality in [0, 1] per model the predictor "
        "knows, when it ran")


class ExplanationDoc(BaseModel):
    """A decision's explanation: per-instance figures in ``instances`` order (ttft_s,
    reward terms, price_cost, score: what the policy reports), and ``prediction``."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, list[float]] = Field(init=False)
    prediction: PredictionDoc


class RouteAnswer(BaseModel):
    request_id: int
    action: Literal["dispatch", "hold", "shed"]
    instance: str | None
    decode_instance: str | None = Field(
        default=None, description="disaggregated pools: the decode instance (``instance`` "
                                  "is then the prefill instance)")
    reason: str
    refusal: str | None = Field(
        default=None, description="a shed's kind: no_room, late, patience, "
                                  "buffer_full, no_backend or price "
                                  "(olproute.types.REFUSALS)")
    policy: str
    instances: list[str]
    explanation: ExplanationDoc


class ModelCard(BaseModel):
    """A model the pool serves: a backend's served name or its profile's model name."""

    id: str = Field(description="the name a request's model may give")
    object: Literal["model"] = "model"
    created: int = Field(description="when the router started, Unix seconds")
    owned_by: Literal["olproute"] = "olproute"


class ModelList(BaseModel):
    """``GET /v1/models``: the models the pool serves, deduplicated, in backend order."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def explanation_doc(explanation: Mapping[str, Sequence[float]],
                    prediction: dict[str, Any]) -> dict[str, Any]:
    """A decision's explanation for JSON (``ExplanationDoc``): its per-instance figures as
    floats, a non-finite one as 1e308 (JSON has no infinity), and ``prediction``
    (``prediction_doc``). Reading it builds it (a policy may make it lazily): only what
    answers with it calls this."""
    doc: dict[str, Any] = {}
    for k, v in explanation.items():
        row = list(map(float, v))
        # map in C where every figure is finite (the usual case), element by element not
        doc[k] = row if all(map(math.isfinite, row)) else [
            x if math.isfinite(x) else 1e308 for x in row]
    doc["prediction"] = prediction
    return doc


def prediction_doc(request: Request, models: Sequence[str], max_tokens: int,
                   source: str) -> dict[str, Any]:
    """A request's predictions on each of the pool's ``models`` for JSON
    (``PredictionDoc``)."""
    doc: dict[str, Any] = {
        "source": source, "max_tokens": max_tokens,
        "decode_tokens": {m: request.predicted_decode_tokens_for(m) for m in models}}
    quality = request.predicted_quality_by_model
    if quality:
        doc["quality"] = {m: float(quality[m]) for m in models if m in quality}
    return doc


def count_words(text: str) -> int:
    """The router's (and the emulator's) token count: whitespace-separated words."""
    return len(text.split())


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# orjson reads an integer past 64 bits as a float (json.loads keeps it an int, which the
# bounds then refuse by name): a body with a run of 19 digits takes json.loads' path
_LONG_NUMBER = re.compile(rb"[0-9]{19}")
# orjson recurses on the C stack as arrays nest, without a limit: 140,000 nested arrays
# (280 KB) overflow an 8 MiB stack and kill the process (orjson 3.8). A body opening
# more brackets than this (however many are inside strings) takes json.loads' path,
# whose nesting counts against the interpreter's recursion limit (RecursionError)
ORJSON_MAX_BRACKETS = 10_000


def parse_json(raw: bytes) -> Any:
    """The body as JSON; BadRequest if it is not JSON (NaN and Infinity are not), is
    nested deeper than MAX_DEPTH, or has an integer too long to parse.

    orjson reads it (about 10x faster than json.loads); whatever orjson refuses (not
    JSON, NaN, a lone surrogate, a byte-order mark, UTF-16), might read otherwise (a
    long number) or might overflow the stack on (``ORJSON_MAX_BRACKETS``) goes through
    json.loads, whose verdict and message are the contract."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= ORJSON_MAX_BRACKETS and _LONG_NUMBER.search(raw) is None:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = _parse_json_slow(raw)
    else:
        data = _parse_json_slow(raw)
    # each level of nesting opens a bracket: few brackets, no need to walk the value
    if brackets > MAX_DEPTH and nesting(data) > MAX_DEPTH:
        raise BadRequest("", f"body is nested deeper than {MAX_DEPTH} levels")
    return data


def _parse_json_slow(raw: bytes) -> Any:
    """json.loads' reading of a body orjson did not take, or BadRequest saying why it is
    not JSON."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise BadRequest("", f"body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError:
        raise BadRequest("", "body is not valid JSON: not UTF-8 text") from None
    except RecursionError:
        raise BadRequest("", f"body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # NaN/Infinity, or an integer past sys.get_int_max_str_digits()
        why = str(exc) if "is not JSON" in str(exc) else "an integer has too many digits"
        raise BadRequest("", f"body is not valid JSON: {why}") from None


def dump_json(value: Any) -> bytes:
    """``value`` (a body ``parse_json`` read) as JSON bytes, with the values json.dumps
    gives it: orjson, unless its output holds a null, which may be a float json.loads
    read as infinity (``1e400``; orjson writes null, json.dumps Infinity), or orjson
    refuses it (an integer past 64 bits, a lone surrogate): then json.dumps."""
    try:
        out = orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()
    return json.dumps(value).encode() if b"null" in out else out


def nesting(value: Any) -> int:
    """How deeply arrays and objects nest in a decoded JSON value (a scalar: 0),
    without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_DEPTH:
            return deepest  # deep enough to refuse; no need to walk the rest
        stack.extend((x, depth + 1) for x in items)
    return deepest


def validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise BadRequest("", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _bad_request(exc) from None


def _bad_request(exc: ValidationError) -> BadRequest:
    """The first problem of a validation error, naming the field. A union field (a
    prompt: text, texts or token ids) fails once per member, the member's type in the
    error's location: reported at the field, by the member whose type matched (``[]``:
    must have at least 1 item), else with the types the field takes."""
    errors = exc.errors()
    loc = errors[0]["loc"]
    cut = next((i for i, part in enumerate(loc) if _is_type_tag(part)), None)
    if cut is None:
        key, msg = (problems_of(exc) or [(key_path(loc), errors[0]["msg"])])[0]
        return BadRequest(key, msg)
    members = [e for e in errors if len(e["loc"]) > cut and e["loc"][:cut] == loc[:cut]]
    for e in members:
        if not e["type"].endswith("_type"):
            found = problem({**e, "loc": e["loc"][:cut] + e["loc"][cut + 1:]})
            if found is not None:
                return BadRequest(*found)
    kinds = list(dict.fromkeys(_MEMBERS.get(str(e["loc"][cut]), str(e["loc"][cut]))
                               for e in members))
    return BadRequest(key_path(loc[:cut]), "must be " + (
        f"{', '.join(kinds[:-1])} or {kinds[-1]}" if len(kinds) > 1 else kinds[0]))


# pydantic names a union member by its type in an error's location
_MEMBERS = {"str": "a string", "constrained-str": "a string", "none": "null",
            "list[int]": "a list of integers", "list[constrained-int]": "a list of integers",
            "list[str]": "a list of strings",
            "list[dict[str,any]]": "a list of objects"}


def _is_type_tag(part: int | str) -> bool:
    # field names are identifiers; member tags are 'str', 'list[int]', 'constrained-str'
    return isinstance(part, str) and (part in _MEMBERS or not part.isidentifier())


def prompt_ids_of(body: CompletionBody | ChatBody) -> list[int] | None:
    """The token ids of a completion request whose prompt is given as ids, else None."""
    if isinstance(body, CompletionBody) and body.prompt and isinstance(body.prompt, list) \
            and isinstance(body.prompt[0], int):
        return [int(t) for t in body.prompt]
    return None


def prompt_tokens_of(body: CompletionBody | ChatBody) -> tuple[int, str | None]:
    """(token count, text) of a completion or chat request."""
    if isinstance(body, ChatBody):
        parts = []
        for m in body.messages:
            if isinstance(m.content, str):
                parts.append(m.content)
            elif isinstance(m.content, list):
                parts.extend(str(c.get("text", "")) for c in m.content)
        text = "\n".join(parts)
        return max(count_words(text), 1), text
    if isinstance(body.prompt, str):
        return max(count_words(body.prompt), 1), body.prompt
    if body.prompt and isinstance(body.prompt[0], str):
        text = "\n".join(str(p) for p in body.prompt)
        return max(count_words(text), 1), text
    return len(body.prompt), None


# OpenAI's error shape, which every error of the router uses (server/errors.py)
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"],
                                 "description": "the field at fault, if one is"},
                       "code": {"type": ["string", "null"],
                                "description": "a machine-readable reason, if there is "
                                               "one (model_not_found)"}}}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ref(description: str, name: str) -> dict[str, Any]:
    """A 200 answer of the JSON schema ``name`` (components/schemas)."""
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}


_BODY_ERRORS = {
    "400": _error("invalid body (not JSON, nested too deep, wrong type or bound); the "
                  "message and param name the field"),
    "408": _error("the body did not arrive within server.body_timeout_s"),
    "413": _error("body larger than server.max_body_bytes")}
_SLO_HEADERS = [
    {"name": "x-slo-ttft-ms", "in": "header", "description": "TTFT target (default: "
     "server.default_ttft_ms)", "schema": {"type": "number", "exclusiveMinimum": 0,
                                           "maximum": 3_600_000}},
    {"name": "x-slo-class", "in": "header", "schema": {"type": "string"}},
    {"name": "x-olproute-explain", "in": "header", "description": "1 (or true): the answer "
     "carries the decision's explanation in x-olproute-explanation, as JSON (an "
     "ExplanationDoc, as RouteAnswer.explanation: the per-instance figures and the "
     "request's prediction); absent, the router does not build it",
     "schema": {"type": "string", "enum": ["1", "true"]}}]


def _proxied(summary: str, body: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "parameters": _SLO_HEADERS, "requestBody": _body(body),
        "responses": {
            "200": {"description": "the backend's answer (server-sent events when stream "
                                   "is true); headers x-olproute-instance, x-olproute-reason,"
                                   " and x-olproute-explanation when x-olproute-explain asks"},
            **_BODY_ERRORS,
            "429": _error("shed; see Retry-After"),
            "404": _error("no backend serves the body's model (code model_not_found; "
                          "unless server.any_model)"),
            "502": _error("the backend failed"), "503": _error("no backend after a failure")}}}


_NO_STORE = {"Cache-Control": {"description": "no-store",
                               "schema": {"type": "string", "enum": ["no-store"]}}}


def _json(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A 200 answer of a JSON object (``headers``: its response headers, if any)."""
    return {"description": description, **({"headers": headers} if headers else {}),
            "content": {"application/json": {"schema": {"type": "object"}}}}


def _get(summary: str, description: str = "") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": description
                                                                 or summary}}}}


def _models_paths() -> dict[str, Any]:
    """``GET /v1/models`` and ``GET /v1/models/{model}``, as OpenAI's."""
    return {
        "/v1/models": {"get": {
            "summary": "the models the pool serves (OpenAI's list): each backend's "
                       "served_model and its profile's model name; a completion naming "
                       "another is a 404 unless server.any_model",
            "responses": {"200": _ref("the served models", "ModelList")}}},
        "/v1/models/{model}": {"get": {
            "summary": "one served model",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": _ref("the model", "ModelCard"),
                          "404": _error("no backend serves it (code model_not_found)")}}}}


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the router's own endpoints."""
    _, defs = models_json_schema(
        [(m, "validation") for m in (CompletionBody, ChatBody, RouteBody, ReloadBody)]
        + [(m, "serialization") for m in (RouteAnswer, ModelList)],
        ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "olproute", "version": "0.1.0",
                 "description": "LLM request router: bid-price control over serving "
                                "instances, OpenAI-compatible proxy. Every error answers "
                                "OpenAI's error shape (components/schemas/Error)."},
        "paths": {
            "/route": {"post": {
                "summary": "Decide for one request without dispatching it (give prompt or "
                           "prompt_tokens)",
                "requestBody": _body("RouteBody"),
                "responses": {"200": {"description": "the decision and its explanation",
                                      "content": {"application/json": {"schema": {
                                          "$ref": "#/components/schemas/RouteAnswer"}}}},
                              **_BODY_ERRORS,
                              "404": _error("no backend serves the body's model (code "
                                            "model_not_found; unless server.any_model)")}}},
            "/v1/completions": _proxied("OpenAI-compatible completion, proxied to the "
                                        "chosen instance", "CompletionBody"),
            "/v1/chat/completions": _proxied("OpenAI-compatible chat completion, proxied to "
                                             "the chosen instance", "ChatBody"),
            **_models_paths(),
            "/prices": _get("shadow prices per instance and slot, the last live "
                            "certificate of them (D(p_online)/LP* - 1 over a window), and "
                            "the last re-solve of the LP for them (resolve)"),
            "/instances": _get("tracked state and health of each backend (URLs without "
                               "credentials)"),
            "/metrics": _get("Prometheus metrics", "text format"),
            "/healthz": _get("liveness", "ok (503 when no backend is healthy)"),
            "/openapi.json": {"get": {
                "summary": "this document (OpenAPI 3.1)",
                "responses": {"200": _json("the router's OpenAPI document")}}},
            "/debug/loop-lag": {"get": {
                "summary": "how late the router's event loop ran a timer (one every 10 ms) "
                           "over the last `seconds`: samples, p50_ms, p99_ms, max_ms",
                "parameters": [{"name": "seconds", "in": "query", "schema": {
                    "type": "number", "exclusiveMinimum": 0, "maximum": 60, "default": 10}}],
                "responses": {"200": {"description": "the lag summary"},
                              "400": _error("seconds out of range")}}},
            "/admin/reload": {"post": {
                "summary": "re-read the YAML and the weight profiles (bearer token); a "
                           "refused reload keeps the running router",
                "security": [{"bearer": []}],
                "requestBody": {**_body("ReloadBody"), "required": False},
                "responses": {"200": {"description": "reloaded"},
                              **_BODY_ERRORS,
                              "400": _error("invalid config or profile, a profile the "
                                            "router may not read, or a change that needs a "
                                            "restart; param names the key"),
                              "401": _error("missing or wrong token")}}},
            "/dashboard": {"get": {
                "summary": "the operators' live page (HTML and JavaScript served by the "
                           "router, nothing fetched from outside it), polling "
                           "/dashboard/data every second",
                "responses": {"200": {
                    "description": "the page (never cached)", "headers": _NO_STORE,
                    "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/dashboard/data": {"get": {
                "summary": "what the dashboard shows: shadow prices per instance (batch, KV "
                           "and compute, binned over the horizon), decisions per second by "
                           "action, observed TTFT, and the last live certificate of the "
                           "prices",
                "responses": {"200": _json("the dashboard's figures (never cached)",
                                           _NO_STORE)}}},
        },
        "components": {
            "schemas": {**defs["$defs"], "Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
