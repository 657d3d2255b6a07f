"""Tool-call parsers: `--tool-call-parser NAME` -> the class that reads that format."""

from __future__ import annotations

from pagedinfer.entrypoints.openai.tool_parsers.base import (
    FunctionCall,
    ToolCallStream,
    ToolParser,
    parse_tool_calls,
)
from pagedinfer.entrypoints.openai.tool_parsers.formats import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    PythonicToolParser,
    RequiredToolParser,
)

__all__ = [
    "TOOL_PARSERS",
    "FunctionCall",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCallStream",
    "ToolParser",
    "parse_tool_calls",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen 2.5 and 3 write Hermes's format
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
"""The `--tool-call-parser` values (vLLM's names; `qwen` is an alias of `hermes`)."""
