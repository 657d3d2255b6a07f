"""Tool calling on the default model through a real `pagedinfer serve` and the official
`openai` client: `tool_choice` "required" and named give calls whose arguments validate
against the tool's schema, every time (varied tools and prompts, greedy and T=1, streamed and
not); a full round trip (call, tool result, final answer); a structural tag (what `strict`
tools use) constrains what follows its trigger. The parsers' formats are tested on scripted
outputs in tests/unit/entrypoints/."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags
from tests.integration.tool_cases import CALC, EVENT, NO_ARGS, SEARCH, WEATHER, schemas
from tests.integration.tool_cases import PROMPTS as ALL_PROMPTS

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"


TOOLSETS = [[WEATHER], [WEATHER, CALC], [SEARCH, EVENT, NO_ARGS], [CALC, SEARCH, EVENT, WEATHER]]
PROMPTS = ALL_PROMPTS[:7]


@pytest.fixture(scope="module")
def server():
    # 16 requests of up to ~500 tokens at once: 320 MiB of float32 KV (~7,000 tokens).
    flags = ["--kv-cache-memory-bytes", str(320 * 2**20), "--max-num-seqs", "16",
             "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]  # fmt: skip
    srv = ServerProcess(*small_engine_flags(1024), *flags)
    yield srv.base
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=600)


def _call(client, stream: bool, **body) -> tuple[list[tuple[str, str]], str | None]:
    """The calls (name, arguments) and finish_reason of choice 0."""
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return [(c.function.name, c.function.arguments)
                for c in choice.message.tool_calls or []], choice.finish_reason  # fmt: skip
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


def test_forced_tool_calls_always_validate(client) -> None:
    """64 requests: 4 tool sets x 8 prompt/tool pairings x {required, named} x {greedy, T=1},
    streamed and not, batched together."""
    cases = []
    for i in range(64):
        tools = TOOLSETS[i % len(TOOLSETS)]
        named = i % 2 == 1
        choice = ({"type": "function", "function": {"name": tools[(i // 2) % len(tools)]
                  ["function"]["name"]}} if named else "required")  # fmt: skip
        body = {"model": MODEL, "tools": tools, "tool_choice": choice, "max_tokens": 160,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "temperature": 0.0 if (i // 4) % 2 == 0 else 1.0, "seed": i,
                "parallel_tool_calls": i % 3 != 0}  # fmt: skip
        cases.append((i % 8 >= 4, body))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda case: _call(client, *case[:1], **case[1]), cases))
    stopped = 0
    for (_, body), (calls, finish) in zip(cases, results):
        by_name = schemas(body["tools"])
        # Every answer holds a call: one the model would have run past max_tokens (this
        # 135M model can loop inside a string, or repeat calls) was closed by the engine
        # in its last tokens (close_within_max_tokens) and says "length".
        assert calls and finish in ("tool_calls", "length"), (body, calls, finish)
        stopped += finish == "tool_calls"
        if body["tool_choice"] != "required":
            assert {n for n, _ in calls} <= {body["tool_choice"]["function"]["name"]}
        if not body["parallel_tool_calls"]:
            assert len(calls) <= 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), by_name[name])
    assert stopped >= 40, stopped  # measured: 57 of 64 end by themselves at max_tokens 160


def test_round_trip_call_result_answer(client) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=100,
        parallel_tool_calls=False,
    ).choices[0]
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"]
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees celsius and sunny"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    ).choices[0]
    # "auto" through the hermes parser: this model answers in prose, so content, no calls.
    assert final.message.content and not final.message.tool_calls
    assert final.finish_reason in ("stop", "length")


def test_structural_tag_constrains_what_follows_the_trigger(server, client) -> None:
    """What `strict` tools rely on: free text until a trigger, then the schema. The
    few-shot prompt makes the model write the trigger; the schema (a city it never saw, and
    a day count) is one it would not write unconstrained."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Reykjavik"]},
              "days": {"type": "integer", "minimum": 2, "maximum": 5}},
              "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
    tag = {"structures": [{"begin": ' {"forecast": ', "schema": schema, "end": "}"}],
           "triggers": [" {"]}  # fmt: skip
    prompt = "".join(f'{c}: {{"forecast": {{"city": "{c}"}}}}\n' for c in
                     ("Paris", "London", "Rome", "Madrid")) + "Berlin:"  # fmt: skip
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"structural_tag": tag}},
    )  # fmt: skip
    text = done.choices[0].text
    assert text.startswith(' {"forecast": '), text
    body, _ = json.JSONDecoder().raw_decode(text[len(' {"forecast": ') :])
    jsonschema.validate(body, schema)
    # And through a chat request with a strict tool: the tag compiles and the answer parses.
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[strict], max_tokens=30, temperature=0,
    ).choices[0]  # fmt: skip
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    for call in answer.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def _flat(tool: dict) -> dict:
    """A chat tool as /v1/responses writes it (no "function" level)."""
    return {"type": "function", **tool["function"]}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_with_a_tool_call(server, stream) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=600)
    body = {"model": MODEL, "input": "What's the weather like in Paris today?",
            "tools": [_flat(WEATHER), _flat(CALC)], "tool_choice": "required",
            "max_output_tokens": 120, "temperature": 0}  # fmt: skip
    if stream:
        events = list(client.responses.create(**body, stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = client.responses.create(**body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    by_name = schemas([WEATHER, CALC])
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name])
    text = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12)
    assert text.output_text and text.output[0].type == "message"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_with_a_tool_call(server, stream) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=600)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    body = {"model": MODEL, "max_tokens": 120, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "Is it raining in Tokyo?"}]}  # fmt: skip
    if stream:
        with client.messages.stream(**body) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**body)
    (block,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(block.input, tool["input_schema"])
    assert message.stop_reason == "tool_use"
    text = client.messages.create(model=MODEL, max_tokens=12,
                                  messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip
    assert text.content[0].type == "text" and text.content[0].text
