"""The tool-call formats models write, one `ToolParser` each (see `base.py` for the contract).

- `hermes` (Hermes 2 Pro, Qwen 2.5 / Qwen 3): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks anywhere in the text, content around them;
- `llama3_json` (Llama 3.1 / 3.2): the output is one or more `{"name": ..., "parameters":
  {...}}` objects (separated by `;`), optionally after `<|python_tag|>`; an output that does
  not start so is plain content;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (tokenizers
  before v11) or `name[ARGS]{...}` (v11 and later, one `[TOOL_CALLS]` per call), content
  before it;
- `pythonic` (Llama 3.2 / 4, ToolACE): the output is a Python list of calls with keyword
  arguments, `[get_weather(city="Paris"), ...]`, optionally inside `<|python_start|>` ...
  `<|python_end|>`; arguments must be literals (they become JSON).

And the two formats of forced calls, whose output guided decoding shapes (`tool_choice.py`):
`required` (a JSON list of `{"name", "parameters"}` objects) and `named` (the arguments
object alone).
"""

from __future__ import annotations

import ast
import json
import re
from typing import ClassVar

from pagedinfer.entrypoints.openai.tool_parsers.base import (
    FunctionCall,
    Item,
    ToolParser,
    balanced_end,
    call_from_json,
    held_prefix,
    loads_or_none,
)

__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "PythonicToolParser",
    "RequiredToolParser",
]


def _lead(text: str) -> int:
    """The length of `text`'s leading whitespace."""
    return len(text) - len(text.lstrip())


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        at = tail.find(self.START)
        if at < 0:  # content, less what may be the start of a marker
            keep = 0 if final else held_prefix(tail, self.START)
            return [tail[: len(tail) - keep]], len(tail) - keep
        if at > 0:
            return [tail[:at]], at
        end = tail.find(self.END)
        if end < 0 and not final:
            return [], 0
        body = tail[len(self.START) : end if end >= 0 else len(tail)]
        used = end + len(self.END) if end >= 0 else len(tail)
        call = call_from_json(loads_or_none(body.strip()))
        return [call if call is not None else tail[:used]], used


class _LeadingFormat(ToolParser):
    """A format whose calls, if any, start the output (after whitespace and an optional
    special token): decides once, then scans calls or passes content."""

    TAGS: ClassVar[tuple[str, ...]] = ()
    OPEN: ClassVar[str] = "{"

    def __init__(self) -> None:
        self.mode = "undecided"  # then "calls" or "text"

    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        if self.mode == "text":
            return [tail], len(tail)
        if self.mode == "undecided":
            lead = _lead(tail)
            rest = tail[lead:]
            if not final and (not rest or any(t.startswith(rest) for t in self.TAGS)):
                return [], 0
            tag = next((t for t in self.TAGS if rest.startswith(t)), "")
            if tag or rest.startswith(self.OPEN):
                self.mode = "calls"
                used = lead + len(tag)
                items, more = self.scan_calls(tail[used:], final) if used < len(tail) else ([], 0)
                return items, used + more
            self.mode = "text"
            return [tail], len(tail)
        return self.scan_calls(tail, final)

    def scan_calls(self, tail: str, final: bool) -> tuple[list[Item], int]:
        raise NotImplementedError

    def as_text(self, tail: str) -> tuple[list[Item], int]:
        """The rest of the output is content."""
        self.mode = "text"
        return [tail], len(tail)


class Llama3JsonToolParser(_LeadingFormat):
    name: ClassVar[str] = "llama3_json"
    needs_special_tokens: ClassVar[bool] = True
    TAGS: ClassVar[tuple[str, ...]] = ("<|python_tag|>",)

    def scan_calls(self, tail: str, final: bool) -> tuple[list[Item], int]:
        skip = len(tail) - len(tail.lstrip().lstrip(";").lstrip())
        if skip:
            return [], skip  # whitespace and separators between calls
        if not tail.startswith("{"):
            return self.as_text(tail)
        end = balanced_end(tail)
        if end is None:
            return self.as_text(tail) if final else ([], 0)
        call = call_from_json(loads_or_none(tail[:end]), ("parameters", "arguments"))
        return ([call], end) if call is not None else self.as_text(tail)


_MISTRAL_NAME = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


_MISTRAL_PARTIAL = re.compile(r"[A-Za-z0-9_.\-]*(\[[A-Z_]*(\][A-Za-z0-9]*(\[[A-Z_]*)?)?)?")


class MistralToolParser(ToolParser):
    name: ClassVar[str] = "mistral"
    needs_special_tokens: ClassVar[bool] = True
    MARKER = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self.in_calls = False

    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        if not self.in_calls:
            at = tail.find(self.MARKER)
            if at < 0:
                keep = 0 if final else held_prefix(tail, self.MARKER)
                return [tail[: len(tail) - keep]], len(tail) - keep
            if at > 0:
                return [tail[:at]], at
            self.in_calls = True
            return [], len(self.MARKER)
        lead = _lead(tail)
        rest = tail[lead:]
        if rest.startswith(self.MARKER):
            return [], lead + len(self.MARKER)
        if not rest or (not final and self.MARKER.startswith(rest)):
            return ([], len(tail)) if final else ([], 0)
        if rest[0] in "[{":  # a JSON list of calls, or one call
            end = balanced_end(rest)
            if end is None:
                return self._text(tail) if final else ([], 0)
            obj = loads_or_none(rest[:end])
            calls = [call_from_json(o) for o in (obj if isinstance(obj, list) else [obj])]
            if not calls or None in calls:
                return self._text(tail[: lead + end], lead + end)
            return [c for c in calls if c is not None], lead + end
        match = _MISTRAL_NAME.match(rest)
        if match is None:
            if not final and _MISTRAL_PARTIAL.fullmatch(rest):
                return [], 0  # the name, or the start of [ARGS], is still coming
            return self._text(tail)
        start = match.end()
        if start == len(rest) or rest[start] != "{":
            if start == len(rest) and not final:
                return [], 0
            return self._text(tail)
        end = balanced_end(rest, start)
        if end is None:
            return self._text(tail) if final else ([], 0)
        args = loads_or_none(rest[start:end])
        if not isinstance(args, dict):
            return self._text(tail[: lead + end], lead + end)
        return [FunctionCall(match.group(1), json.dumps(args, ensure_ascii=False))], lead + end

    def _text(self, text: str, used: int | None = None) -> tuple[list[Item], int]:
        """`text` is content; what follows is content until the next marker."""
        self.in_calls = False
        return [text], len(text) if used is None else used


class PythonicToolParser(_LeadingFormat):
    name: ClassVar[str] = "pythonic"
    TAGS: ClassVar[tuple[str, ...]] = ("<|python_start|>",)
    OPEN: ClassVar[str] = "["
    END_TAG = "<|python_end|>"

    def scan_calls(self, tail: str, final: bool) -> tuple[list[Item], int]:
        lead = _lead(tail)
        if lead:
            return [], lead
        if not tail.startswith("["):
            return self.as_text(tail)
        end = balanced_end(tail, quotes="\"'")
        if end is None:
            return self.as_text(tail) if final else ([], 0)
        calls = _python_calls(tail[:end])
        if calls is None:
            return self.as_text(tail)
        rest = tail[end:]
        lead = _lead(rest)
        if rest[lead:].startswith(self.END_TAG):
            end += lead + len(self.END_TAG)
        elif not final and self.END_TAG.startswith(rest[lead:]):
            return [], 0  # wait: the closing tag may follow
        self.mode = "text"
        return list(calls), end


def _python_calls(source: str) -> list[FunctionCall] | None:
    """The calls of a Python list expression `[f(a=1), g()]`, or None if it is anything
    else (positional arguments, or arguments that are not literals, included)."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, SyntaxError, TypeError):
                return None
        try:
            calls.append(FunctionCall(name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes)
            return None
    return calls


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: a JSON list of `{"name", "parameters"}` objects, each
    emitted as soon as it closes."""

    name: ClassVar[str] = "required"

    def __init__(self) -> None:
        self.state = "start"  # "items" inside the list, "done" after it

    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        if self.state == "done":
            return [tail], len(tail)
        skip = len(tail) - len(tail.lstrip())
        if self.state == "items":
            skip = len(tail) - len(tail.lstrip().lstrip(",").lstrip())
        if skip:
            return [], skip
        if self.state == "start":
            if not tail.startswith("["):
                self.state = "done"
                return [tail], len(tail)
            self.state = "items"
            return [], 1
        if tail.startswith("]"):
            self.state = "done"
            return [], 1
        end = balanced_end(tail) if tail[0] in "{[" else None
        if end is None:
            if final or tail[0] not in "{[":
                self.state = "done"
                return [tail], len(tail)
            return [], 0
        call = call_from_json(loads_or_none(tail[:end]), ("parameters", "arguments"))
        if call is None:
            self.state = "done"
            return [tail], len(tail)
        return [call], end


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the output is that function's arguments object."""

    name: ClassVar[str] = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        if not final:
            return [], 0
        args = loads_or_none(tail)
        if not isinstance(args, dict):
            return [tail], len(tail)
        return [FunctionCall(self.function, tail.strip())], len(tail)
