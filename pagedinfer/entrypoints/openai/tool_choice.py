"""A chat request's `tools` and `tool_choice` -> what the chat handler does with them.

- `none` (the default without tools): tools are not shown to the template and the output
  is content;
- `auto` (the default with tools): the template renders the tools and the server's
  `--tool-call-parser` reads calls out of the output; a server started without
  `--enable-auto-tool-choice` and a parser answers 400 naming both flags. Tools with
  `strict: true` are constrained by a structural tag (grammar from a call's opening marker
  to its end) where the parser's format has one;
- `required`: guided decoding forces a JSON list of one or more `{"name", "parameters"}`
  objects over the tools (at most one with `parallel_tool_calls: false`); read by
  `RequiredToolParser`;
- a named function: guided decoding forces its arguments object; read by `NamedToolParser`.

Forced calls use compact JSON (`disable_any_whitespace`): a small model given free
whitespace can emit newlines until `max_tokens`. They also close within the budget
(`close_within_max_tokens`): an answer that would run past `max_tokens` (a small model
looping inside a string, or repeating a call) has its JSON completed by the engine in its
last tokens, so it always holds at least one whole call whose arguments validate; such an
answer says `finish_reason` "length". vLLM answers `finish_reason` "stop" for a
named choice; here any answer whose calls ended it says "tool_calls", which is what agent
loops test for. Built by `serving_chat.py` per request (`plan_tools`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedinfer.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from pagedinfer.entrypoints.openai.serving_engine import request_structured_outputs
from pagedinfer.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
)
from pagedinfer.sampling_params import StructuredOutputsParams

__all__ = [
    "AUTO_TOOL_FLAGS",
    "ToolPlan",
    "plan_tools",
    "required_schema",
    "structural_tag",
    "tools_system_message",
]

AUTO_TOOL_FLAGS = "--enable-auto-tool-choice and --tool-call-parser NAME"

_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request handles tools."""

    new_parser: Callable[[], ToolParser] | None
    """A fresh parser per choice; None: the output is all content."""
    structured_outputs: StructuredOutputsParams | None
    """The guided decoding the tool choice imposes (None: the request's own, if any)."""
    template_tools: list[dict[str, Any]] | None
    """The tools as the chat template sees them (`tools=`), or None."""
    keep_special_tokens: bool = False
    """The parser's markers are special tokens: the output text must keep them."""
    fallback_system: str | None = None
    """For forced calls: a system message describing the tools, for chat templates that
    do not render `tools` (see `tools_system_message`)."""


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _NO_ARGS


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each `{"name": one of the tools, "parameters": its schema}`."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tools_system_message(tools: list[ChatTool], answer: str) -> str:
    """A system message listing the tools, for a forced call under a chat template that
    ignores `tools` (SmolLM2's, many base models'). vLLM hands the tools to the template
    only; there such a model fills a call's arguments knowing neither the tool's purpose nor
    its parameters, and a small one measured looping inside a string argument until
    max_tokens in 6 of 64 requests. llama.cpp's server does the same for such templates."""
    listed = json.dumps(
        [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in tools],
        ensure_ascii=False,
    )
    return f"You have these tools (JSON): {listed}\n{answer}"


def structural_tag(parser: str, tools: list[ChatTool]) -> dict[str, Any] | None:
    """A structural tag constraining the arguments of the `strict` tools in `parser`'s
    format (vLLM's `{"structures", "triggers"}`), or None if the format has none."""
    strict = [t for t in tools if t.function.strict]
    if parser in ("hermes", "qwen"):
        begin, end, trigger = (
            '<tool_call>\n{{"name": {}, "arguments": ',
            "}\n</tool_call>",
            ("<tool_call>"),
        )
    elif parser == "llama3_json":
        begin, end, trigger = '{{"name": {}, "parameters": ', "}", '{"name": '
    else:
        return None
    structures = [
        {
            "begin": begin.format(json.dumps(t.function.name, ensure_ascii=False)),
            "schema": _parameters(t),
            "end": end,
        }
        for t in strict
    ]
    return {"structures": structures, "triggers": [trigger]}


def plan_tools(request: ChatCompletionRequest, parser: str | None, auto_enabled: bool) -> ToolPlan:
    """What `request`'s tools ask for, given the server's `--tool-call-parser` and
    `--enable-auto-tool-choice`; ValueError (a 400) for what cannot be served."""
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan(None, None, None)
    if not tools:
        raise ValueError(f"tool_choice {_choice_name(choice)} needs tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: two functions have the same name")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    guided = request_structured_outputs(request) is not None
    if choice == "auto":
        if parser is None or not auto_enabled:
            raise ValueError(
                '"auto" tool choice (the default when tools are given) requires the server '
                f'to be started with {AUTO_TOOL_FLAGS}; or send tool_choice "required", a '
                'named function, or "none"'
            )
        cls = TOOL_PARSERS[parser]
        structured = None
        if any(t.function.strict for t in tools):
            tag = structural_tag(parser, tools)
            if tag is None:
                raise ValueError(
                    f"strict tools need a tool-call format with a structural tag (hermes, "
                    f"qwen, llama3_json); this server's parser is {parser!r}"
                )
            if guided:
                raise ValueError("strict tools cannot be combined with response_format")
            structured = StructuredOutputsParams(structural_tag=tag)
        return ToolPlan(cls, structured, template_tools, cls.needs_special_tokens)
    if guided:
        raise ValueError(
            f"tool_choice {_choice_name(choice)} constrains the output itself: give no "
            "response_format or structured_outputs beside it"
        )
    if choice == "required":
        schema = required_schema(tools, request.parallel_tool_calls)
        answer = (
            'Answer with the calls as a JSON list of {"name": ..., "parameters": {...}}.'
            if request.parallel_tool_calls
            else 'Answer with one call as [{"name": ..., "parameters": {...}}].'
        )
        return ToolPlan(
            RequiredToolParser,
            StructuredOutputsParams(
                json=schema, disable_any_whitespace=True, close_within_max_tokens=True
            ),
            template_tools,
            fallback_system=tools_system_message(tools, answer),
        )
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    tool = tools[names.index(name)]
    return ToolPlan(
        lambda: NamedToolParser(name),
        StructuredOutputsParams(
            json=_parameters(tool), disable_any_whitespace=True, close_within_max_tokens=True
        ),
        template_tools,
        fallback_system=tools_system_message(
            tools, f"Call {name}: answer with its arguments as a JSON object."
        ),
    )


def _choice_name(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else "naming a function"
