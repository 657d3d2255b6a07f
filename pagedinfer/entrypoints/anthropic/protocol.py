"""`/v1/messages` request bodies as typed values: each content block a model chosen by its
`type`, each message by its `role` (a user sends text and tool results, an assistant text,
tool calls and its earlier thinking), tools and tool choices by their `type`. The OpenAPI
document is generated from these, so what it admits is what the handler takes.

Unknown fields of a block, tool or choice are refused by name, as OpenAI's request fields
are; `cache_control` (Anthropic's prompt-caching hint) is taken and ignored, since the
prefix cache needs no hint.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AnyChoice",
    "AssistantMessage",
    "AutoChoice",
    "CallingChoice",
    "ContentBlock",
    "Message",
    "NamedChoice",
    "TextBlock",
    "ThinkingBlock",
    "ToolChoice",
    "ToolDefinition",
    "ToolResultBlock",
    "ToolUseBlock",
    "UserMessage",
]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    cache_control: dict[str, Any] | None = None


class TextBlock(_Part):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Part):
    """A call an assistant's earlier turn made."""

    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Part):
    """The result of an earlier call, sent by the user."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Part):
    """An assistant's earlier reasoning (dropped, as chat templates drop it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]
ContentBlock = TextBlock | ToolResultBlock | ToolUseBlock | ThinkingBlock


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ToolDefinition(_Part):
    """A custom tool (Anthropic's server tools, `web_search` and the like, are not served)."""

    type: Literal["custom"] = "custom"
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]


class CallingChoice(BaseModel):
    """A choice that lets the model call tools (it may forbid parallel calls)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    disable_parallel_tool_use: bool = False


class AutoChoice(CallingChoice):
    type: Literal["auto"]


class AnyChoice(CallingChoice):
    type: Literal["any"]


class NamedChoice(CallingChoice):
    type: Literal["tool"]
    name: str = Field(min_length=1)


class NoChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoChoice, Field(discriminator="type")]
