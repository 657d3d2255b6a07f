"""Tool calls through the official `openai` client, over the app in process on `FakeEngine`
(`fake_engine.py`) scripted to answer as a model of each format would: `tool_choice` "auto"
with each `--tool-call-parser`, streamed (one character per delta) and not; the 400 without
the flags; the history's calls reaching the template; what guided decoding is asked for."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME
from tests.unit.entrypoints.fake_engine import FakeEngine, openai_client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

MODEL = DEFAULT_MODEL_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'

# parser -> (one call, two calls, malformed) as that model family writes them
SCRIPTS = {
    "hermes": (f"<tool_call>\n{CALL}\n</tool_call>",
               f"Checking both.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{OSLO}\n"
               "</tool_call>", "<tool_call>{oops}</tool_call>"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"name": 7}'),
    "mistral": (f"[TOOL_CALLS][{CALL}]", f"Checking both.[TOOL_CALLS][{CALL}, {OSLO}]",
                "[TOOL_CALLS]get_weather[ARGS]{"),
    "pythonic": ('[get_weather(city="Paris")]',
                 '[get_weather(city="Paris"), get_weather(city="Oslo")]', "[get_weather(Paris)]"),
}  # fmt: skip


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


def _client(engine: FakeEngine, **flags) -> Iterator[openai.OpenAI]:
    return openai_client(engine, **flags)


def _ask(client, stream: bool, **fields):
    """(content, [(name, arguments)], finish_reason) of choice 0, the stream's deltas
    accumulated as a client does (by call index)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "max_tokens": 500, **fields}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, ids, finish = None, {}, {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                if call.id:
                    assert call.index not in ids and call.function.name, "a call starts once"
                    ids[call.index] = call.id
                calls[call.index] = (name + (call.function.name or ""),
                                     args + (call.function.arguments or ""))  # fmt: skip
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls))) and len(set(ids.values())) == len(calls)
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_with_each_parser(engine, parser, stream) -> None:
    one, two, malformed = SCRIPTS[parser]
    paris = ("get_weather", json.dumps({"city": "Paris"}))
    oslo = ("get_weather", json.dumps({"city": "Oslo"}))
    for client in _client(engine, tool_call_parser=parser, enable_auto_tool_choice=True):
        engine.replies = ["It is sunny."]
        assert _ask(client, stream) == ("It is sunny.", [], "stop")
        engine.replies = [one]
        assert _ask(client, stream) == (None, [paris], "tool_calls")
        engine.replies = [two]
        content = None if parser in ("llama3_json", "pythonic") else "Checking both."
        assert _ask(client, stream) == (content, [paris, oslo], "tool_calls")
        engine.replies = [malformed]
        assert _ask(client, stream) == (malformed.replace("[TOOL_CALLS]", ""), [], "stop")
        engine.replies = [one]  # cut by max_tokens: the unfinished call is content
        content, calls, finish = _ask(client, stream, max_tokens=len(one) - 1)
        assert calls == [] and finish == "length"
        params = list(engine.params.values())
        assert all(p.structured_outputs is None for p in params)
        assert [p.skip_special_tokens for p in params[-1:]] == [
            not TOOL_PARSERS_NEED_SPECIAL[parser]
        ]
        prompt = "".join(map(chr, next(reversed(engine.prompts.values()))))
        assert prompt.startswith("tools: get_weather\n")


TOOL_PARSERS_NEED_SPECIAL = {"hermes": False, "llama3_json": True, "mistral": True,
                             "pythonic": False}  # fmt: skip


def test_auto_without_the_flags_is_a_400_naming_them(engine) -> None:
    for client in _client(engine):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and "
                                                          "--tool-call-parser"):  # fmt: skip
            _ask(client, False)
        assert not engine.params  # nothing reached the engine
        engine.replies = ["fine"]
        assert _ask(client, False, tool_choice="none") == ("fine", [], "stop")
        prompt = "".join(map(chr, next(iter(engine.prompts.values()))))
        assert "tools:" not in prompt  # "none": the template does not see the tools
        with pytest.raises(openai.BadRequestError, match="deprecated by OpenAI"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}],
                functions=[WEATHER["function"]],
            )  # fmt: skip


def test_forced_choices_ask_guided_decoding_for_the_calls(engine) -> None:
    for client in _client(engine):
        engine.replies = ['[{"name":"get_weather","parameters":{"city":"Paris"}}]']
        assert _ask(client, True, tool_choice="required", parallel_tool_calls=False) == (
            None, [("get_weather", '{"city": "Paris"}')], "tool_calls")  # fmt: skip
        (params,) = engine.params.values()
        schema = params.structured_outputs.json
        assert schema["maxItems"] == 1 and params.structured_outputs.disable_any_whitespace
        assert params.structured_outputs.close_within_max_tokens  # a cut call is never sent
        engine.replies = ['{"city":"Oslo"}']
        named = {"type": "function", "function": {"name": "get_weather"}}
        assert _ask(client, False, tool_choice=named) == (
            None, [("get_weather", '{"city":"Oslo"}')], "tool_calls")  # fmt: skip
        params = list(engine.params.values())[-1]
        assert params.structured_outputs.json == WEATHER["function"]["parameters"]
        assert params.structured_outputs.close_within_max_tokens


def test_forced_calls_describe_the_tools_where_the_template_does_not(engine) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for client in _client(engine):
        engine.replies = ['{"city":"Oslo"}'] * 3
        _ask(client, False, tool_choice=named)  # this template renders tools: left alone
        assert "".join(map(chr, engine.prompts.popitem()[1])).startswith("tools: get_weather\n")
        engine.tokenizer.renders_tools = False
        _ask(client, False, tool_choice=named)
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        listed = json.dumps([WEATHER["function"]])
        assert prompt == (
            f"system: You have these tools (JSON): {listed}\n"
            "Call get_weather: answer with its arguments as a JSON object.\n"
            "user: Weather in Paris?\nassistant: "
        )
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
        _ask(client, False, tool_choice="required", messages=messages)
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        assert prompt.startswith(f"system: Be brief.\n\nYou have these tools (JSON): {listed}\n")
        assert prompt.count("system:") == 1


def test_history_with_calls_and_results_reaches_the_template(engine) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]  # fmt: skip
    for client in _client(engine, tool_call_parser="hermes", enable_auto_tool_choice=True):
        engine.replies = ["It is 22 C and sunny in Paris."]
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
        assert answer.choices[0].message.content == "It is 22 C and sunny in Paris."
        prompt = "".join(map(chr, next(iter(engine.prompts.values()))))
        assert 'assistant:  -> get_weather({"city": "Paris"})\ntool: 22 C, sunny\n' in prompt
        bad = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
               "function": {"name": "get_weather", "arguments": "[1]"}}]}]  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="'call_1' are not a JSON object"):
            client.chat.completions.create(model=MODEL, messages=bad, tools=[WEATHER])
