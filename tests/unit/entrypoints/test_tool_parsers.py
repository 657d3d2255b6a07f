"""The tool-call parsers on scripted model outputs: plain text, one call, parallel calls and
malformed calls (content, no crash) in each format, and the same answer streamed in two
pieces split at every character and one character at a time. Also the guided-decoding side
of `tool_choice` (`plan_tools`): schemas, structural tags and the 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedinfer.entrypoints.openai.protocol import ChatCompletionRequest
from pagedinfer.entrypoints.openai.tool_choice import plan_tools, required_schema
from pagedinfer.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    ToolParser,
    parse_tool_calls,
)

W = FunctionCall("get_weather", '{"city": "Paris"}')
T = FunctionCall("get_time", '{"tz": "UTC", "n": [1, 2]}')
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC", "n": [1, 2]}}'

# (parser, output, content, calls)
CASES = [
    ("hermes", "The sky is blue.\n", "The sky is blue.\n", []),
    ("hermes", "a < b, and <tool", "a < b, and <tool", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [W]),
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n"
     "</tool_call>\n", "Let me check.", [W, T]),
    ("hermes", f"<tool_call>{WEATHER}", None, [W]),  # stopped before the closing tag
    ("hermes", '<tool_call>{"name": get_weather}</tool_call> then text',
     '<tool_call>{"name": get_weather}</tool_call> then text', []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call> Done.", "Done.", [W]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "</tool_call>"',
     '<tool_call>{"name": "f", "arguments": {"a": "</tool_call>"', []),
    ("qwen", f"<tool_call>{TIME}</tool_call>", None, [T]),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC", "n": [1, 2]}}', None, [W, T]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", "Hello there", "Hello there", []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None, [W, T]),
    ("mistral", f"Checking. [TOOL_CALLS] [{WEATHER}]", "Checking.", [W]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC", "n": [1, 2]}', None, [W, T]),
    ("mistral", "[TOOL_CALLS][{\"name\": 1}]", "[{\"name\": 1}]", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]nope", "get_weather[ARGS]nope", []),
    ("pythonic", "No calls [here].", "No calls [here].", []),
    ("pythonic", '[get_weather(city="Paris")]', None, [W]),
    ("pythonic", "<|python_start|>[get_weather(city='Paris'), get_time(tz=\"UTC\", n=[1, 2])]"
     "<|python_end|>", None, [W, T]),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", "[get_weather(city=x)]", "[get_weather(city=x)]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
]  # fmt: skip


def _joined(items: list) -> tuple[str | None, list[FunctionCall]]:
    content = "".join(i for i in items if isinstance(i, str))
    calls = [i for i in items if isinstance(i, FunctionCall)]
    return (content if content or not calls else None), calls


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[FunctionCall]]:
    stream = ToolCallStream(parser)
    items = [i for piece in pieces for i in stream.feed(piece)] + stream.finish()
    return _joined(items)


@pytest.mark.parametrize("name, output, content, calls", CASES)
def test_parsers_on_scripted_outputs_streamed_or_not(name, output, content, calls) -> None:
    cls = TOOL_PARSERS[name]
    assert parse_tool_calls(cls(), output) == (content, calls)
    for cut in range(len(output) + 1):
        assert _streamed(cls(), [output[:cut], output[cut:]]) == (content, calls), cut
    assert _streamed(cls(), list(output)) == (content, calls)


def test_stream_sends_content_before_a_call_finishes() -> None:
    """Content is not held back for the whole answer: only what may start a marker is."""
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert stream.feed("Let me look") == ["Let me look"]
    assert stream.feed(" that up <tool_") == [" that up"]
    assert stream.feed('call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    assert stream.feed("</tool_call>") == [W]
    assert stream.finish() == []


def test_required_and_named_formats() -> None:
    out = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time",' \
          '"parameters":{"tz":"UTC","n":[1,2]}}]'  # fmt: skip
    for parser in (RequiredToolParser,):
        assert parse_tool_calls(parser(), out) == (None, [W, T])
        for cut in range(len(out) + 1):
            assert _streamed(parser(), [out[:cut], out[cut:]]) == (None, [W, T])
    # Cut by max_tokens: the calls that closed are calls, the rest is content.
    assert parse_tool_calls(RequiredToolParser(), out[:70]) == (out[54:70], [W])
    assert parse_tool_calls(NamedToolParser("get_weather"), '{"city": "Paris"}') == (None, [W])
    assert parse_tool_calls(NamedToolParser("f"), '{"city": "Pa') == ('{"city": "Pa', [])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_schema_accepts_calls_and_only_calls() -> None:
    request = _request(tools=TOOLS)
    schema = required_schema(request.tools, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}], [{"name": "get_time"}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_schema(request.tools, parallel=False))


def test_plan_tools() -> None:
    assert plan_tools(_request(), None, False).new_parser is None
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), None, False).new_parser is None
    with pytest.raises(ValueError, match="--enable-auto-tool-choice and --tool-call-parser"):
        plan_tools(_request(tools=TOOLS), None, False)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        plan_tools(_request(tools=TOOLS, tool_choice="auto"), "hermes", False)
    auto = plan_tools(_request(tools=TOOLS), "mistral", True)
    assert auto.structured_outputs is None and auto.keep_special_tokens
    assert [t["function"]["name"] for t in auto.template_tools] == ["get_weather", "get_time"]
    required = plan_tools(_request(tools=TOOLS, tool_choice="required"), None, False)
    assert required.structured_outputs.disable_any_whitespace
    assert required.structured_outputs.json["minItems"] == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(_request(tools=TOOLS, tool_choice=named), None, False)
    assert plan.structured_outputs.json == TOOLS[0]["function"]["parameters"]
    with pytest.raises(ValueError, match="'nope', which is not among the tools"):
        plan_tools(_request(tools=TOOLS, tool_choice={**named, "function": {"name": "nope"}}),
                   None, False)  # fmt: skip
    with pytest.raises(ValueError, match="needs tools"):
        plan_tools(_request(tool_choice="required"), None, False)
    with pytest.raises(ValueError, match="constrains the output itself"):
        plan_tools(_request(tools=TOOLS, tool_choice="required",
                            response_format={"type": "json_object"}), None, False)  # fmt: skip
    with pytest.raises(ValueError, match="same name"):
        plan_tools(_request(tools=TOOLS + TOOLS[:1], tool_choice="required"), None, False)


def test_strict_tools_get_a_structural_tag() -> None:
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    plan = plan_tools(_request(tools=strict), "hermes", True)
    tag = json.loads(json.dumps(plan.structured_outputs.structural_tag))
    assert tag["triggers"] == ["<tool_call>"]
    assert tag["structures"] == [{
        "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
        "schema": TOOLS[0]["function"]["parameters"], "end": "}\n</tool_call>"}]  # fmt: skip
    with pytest.raises(ValueError, match="structural tag .* parser is 'pythonic'"):
        plan_tools(_request(tools=strict), "pythonic", True)
