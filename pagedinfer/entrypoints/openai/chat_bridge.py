"""Other APIs over the chat handler: `/v1/responses` and Anthropic's `/v1/messages` build a
chat completion request, run it through `OpenAIServingChat` exactly as `/v1/chat/completions`
does (template, tools, guided decoding, reasoning), and reshape what comes back.

`run_chat` gives the chat answer as data: a `ChatFailure` (the status and OpenAI error the
chat endpoint would have sent), the response body, or for a stream an async iterator of the
chunk bodies (an error event mid-stream arrives as a `ChatFailure` item and ends it).
`ToolCallAssembler` joins a stream's tool-call deltas by index, as a client does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from pagedinfer.entrypoints.openai.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from fastapi import Request

    from pagedinfer.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["ChatFailure", "ToolCallAssembler", "run_chat"]


@dataclass(frozen=True)
class ChatFailure:
    status: int
    message: str
    param: str | None = None


async def run_chat(
    chat: OpenAIServingChat, body: dict[str, Any], raw_request: Request
) -> ChatFailure | dict[str, Any] | AsyncIterator[dict[str, Any] | ChatFailure]:
    """Run `body` (a chat completion request's fields) through the chat handler."""
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        return ChatFailure(
            400, f"{where}: {first.get('msg', 'invalid')}".replace("Value error, ", "")
        )
    except ValueError as exc:
        return ChatFailure(400, str(exc))
    response = await chat.create_chat_completion(request, raw_request)
    if isinstance(response, StreamingResponse):
        return _chunks(response)
    answer = json.loads(bytes(response.body))
    if response.status_code >= 400:
        error = answer.get("error", {})
        return ChatFailure(response.status_code, error.get("message", ""), error.get("param"))
    return dict(answer)


async def _chunks(response: StreamingResponse) -> AsyncIterator[dict[str, Any] | ChatFailure]:
    """The chunk bodies of the chat handler's SSE stream (closing it closes the request)."""
    iterator = response.body_iterator
    buffer = ""
    try:
        async for piece in iterator:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                data = event.removeprefix("data: ")
                if data == "[DONE]":
                    return
                body = json.loads(data)
                if "error" in body:
                    error = body["error"]
                    yield ChatFailure(int(error.get("code") or 500), error.get("message", ""))
                    return
                yield body
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


@dataclass
class ToolCallAssembler:
    """A stream's tool calls, joined by index: id, name and argument text."""

    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def add(self, delta_calls: list[dict[str, Any]]) -> list[tuple[int, bool, str]]:
        """Feed one delta's `tool_calls`; returns (index, is_new, argument text added)."""
        events = []
        for call in delta_calls:
            index = call["index"]
            new = index not in self.calls
            entry = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function = call.get("function", {})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] += function.get("name") or ""
            added = function.get("arguments") or ""
            entry["arguments"] += added
            events.append((index, new, added))
        return events
