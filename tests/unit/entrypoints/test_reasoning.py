"""Reasoning parsers on scripted answers: whole and split at every character, with and
without the opening tag, both conventions; then through the official `openai` client over
the app in process (`fake_engine.py`): `reasoning` / `reasoning_content` in messages and
stream deltas, `include_reasoning`, `chat_template_kwargs`, tool calls parsed from the
content only, and guided decoding told where the reasoning ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app
from pagedinfer.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    split_reasoning,
)
from tests.unit.entrypoints.fake_engine import FakeEngine, openai_client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

# (parser, where the prompt left the answer, answer, (reasoning, content))
CASES = [
    (R1, True, "<think>Add them.</think>\n\n42", ("Add them.", "\n\n42")),
    (R1, True, "Add them.</think>42", ("Add them.", "42")),  # the template opened it
    (R1, True, "Still thinking about", ("Still thinking about", None)),  # cut off
    (R1, False, "42", (None, "42")),  # the prompt closed the block
    (QWEN3, None, "\n<think>\nHmm.\n</think>\n\nYes.", ("\nHmm.\n", "\n\nYes.")),
    (QWEN3, None, "Yes, 4 < 5 </thin", (None, "Yes, 4 < 5 </thin")),  # no block
    (QWEN3, True, "Hmm.</think>Yes.", ("Hmm.", "Yes.")),  # the template opened it
    (QWEN3, False, "<think>late</think>ok", ("late", "ok")),  # the model opens one anyway
    (QWEN3, None, "<thi", (None, "<thi")),  # a prefix of the tag, then the end
    (QWEN3, None, "<think></think>only content", (None, "only content")),
]


@pytest.mark.parametrize(("parser", "start", "text", "expected"), CASES)
def test_split_whole_and_at_every_boundary(parser, start, text, expected) -> None:
    assert split_reasoning(parser, start, text) == expected
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            stream = ReasoningStream(parser, start)
            parts = [*stream.feed(text[:cut]), *stream.feed(text[cut:second])]
            parts += [*stream.feed(text[second:]), *stream.finish()]
            reasoning = "".join(t for kind, t in parts if kind == "reasoning") or None
            content = "".join(t for kind, t in parts if kind == "content") or None
            assert (reasoning, content) == expected, (cut, second, parts)
            assert all(t for _, t in parts), "no empty parts"


def test_where_the_prompt_leaves_the_answer() -> None:
    assert R1.starts_in_reasoning("<|Assistant|><think>\n") is True
    assert R1.starts_in_reasoning("<|Assistant|>") is True  # R1 always reasons
    assert QWEN3.starts_in_reasoning("<|im_start|>assistant\n") is None  # the model decides
    # Qwen3's template with enable_thinking false writes an empty, closed block.
    assert QWEN3.starts_in_reasoning("assistant\n<think>\n\n</think>\n\n") is False
    assert QWEN3.starts_in_reasoning("old <think>x</think> then <think>\n") is True


MODEL = DEFAULT_MODEL_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


def _client(engine: FakeEngine, **flags) -> Iterator[openai.OpenAI]:
    return openai_client(engine, **flags)


def _ask(client, stream: bool, **fields):
    """(reasoning, reasoning_content, content, calls, finish_reason) of choice 0; a stream's
    deltas joined."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2 + 2?"}],
            "max_tokens": 500, **fields}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        extra = choice.message.model_extra or {}
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return (extra.get("reasoning"), extra.get("reasoning_content"), choice.message.content,
                calls, choice.finish_reason)  # fmt: skip
    reasoning = reasoning_content = content = None
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            if extra.get("reasoning"):
                assert not delta.content and not delta.tool_calls  # one kind per delta
                reasoning = (reasoning or "") + extra["reasoning"]
                reasoning_content = (reasoning_content or "") + extra["reasoning_content"]
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, reasoning_content, content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_in_messages_and_deltas(engine, stream) -> None:
    for client in _client(engine, reasoning_parser="qwen3"):
        engine.replies = ["<think>2 and 2 make 4.</think>\n\nIt is 4."]
        assert _ask(client, stream) == (
            "2 and 2 make 4.", "2 and 2 make 4.", "\n\nIt is 4.", [], "stop")  # fmt: skip
        engine.replies = ["It is 4."]  # no block: all content
        assert _ask(client, stream)[:3] == (None, None, "It is 4.")
        engine.replies = ["<think>2 and 2 make 4.</think>It is 4."]
        assert _ask(client, stream, extra_body={"include_reasoning": False})[:3] == (
            None,
            None,
            "It is 4.",
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_the_template_opened(engine, stream) -> None:
    """`chat_template_kwargs` reach the template: here the fake writes them into the prompt,
    so a variable holding `<think>` leaves the block open where the answer starts."""
    for client in _client(engine, reasoning_parser="deepseek_r1"):
        engine.replies = ["Four.</think>4"]
        kwargs = {"opening": "<think>", "enable_thinking": True}
        assert _ask(client, stream, extra_body={"chat_template_kwargs": kwargs})[:3] == (
            "Four.", "Four.", "4")  # fmt: skip
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        assert prompt.startswith("enable_thinking=True\nopening=<think>\n")
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: tools"):
            _ask(client, stream, extra_body={"chat_template_kwargs": {"tools": []}})


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_after_the_reasoning(engine, stream) -> None:
    flags = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
             "enable_auto_tool_choice": True}  # fmt: skip
    for client in _client(engine, **flags):
        # A call written inside the reasoning is thought, not a call.
        engine.replies = [
            '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '</tool_call>? No, Paris.</think><tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}</tool_call>'
        ]
        reasoning, _, content, calls, finish = _ask(client, stream, tools=[WEATHER])
        assert reasoning.startswith("Maybe <tool_call>") and reasoning.endswith("Paris.")
        assert calls == [("get_weather", '{"city": "Paris"}')] and finish == "tool_calls"
        assert not content


def test_guided_decoding_is_told_where_the_reasoning_ends(engine) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for client in _client(engine, reasoning_parser="deepseek_r1"):
        engine.replies = ['Paris, then.</think>{"city": "Paris"}']
        reasoning, _, _, calls, _ = _ask(client, False, tools=[WEATHER], tool_choice=named)
        assert reasoning == "Paris, then." and calls == [("get_weather", '{"city": "Paris"}')]
        (params,) = engine.params.values()
        assert params.structured_outputs.reasoning_end == "</think>"
    for client in _client(engine, reasoning_parser="qwen3"):  # undecided: the grammar rules
        engine.replies = ['{"city": "Paris"}']
        _ask(client, False, tools=[WEATHER], tool_choice=named)
        assert list(engine.params.values())[-1].structured_outputs.reasoning_end is None
    for client in _client(engine):  # no parser: nothing changes
        engine.replies = ['{"city": "Paris"}']
        _ask(client, False, tools=[WEATHER], tool_choice=named)
        assert list(engine.params.values())[-1].structured_outputs.reasoning_end is None


def test_an_unknown_parser_is_refused_by_name(engine) -> None:
    with pytest.raises(ValueError, match="--reasoning-parser 'r2'"):
        build_app(engine, MODEL, reasoning_parser="r2")
