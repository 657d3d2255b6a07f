"""Anthropic's `/v1/messages` through the official `anthropic` client over the app in
process on `FakeEngine`: text, a forced tool call, thinking, streamed (the event types in
order) and not; tool results reaching the template; errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app
from tests.unit.entrypoints.fake_engine import FakeEngine

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(60)

MODEL = DEFAULT_MODEL_NAME
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}  # fmt: skip


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


def _client(engine: FakeEngine, **flags) -> Iterator[anthropic.Anthropic]:
    with TestClient(build_app(engine, MODEL, api_key="k", **flags)) as http:
        yield anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=http,
                                  max_retries=0)  # fmt: skip


def _ask(client, **body):
    return client.messages.create(model=MODEL, max_tokens=100, **body)


def test_text_stop_reasons_and_usage(engine) -> None:
    for client in _client(engine):
        engine.replies = ["Hello there. Bye."]
        message = _ask(client, system="Be kind.", messages=[{"role": "user", "content": "Hi"}])
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == "Hello there. Bye." and message.stop_reason == "end_turn"
        assert message.usage.output_tokens == 17
        assert "".join(map(chr, engine.prompts.popitem()[1])) == (
            "system: Be kind.\nuser: Hi\nassistant: ")  # fmt: skip
        stopped = _ask(client, messages=[{"role": "user", "content": "Hi"}],
                       stop_sequences=["Bye"])  # fmt: skip
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Bye"
        cut = client.messages.create(model=MODEL, max_tokens=3,
                                     messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
        assert cut.stop_reason == "max_tokens" and cut.content[0].text == "Hel"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call(engine, stream) -> None:
    for client in _client(engine):
        engine.replies = ['{"city":"Paris"}']
        choice = {"type": "tool", "name": "get_weather"}
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER], "tool_choice": choice}  # fmt: skip
        if not stream:
            message = _ask(client, **body)
        else:
            with client.messages.stream(model=MODEL, max_tokens=100, **body) as events:
                kinds = [e.type for e in events]
                message = events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert kinds[1] == "content_block_start" and "input_json" in kinds
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather"
        assert block.input == {"city": "Paris"} and message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_text(engine, stream) -> None:
    for client in _client(engine, reasoning_parser="deepseek_r1"):
        engine.replies = ["Easy.</think>It is 4."]
        body = {"messages": [{"role": "user", "content": "2+2?"}]}
        if not stream:
            message = _ask(client, **body)
        else:
            with client.messages.stream(model=MODEL, max_tokens=100, **body) as events:
                text = "".join(events.text_stream)
                message = events.get_final_message()
            assert text == "It is 4."
        thinking, answer = message.content
        assert thinking.type == "thinking" and thinking.thinking == "Easy."
        assert answer.text == "It is 4."


def test_tool_results_reach_the_template_and_errors(engine) -> None:
    for client in _client(engine):
        engine.replies = ["It rains in Oslo."]
        history = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
             "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
             "content": "rain"}]},
        ]  # fmt: skip
        answer = _ask(client, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
        assert answer.content[0].text == "It rains in Oslo."
        prompt = "".join(map(chr, engine.prompts.popitem()[1]))
        assert 'assistant:  -> get_weather({"city": "Oslo"})\ntool: rain\n' in prompt
        with pytest.raises(anthropic.BadRequestError, match="'thinking'"):
            _ask(client, messages=history, thinking={"type": "enabled", "budget_tokens": 10})
        with pytest.raises(anthropic.NotFoundError, match="not served here"):
            client.messages.create(model="claude-x", max_tokens=5,
                                   messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
        bad = anthropic.Anthropic(base_url=client.base_url, api_key="wrong",
                                  http_client=client._client, max_retries=0)  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=5,
                                messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
