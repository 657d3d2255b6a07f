"""The server's OpenAPI document (`GET /openapi.json`), made to say what the handlers do.

FastAPI's own document declares a 422 that never comes (validation errors are 400s here,
`api_server._invalid`), every other status undeclared, `/metrics` as JSON and streams not at
all, so schema-driven clients and fuzzers cannot check bodies. `honest_openapi` starts from
it and, per operation:
- drops the 422 and its schemas; declares each status the route can answer, with the error
  body it has: OpenAI's `{"error": {...}}` (`ErrorResponse`), Anthropic's on `/v1/messages`;
- `/metrics`: Prometheus text; `/health`: an empty object;
- token ids bounded by the served model's vocabulary; request bodies that refuse unknown
  fields closed (`additionalProperties: false`), and the cross-field rules JSON Schema
  can state;
- the generating routes: `text/event-stream` beside JSON (a request with `"stream": true`),
  and a JSON schema for the 200s that had none (`/v1/responses`, `/v1/messages`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from pagedinfer.entrypoints.openai.protocol import (
    IGNORED_AT_DEFAULT,
    IGNORED_FIELDS,
    ErrorResponse,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["honest_openapi"]

_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
_GENERATING = (*_STREAMING, "/v1/embeddings")
_MODEL_NAMED = (*_GENERATING, "/v1/models/{model_id}", "/tokenize", "/detokenize")

_DESCRIPTIONS = {
    "400": "Invalid request: the message names the field and the problem.",
    "401": "Missing or wrong API key (`--api-key`).",
    "404": "Unknown model, or the endpoint is off.",
    "405": "Method not allowed (the `Allow` header lists the allowed ones).",
    "408": "The request body did not arrive within `--client-timeout-s`.",
    "413": "The request body is larger than `--max-request-bytes`.",
    "500": "Internal error (one log line on the server).",
    "503": "The engine core is dead.",
}

_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}

_ANTHROPIC_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object"}},
        "model": {"type": "string"},
        "stop_reason": {"type": ["string", "null"]},
        "usage": {"type": "object"},
    },
}

_RESPONSE_OBJECT = {
    "type": "object",
    "required": ["id", "object", "status", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "status": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object"}},
    },
}


def _statuses(path: str, has_body: bool) -> list[str]:
    statuses = ["500"]
    if has_body:
        statuses += ["400", "408", "413"]
    if path.startswith("/v1"):
        statuses.append("401")
    if path in _MODEL_NAMED or path == "/tokenizer_info":
        statuses.append("404")
        if "400" not in statuses:
            statuses.append("400")
    if path in _GENERATING or path == "/health":
        statuses.append("503")
    return sorted(set(statuses))


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every token id of the document (`protocol.TokenId`) below the vocabulary size."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.pop("x-token-id", False):
                item["maximum"] = vocab_size - 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_REFUSING_UNKNOWN: dict[str, tuple[bool, dict[str, Any]]] = {
    # request schema -> (takes OpenAI's ignored fields, `protocol.IGNORED_*`; its own)
    "CompletionRequest": (True, {}),
    "ChatCompletionRequest": (True, {"echo": {"enum": [False]}}),
    "EmbeddingRequest": (True, {}),
    "ResponsesRequest": (True, {}),
    "MessagesRequest": (False, {"metadata": {}, "service_tier": {}}),
    "ChatMessage": (False, {}),
}


def _close_request_schemas(schemas: dict[str, Any]) -> None:
    """The request bodies that refuse unknown fields say so (`additionalProperties`
    false), listing the ignored ones they take; and the rules across fields that JSON
    Schema can state."""
    ignored: dict[str, Any] = {name: {} for name in IGNORED_FIELDS}
    ignored |= {
        name: {"enum": list(values)}
        for name, values in IGNORED_AT_DEFAULT.items()
        if name != "echo_chat"
    }
    for name, (takes_ignored, own) in _REFUSING_UNKNOWN.items():
        schema = schemas.get(name)
        if schema is None:
            continue
        properties = schema.setdefault("properties", {})
        extra = {**ignored, **own} if takes_ignored else own
        for field, field_schema in extra.items():
            properties.setdefault(field, field_schema)
        schema["additionalProperties"] = False
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        bias = schemas.get(name, {}).get("properties", {}).get("logit_bias")
        if bias is not None:  # keys are token ids
            bias["anyOf"][0]["propertyNames"] = {"pattern": "^[0-9]+$"}
    completion = schemas.get("CompletionRequest")
    if completion is not None:  # max_tokens 0 scores an echoed prompt, unstreamed
        completion["if"] = {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]}
        completion["then"] = {
            "properties": {"echo": {"const": True}, "stream": {"const": False}},
            "required": ["echo"],
        }


def honest_openapi(
    app: FastAPI, vocab_size: int, accept_kv_transfer_params: bool
) -> dict[str, Any]:
    """FastAPI's document of `app`, corrected as the module docstring says (cached);
    token ids are bounded by `vocab_size`; `kv_transfer_params` is null only where the
    server refuses clients' (`serving_engine.ServingOptions`)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = TypeAdapter(ErrorResponse).json_schema(
        ref_template="#/components/schemas/{model}"
    )
    for sub in schemas["ErrorResponse"].pop("$defs", {}).items():
        schemas.setdefault(*sub)
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    for path, operations in doc["paths"].items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            shape = "AnthropicError" if path == "/v1/messages" else "ErrorResponse"
            error = {"$ref": f"#/components/schemas/{shape}"}
            for status in _statuses(path, "requestBody" in op or "parameters" in op):
                responses[status] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": error}},
                }
            ok = responses.setdefault("200", {"description": "Successful Response"})
            content = ok.setdefault("content", {})
            json_body = content.setdefault("application/json", {"schema": {}})
            if path == "/metrics":
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                continue
            if path == "/health":
                json_body["schema"] = {"type": "object", "maxProperties": 0}
            elif path == "/v1/messages":
                json_body["schema"] = _ANTHROPIC_MESSAGE
            elif path == "/v1/responses":
                json_body["schema"] = _RESPONSE_OBJECT
            if path in _STREAMING:
                content["text/event-stream"] = {}  # events of the JSON chunks' shapes
    _bound_token_ids(doc, vocab_size)
    _close_request_schemas(schemas)
    if not accept_kv_transfer_params:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            if name in schemas:
                schemas[name]["properties"]["kv_transfer_params"] = {"type": "null"}
    app.openapi_schema = doc
    return doc
