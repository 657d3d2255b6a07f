"""`/v1/responses`, stateless: OpenAI's Responses API as a thin adapter over the chat
handler (`chat_bridge.py`).

A request becomes a chat request: `instructions` a system message; `input` a user message
(text) or its items in order (messages with text parts, `function_call` items as the
assistant's tool calls, `function_call_output` items as tool results; `reasoning` items are
dropped, as chat templates drop earlier reasoning); function `tools`, `tool_choice` and
`parallel_tool_calls` as in chat; `text.format` (`json_schema`, `json_object`) as
`response_format`; `max_output_tokens` as `max_completion_tokens`. The answer's reasoning
(with `--reasoning-parser`), text and calls become `reasoning`, `message` and
`function_call` output items; a stream sends the Responses event types (`response.created`,
`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`).

Nothing is stored: `previous_response_id` is a 400 and `store` is accepted and ignored, so a
conversation is continued by sending its items again. Built and routed by `api_server.py`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedinfer.entrypoints.openai.chat_bridge import ChatFailure, ToolCallAssembler, run_chat
from pagedinfer.entrypoints.openai.protocol import (
    ResponsesFunctionCallItem,
    ResponsesFunctionOutputItem,
    ResponsesMessageItem,
    ResponsesNamedChoice,
    ResponsesRequest,
    ResponsesSchemaFormat,
    ResponsesTextPart,
)
from pagedinfer.entrypoints.openai.serving_engine import error_response

if TYPE_CHECKING:
    from fastapi import Request

    from pagedinfer.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["OpenAIServingResponses", "chat_body"]


def _text(content: str | list[ResponsesTextPart]) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    for item in request.input:
        if isinstance(item, ResponsesMessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})  # fmt: skip
        # ResponsesReasoningItem: earlier reasoning, dropped
    return messages


def chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request `request` asks for; ValueError (a 400) otherwise."""
    if request.previous_response_id is not None:
        raise ValueError(
            "previous_response_id: this server stores no responses (stateless); send the "
            "conversation's items in `input` instead"
        )
    body: dict[str, Any] = {"messages": _messages(request), "stream": request.stream}
    if request.model is not None:
        body["model"] = request.model
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p),
                        ("max_completion_tokens", request.max_output_tokens)):  # fmt: skip
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
        body["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.tool_choice
    if isinstance(choice, ResponsesNamedChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = request.text.format if request.text is not None else None
    if isinstance(fmt, ResponsesSchemaFormat):
        schema = fmt.model_dump(include={"name", "json_schema", "strict"}, by_alias=True,
                                exclude_none=True)  # fmt: skip
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object, built up from the chat answer (whole or streamed)."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.usage: dict[str, Any] | None = None

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None) -> None:
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }

    def body(self) -> dict[str, Any]:
        r = self.request
        echoed = r.model_dump(include={"tool_choice", "tools", "text"}, by_alias=True,
                              exclude_none=True)  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "model": self.model, "output": self.output,
            "error": None, "incomplete_details": self.incomplete,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature,
            "top_p": r.top_p, "tool_choice": echoed.get("tool_choice", "auto"),
            "tools": echoed.get("tools", []),
            "text": echoed.get("text") or {"format": {"type": "text"}},
            "metadata": r.metadata or {},
            "store": False, "usage": self.usage,
        }  # fmt: skip


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [part] if status == "completed" else []}  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class OpenAIServingResponses:
    """Handles `/v1/responses` through the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        try:
            body = chat_body(request)
        except ValueError as exc:
            return error_response(400, str(exc))
        answer = await run_chat(self.chat, body, raw_request)
        if isinstance(answer, ChatFailure):
            return error_response(answer.status, answer.message, answer.param)
        response = _Response(request, self.chat.model_name)
        if isinstance(answer, dict):
            choice = answer["choices"][0]
            message = choice["message"]
            if message.get("reasoning"):
                response.output.append(reasoning_item(message["reasoning"]))
            if message.get("content"):
                response.output.append(message_item(message["content"]))
            for call in message.get("tool_calls") or []:
                function = call["function"]
                response.output.append(call_item(call["id"], function["name"],
                                                 function["arguments"]))  # fmt: skip
            response.finish(choice["finish_reason"], answer.get("usage"))
            return JSONResponse(response.body())
        return StreamingResponse(_events(response, answer), media_type="text/event-stream")


async def _events(
    response: _Response, chunks: AsyncIterator[dict[str, Any] | ChatFailure]
) -> AsyncIterator[str]:
    """The Responses stream of one chat stream: each output item opened (`added`), filled
    by deltas, closed (`done`) before the next one opens."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        data = json.dumps({"type": kind, "sequence_number": seq, **fields})
        return f"event: {kind}\ndata: {data}\n\n"

    open_item: dict[str, Any] | None = None  # the item being streamed
    calls = ToolCallAssembler()
    call_items: dict[int, dict[str, Any]] = {}

    def close() -> list[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return []
        index = response.output.index(item)
        out = []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out += [event("response.output_text.done", item_id=item["id"], output_index=index,
                          content_index=0, text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=index,
                          content_index=0, part=part)]  # fmt: skip
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(event("response.reasoning_text.done", item_id=item["id"],
                             output_index=index, content_index=0, text=text))  # fmt: skip
        else:
            out.append(event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, arguments=item["arguments"],
                             name=item["name"]))  # fmt: skip
        out.append(event("response.output_item.done", output_index=index, item=item))
        return out

    def open_(item: dict[str, Any]) -> list[str]:
        nonlocal open_item
        out = close()
        response.output.append(item)
        open_item = item
        index = len(response.output) - 1
        added = {**item, "status": "in_progress"}
        out.append(event("response.output_item.added", output_index=index, item=added))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(event("response.content_part.added", item_id=item["id"],
                             output_index=index, content_index=0, part=part))  # fmt: skip
        return out

    yield event("response.created", response=response.body())
    yield event("response.in_progress", response=response.body())
    finish_reason = None
    usage = None
    async for chunk in chunks:
        if isinstance(chunk, ChatFailure):
            for text in close():
                yield text
            response.status = "failed"
            yield event("error", code=str(chunk.status), message=chunk.message, param=None)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            finish_reason = choice.get("finish_reason") or finish_reason
            if delta.get("reasoning"):
                if open_item is None or open_item["type"] != "reasoning":
                    for text in open_({**reasoning_item(""), "status": "in_progress"}):
                        yield text
                assert open_item is not None
                open_item["content"][0]["text"] += delta["reasoning"]
                yield event("response.reasoning_text.delta", item_id=open_item["id"],
                            output_index=len(response.output) - 1, content_index=0,
                            delta=delta["reasoning"])  # fmt: skip
            if delta.get("content"):
                if open_item is None or open_item["type"] != "message":
                    for text in open_(message_item("", "in_progress")):
                        yield text
                assert open_item is not None
                open_item["content"][0]["text"] += delta["content"]
                yield event("response.output_text.delta", item_id=open_item["id"],
                            output_index=len(response.output) - 1, content_index=0,
                            delta=delta["content"], logprobs=[])  # fmt: skip
            for index, new, added in calls.add(delta.get("tool_calls") or []):
                entry = calls.calls[index]
                if new:
                    item = call_item(entry["id"], entry["name"], "", "in_progress")
                    call_items[index] = item
                    for text in open_(item):
                        yield text
                item = call_items[index]
                if added:
                    item["arguments"] += added
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=response.output.index(item), delta=added)  # fmt: skip
    for text in close():
        yield text
    response.finish(finish_reason, usage)
    kind = "response.completed" if response.status == "completed" else "response.incomplete"
    yield event(kind, response=response.body())
