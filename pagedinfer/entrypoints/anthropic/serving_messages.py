"""`/v1/messages`: Anthropic's Messages API as a thin adapter over the chat handler
(`openai/chat_bridge.py`), so the official `anthropic` client (and tools built on it) can
use a pagedinfer server.

A request becomes a chat request: `system` a system message; each message's text blocks its
content, an assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks
tool messages; `tools` (`name`, `description`, `input_schema`) function tools; `tool_choice`
`auto` / `any` / `tool` / `none` the chat's "auto" / "required" / named / "none", with
`disable_parallel_tool_use` as `parallel_tool_calls: false`; `stop_sequences`, `max_tokens`,
`temperature`, `top_p`, `top_k` as they are. The answer's text and calls become `text` and
`tool_use` blocks (reasoning, with `--reasoning-parser`, a `thinking` block first); the
stop reason is `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`. A stream sends
Anthropic's events: `message_start`, per block `content_block_start` / `_delta` (`text_delta`,
`input_json_delta`, `thinking_delta`) / `_stop`, then `message_delta` and `message_stop`.
Errors use Anthropic's body, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, model_validator

from pagedinfer.entrypoints.anthropic.protocol import (
    CallingChoice,
    Message,
    NamedChoice,
    TextBlock,
    ToolChoice,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from pagedinfer.entrypoints.openai.chat_bridge import ChatFailure, ToolCallAssembler, run_chat
from pagedinfer.entrypoints.openai.protocol import StrictRequest, Text

if TYPE_CHECKING:
    from fastapi import Request

    from pagedinfer.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["AnthropicServingMessages", "MessagesRequest", "anthropic_error"]

_IGNORED = frozenset({"metadata", "service_tier"})


class MessagesRequest(StrictRequest):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False

    @model_validator(mode="after")
    def _known_fields_only(self) -> MessagesRequest:
        unknown = sorted(set(self.model_extra or {}) - _IGNORED)
        if unknown:
            raise ValueError(
                f"unsupported field{'s' if len(unknown) > 1 else ''} for /v1/messages: "
                f"{', '.join(map(repr, unknown))}; pagedinfer does not implement "
                f"{'them' if len(unknown) > 1 else 'it'}"
            )
        return self


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            503: "overloaded_error"}.get(status, "api_error")  # fmt: skip
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def _text(content: str | list[TextBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content)


def _messages(request: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system)})
    for message in request.messages:
        role, content = message.role, message.content
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                function = {"name": block.name, "arguments": json.dumps(block.input)}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": _text(block.content)})  # fmt: skip
            # ThinkingBlock: earlier reasoning, which chat templates drop too
        if texts or calls:
            entry: dict[str, Any] = {"role": role, "content": "\n".join(texts) or None}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def chat_body(request: MessagesRequest) -> dict[str, Any]:
    """The chat completion request `request` asks for (the chat handler's own checks, a
    named tool among the tools and the like, then apply)."""
    body: dict[str, Any] = {"messages": _messages(request), "max_tokens": request.max_tokens,
                            "stream": request.stream}  # fmt: skip
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.tools:
        tools = []
        for tool in request.tools:
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        body["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, NamedChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if isinstance(choice, CallingChoice) and choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    return body


def _stop_reason(finish_reason: str | None, stop_reason: Any, called: bool) -> str:
    if called or finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(stop_reason, str) else "end_turn"


class AnthropicServingMessages:
    """Handles `/v1/messages` through the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        if request.model != self.chat.model_name:
            served = self.chat.model_name
            return anthropic_error(
                404, f"model: {request.model!r} is not served here (this server serves {served!r})"
            )
        try:
            body = chat_body(request)
        except ValueError as exc:
            return anthropic_error(400, str(exc))
        answer = await run_chat(self.chat, body, raw_request)
        if isinstance(answer, ChatFailure):
            return anthropic_error(answer.status, answer.message)
        message_id = f"msg_{uuid.uuid4().hex}"
        if isinstance(answer, dict):
            return JSONResponse(self._message(request, answer, message_id))
        events = _events(request, answer, message_id)
        return StreamingResponse(events, media_type="text/event-stream")

    def _message(
        self, request: MessagesRequest, answer: dict[str, Any], message_id: str
    ) -> dict[str, Any]:
        choice = answer["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"],
                            "signature": ""})  # fmt: skip
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})  # fmt: skip
        stop = _stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                            bool(message.get("tool_calls")))  # fmt: skip
        usage = answer["usage"]
        return {
            "id": message_id, "type": "message", "role": "assistant", "model": request.model,
            "content": content, "stop_reason": stop,
            "stop_sequence": choice.get("stop_reason") if stop == "stop_sequence" else None,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"]},
        }  # fmt: skip


def _sse(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


async def _events(
    request: MessagesRequest, chunks: AsyncIterator[dict[str, Any] | ChatFailure], message_id: str
) -> AsyncIterator[str]:
    """Anthropic's stream of one chat stream: one content block open at a time."""
    start = {"id": message_id, "type": "message", "role": "assistant", "model": request.model,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
    yield _sse("message_start", {"message": start})
    index = -1
    open_kind: Literal["text", "thinking", "tool_use"] | None = None
    calls = ToolCallAssembler()
    finish_reason = stop_reason = None
    usage: dict[str, Any] = {}

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_sse("content_block_stop", {"index": index})]

    def open_(block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = block["type"]
        return [*out, _sse("content_block_start", {"index": index, "content_block": block})]

    async for chunk in chunks:
        if isinstance(chunk, ChatFailure):
            yield "".join(close())
            kind = "overloaded_error" if chunk.status == 503 else "api_error"
            yield _sse("error", {"error": {"type": kind, "message": chunk.message}})
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            finish_reason = choice.get("finish_reason") or finish_reason
            stop_reason = choice.get("stop_reason") or stop_reason
            if delta.get("reasoning"):
                if open_kind != "thinking":
                    yield "".join(open_({"type": "thinking", "thinking": "", "signature": ""}))
                yield _sse("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": delta["reasoning"]}})  # fmt: skip
            if delta.get("content"):
                if open_kind != "text":
                    yield "".join(open_({"type": "text", "text": ""}))
                yield _sse("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": delta["content"]}})  # fmt: skip
            for call_index, new, added in calls.add(delta.get("tool_calls") or []):
                entry = calls.calls[call_index]
                if new:
                    block = {"type": "tool_use", "id": entry["id"], "name": entry["name"],
                             "input": {}}  # fmt: skip
                    yield "".join(open_(block))
                if added:
                    yield _sse("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": added}})  # fmt: skip
    yield "".join(close())
    stop = _stop_reason(finish_reason, stop_reason, bool(calls.calls))
    delta = {"stop_reason": stop, "stop_sequence": stop_reason if stop == "stop_sequence" else None}
    out_usage = {"input_tokens": usage.get("prompt_tokens", 0),
                 "output_tokens": usage.get("completion_tokens", 0)}  # fmt: skip
    yield _sse("message_delta", {"delta": delta, "usage": out_usage})
    yield _sse("message_stop", {})
