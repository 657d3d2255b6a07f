"""The tool-call parser seam: a model's output text -> content and function calls, streamed.

A `ToolParser` (one per choice: parsers keep state) reads the output as it grows. Its one
method, `scan(tail, final)`, looks at the text not yet consumed and returns what it can
settle from its start (content strings and `FunctionCall`s) and how many characters that
consumed; text that may still become part of a call (an unfinished call, or a prefix of a
call's opening marker) is left for the next scan. `ToolCallStream` drives a parser over
deltas, and `parse_tool_calls` over a whole output with the same stream, so a streamed
answer is exactly the non-streamed one, whatever the chunk boundaries.

A call is emitted once its text is complete and parses (a streamed call is never taken
back); a call that does not parse is returned as content, never dropped and never a crash.
Whitespace beside a call (the newline between two `<tool_call>` blocks, or before the
first) is not content. Used by `serving_chat.py` through `tool_choice.py`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "FunctionCall",
    "ToolCallStream",
    "ToolParser",
    "balanced_end",
    "call_from_json",
    "held_prefix",
    "loads_or_none",
    "parse_tool_calls",
]


@dataclass(frozen=True)
class FunctionCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


Item = str | FunctionCall
"""What a scan settles: content text, or a call."""


class ToolParser(ABC):
    """Turns one choice's output into content and calls (see the module docstring)."""

    name: ClassVar[str]
    """The `--tool-call-parser` value."""
    needs_special_tokens: ClassVar[bool] = False
    """Whether the call markers are special tokens, which the output text must then keep
    (the request's `skip_special_tokens` is turned off)."""

    @abstractmethod
    def scan(self, tail: str, final: bool) -> tuple[list[Item], int]:
        """What `tail` (the output not yet consumed) settles from its start, and how many of
        its characters that consumed (0: wait for more text). With `final` (the output is
        complete), everything must be consumed: an unfinished call becomes content."""


class ToolCallStream:
    """Feeds one choice's output deltas to its parser; returns the settled items."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._buffer = ""
        self._space = ""  # whitespace held back: content, unless a call or the end follows
        self._after_call = False
        self.num_calls = 0

    def feed(self, delta: str) -> list[Item]:
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> list[Item]:
        items = self._drain(final=True)
        assert not self._buffer, "a parser left text at the end of the output"
        if self._space and not self._after_call:
            items.append(self._space)
        self._space = ""
        return items

    def _drain(self, final: bool) -> list[Item]:
        out: list[Item] = []
        while self._buffer:
            items, used = self.parser.scan(self._buffer, final)
            assert 0 <= used <= len(self._buffer)
            self._buffer = self._buffer[used:]
            for item in items:
                self._settle(item, out)
            if used == 0:
                assert not final, "a parser consumed nothing at the end of the output"
                break
        return _merged(out)

    def _settle(self, item: Item, out: list[Item]) -> None:
        if isinstance(item, FunctionCall):
            self._space = ""  # whitespace before a call is not content
            self._after_call = True
            self.num_calls += 1
            out.append(item)
            return
        text = self._space + item
        body = text.rstrip()
        if not body:
            self._space = text
            return
        if self._after_call:
            text = text.lstrip()  # whitespace after a call is not content either
            body = text.rstrip()
        self._after_call = False
        out.append(body)
        self._space = text[len(body) :]


def _merged(items: list[Item]) -> list[Item]:
    """Adjacent content strings joined."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        else:
            out.append(item)
    return out


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[FunctionCall]]:
    """A whole output's content (None when it has none beside its calls) and calls."""
    stream = ToolCallStream(parser)
    items = stream.feed(text) + stream.finish()
    content = "".join(i for i in items if isinstance(i, str))
    calls = [i for i in items if isinstance(i, FunctionCall)]
    return (content if content or not calls else None), calls


# ---- helpers the formats share ----------------------------------------------------------


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (text that
    may become the marker once more arrives)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_CLOSE = {"{": "}", "[": "]", "(": ")"}


def balanced_end(text: str, start: int = 0, quotes: str = '"') -> int | None:
    """The index just past the bracket that closes the one at `text[start]`, skipping
    strings (delimited by any of `quotes`, backslash escapes honoured); None if `text` ends
    first. Brackets need not match in kind: the parse that follows rejects what is wrong."""
    assert text[start] in _CLOSE
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSE:
            depth += 1
        elif ch in "}])":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def call_from_json(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> FunctionCall | None:
    """A call from a parsed `{"name": ..., "arguments": {...}}` (the arguments under the
    first of `argument_keys` present; an object, or JSON text of one), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        return FunctionCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))


def loads_or_none(text: str) -> Any:
    """`json.loads(text)`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
