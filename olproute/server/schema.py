"""Request and response bodies of the router's HTTP API, validated by pydantic, and the
OpenAPI document built from them. A bad body raises :class:`BadRequest` whose message
names the field, e.g. ``max_tokens: must be >= 1``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from olproute.config import _problems


class BadRequest(ValueError):
    """An invalid body: ``field`` is its key path ("" for the body as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)

    def as_json(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.field or None}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class CompletionBody(_Body):
    """The fields of an OpenAI completion request the router reads (others pass through)."""

    model: str | None = None
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False


class ChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False


class RouteBody(BaseModel):
    """``POST /route``: the decision alone (nothing is dispatched or counted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: str | None = Field(default=None, description="prompt text (or give prompt_tokens)")
    prompt_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    predicted_tokens: int | None = Field(default=None, ge=1, le=1_000_000,
                                         description="predicted output tokens, if known")
    ttft_target_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    slo_class: str = "default"
    model: str | None = Field(default=None, description="only instances serving this model")


class RouteAnswer(BaseModel):
    request_id: int
    action: Literal["dispatch", "hold", "shed"]
    instance: str | None
    decode_instance: str | None = Field(
        default=None, description="disaggregated pools: the decode instance (``instance`` "
                                  "is then the prefill instance)")
    reason: str
    policy: str
    instances: list[str]
    explanation: dict[str, list[float]] = Field(
        description="per-instance figures in `instances` order: ttft_s, reward terms, "
                    "price_cost, score (what the policy reports)")


def count_words(text: str) -> int:
    """The router's (and the emulator's) token count: whitespace-separated words."""
    return len(text.split())


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest("", f"body is not valid JSON: {exc}") from exc


def validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise BadRequest("", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        key, msg = _problems(exc)[0]
        raise BadRequest(key, msg) from exc


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


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the router's own endpoints."""
    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    error = {"description": "invalid body; the message names the field",
             "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "olproute", "version": "0.1.0",
                 "description": "LLM request router: bid-price control over serving "
                                "instances, OpenAI-compatible proxy."},
        "paths": {
            "/route": {"post": {
                "summary": "Decide for one request without dispatching it",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref("RouteBody")}}},
                "responses": {"200": {"description": "the decision and its explanation",
                                      "content": {"application/json": {
                                          "schema": ref("RouteAnswer")}}},
                              "400": error}}},
            "/v1/completions": {"post": {
                "summary": "OpenAI-compatible completion, proxied to the chosen instance "
                           "(stream: true passes server-sent events through)",
                "parameters": [
                    {"name": "x-slo-ttft-ms", "in": "header", "schema": {"type": "number"}},
                    {"name": "x-slo-class", "in": "header", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the backend's answer; headers "
                                                     "x-olproute-instance, x-olproute-reason"},
                              "400": error, "413": {"description": "body too large"},
                              "429": {"description": "shed; see Retry-After"}}}},
            "/v1/chat/completions": {"post": {
                "summary": "OpenAI-compatible chat completion, proxied",
                "responses": {"200": {"description": "the backend's answer"},
                              "400": error, "429": {"description": "shed"}}}},
            "/prices": {"get": {"summary": "shadow prices per instance and slot",
                                "responses": {"200": {"description": "prices"}}}},
            "/instances": {"get": {"summary": "tracked state and health of each backend",
                                   "responses": {"200": {"description": "instances"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text format"}}}},
            "/healthz": {"get": {"summary": "liveness",
                                 "responses": {"200": {"description": "ok"}}}},
            "/admin/reload": {"post": {
                "summary": "re-read the YAML (bearer token); an invalid file keeps the old "
                           "configuration",
                "responses": {"200": {"description": "reloaded"}, "400": error,
                              "401": {"description": "missing or wrong token"}}}},
        },
        "components": {"schemas": {"RouteBody": RouteBody.model_json_schema(),
                                   "RouteAnswer": RouteAnswer.model_json_schema()}},
    }
