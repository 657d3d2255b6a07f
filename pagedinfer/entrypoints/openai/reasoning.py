"""Reasoning parsers: a chat answer's `<think>...</think>` block -> `reasoning`, the rest
-> `content` (vLLM's `--reasoning-parser`).

Two conventions, both with the `<think>` / `</think>` markers:
- `deepseek_r1`: the model always reasons first. Text before `</think>` is reasoning, also
  when no `<think>` opened it (the template wrote it, or the model omits it); an answer cut
  off before `</think>` is all reasoning.
- `qwen3`: reasoning is optional (Qwen3's `enable_thinking`). The answer reasons only if the
  block is open where it starts: the model writes `<think>` first, or the prompt ends inside
  an open block (templates that open it themselves); otherwise it is all content.

Whether the prompt left a block open (the last marker in the rendered prompt is `<think>`)
decides where the answer starts for both; `deepseek_r1` also starts in reasoning when the
prompt has no marker at all. A prompt that closed the block (Qwen3's template with
`enable_thinking: false` writes an empty `<think>\n\n</think>`) starts in content.

`ReasoningStream` splits text as it streams, holding back a suffix that may be the start of
`</think>` (or of `<think>` at the very start) until the next text settles it. Guided
decoding and tool parsing see only the content: the server passes `</think>` to the engine
as `StructuredOutputsParams.reasoning_end`, and the tool parser is fed the content deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "split_reasoning"]


@dataclass(frozen=True)
class ReasoningParser:
    """One convention: its markers and whether an unmarked answer reasons."""

    name: str
    reasons_by_default: bool
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def starts_in_reasoning(self, prompt_text: str) -> bool | None:
        """True: the prompt left a block open; False: it closed one (or, for a parser that
        does not reason by default, has none); None: undecided until the answer's start
        (`<think>` there opens a block)."""
        opened, closed = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if opened > closed:
            return True
        if closed >= 0:
            return False
        return True if self.reasons_by_default else None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", reasons_by_default=True),
    "qwen3": ReasoningParser("qwen3", reasons_by_default=False),
}


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits one answer's text, fed in pieces, into ("reasoning" | "content", text) parts.

    `feed` returns what the new text settles; `finish` what was held back. Joined, the
    parts are the answer minus the markers that delimit the block."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool | None) -> None:
        self.parser = parser
        # None: at the answer's start, a `<think>` may still open a block.
        self.state: str | None = (
            None if in_reasoning is None else ("reasoning" if in_reasoning else "content")
        )
        self.at_start = True  # a `<think>` right at the start opens a block in any state
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        if self.at_start:
            stripped = self.buffer.lstrip()
            if self.parser.start.startswith(stripped) and len(stripped) < len(self.parser.start):
                return out  # maybe `<think>`: wait
            self.at_start = False
            if stripped.startswith(self.parser.start):  # opens a block, whatever the prompt
                self.buffer = stripped[len(self.parser.start) :]
                self.state = "reasoning"
            elif self.state is None:
                self.state = "content"
        if self.state == "reasoning":
            at = self.buffer.find(self.parser.end)
            if at < 0:
                keep = _held(self.buffer, self.parser.end)
                piece, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                if piece:
                    out.append(("reasoning", piece))
                return out
            if at:
                out.append(("reasoning", self.buffer[:at]))
            self.buffer = self.buffer[at + len(self.parser.end) :]
            self.state = "content"
        if self.buffer:
            out.append(("content", self.buffer))
            self.buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back: a partial marker at the end is text after all."""
        if not self.buffer:
            return []
        text, self.buffer = self.buffer, ""
        return [(self.state or "content", text)]


def split_reasoning(
    parser: ReasoningParser, in_reasoning: bool | None, text: str
) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None where there is none."""
    stream = ReasoningStream(parser, in_reasoning)
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    return reasoning or None, content or None
