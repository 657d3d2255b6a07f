"""`/v1/responses` through the official `openai` client over the app in process on
`FakeEngine`: text, a forced function call, reasoning, JSON output, streamed (the event
types in order) and not; input items reaching the chat template; what is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME
from tests.unit.entrypoints.fake_engine import FakeEngine, openai_client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

MODEL = DEFAULT_MODEL_NAME
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}  # fmt: skip


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


def _client(engine: FakeEngine, **flags) -> Iterator[openai.OpenAI]:
    return openai_client(engine, **flags)


def test_text_answer(engine) -> None:
    for client in _client(engine):
        engine.replies = ["Hello there."]
        response = client.responses.create(model=MODEL, input="Hi!", instructions="Be kind.")
        assert response.status == "completed" and response.output_text == "Hello there."
        assert response.usage.input_tokens > 0 and response.usage.output_tokens == 12
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        assert prompt == "system: Be kind.\nuser: Hi!\nassistant: "
        engine.replies = ["Hello there, friend."]
        cut = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=5)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call(engine, stream) -> None:
    for client in _client(engine):
        engine.replies = ['{"city":"Paris"}']
        body = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
        if not stream:
            (call,) = client.responses.create(**body).output
        else:
            events = list(client.responses.create(**body, stream=True))
            kinds = [e.type for e in events]
            assert kinds == ["response.created", "response.in_progress",
                             "response.output_item.added"] + [
                "response.function_call_arguments.delta"] * (kinds.count(
                "response.function_call_arguments.delta")) + [
                "response.function_call_arguments.done", "response.output_item.done",
                "response.completed"]  # fmt: skip
            assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
            deltas = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
            assert deltas == '{"city":"Paris"}'
            (call,) = events[-1].response.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        (params,) = engine.params.values()
        assert params.structured_outputs.json == WEATHER["parameters"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_text(engine, stream) -> None:
    for client in _client(engine, reasoning_parser="deepseek_r1"):
        engine.replies = ["Easy.</think>It is 4."]
        if not stream:
            reasoning, message = client.responses.create(model=MODEL, input="2+2?").output
        else:
            events = list(client.responses.create(model=MODEL, input="2+2?", stream=True))
            kinds = [e.type for e in events]
            assert kinds.index("response.reasoning_text.done") < kinds.index(
                "response.content_part.added")  # fmt: skip
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text == "It is 4."
            reasoning, message = events[-1].response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Easy."
        assert message.content[0].text == "It is 4."


def test_items_json_format_and_refusals(engine) -> None:
    for client in _client(engine):
        engine.replies = ['{"ok": true}']
        items = [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        ]  # fmt: skip
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
        response = client.responses.create(
            model=MODEL, input=items, text={"format": {"type": "json_schema", "name": "x",
                                                       "schema": schema}})  # fmt: skip
        assert json.loads(response.output_text) == {"ok": True}
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        assert 'assistant:  -> get_weather({"city": "Oslo"})\ntool: rain\n' in prompt
        assert list(engine.params.values())[-1].structured_outputs.json == schema
        with pytest.raises(openai.BadRequestError, match="stateless"):
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
        with pytest.raises(openai.BadRequestError, match="'web_search'"):
            client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError, match="'reasoning'"):
            client.responses.create(model=MODEL, input="x", reasoning={"effort": "low"})
