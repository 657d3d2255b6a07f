"""`closing_text`: every prefix of a valid instance, cut at every character, closes into a value
the schema accepts (`jsonschema`), and into text both grammar backends take to an end; the
closings are the short ones (strings closed, minimal values for the missing required
properties); prefixes it cannot close, and keywords it does not construct, give None."""

from __future__ import annotations

import json

import pytest

from pagedinfer.entrypoints.openai.protocol import ChatTool
from pagedinfer.entrypoints.openai.tool_choice import required_schema
from pagedinfer.structured_output.backend import create_backend, grammar_accepts_text
from pagedinfer.structured_output.json_closer import closing_text, minimal_value
from pagedinfer.structured_output.specs import StructuredOutputOptions

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)


def _tool(name: str, parameters: dict | None) -> ChatTool:
    function = {"name": name, **({"parameters": parameters} if parameters else {})}
    return ChatTool.model_validate({"type": "function", "function": function})


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 2},
        "all_day": {"type": "boolean"},
        "when": {
            "type": "object",
            "properties": {
                "date": {"type": "string"},
                "hour": {"type": "integer", "minimum": 3, "maximum": 23},
            },
            "required": ["date", "hour"],
        },
    },
    "required": ["title", "when"],
}
EMAIL = {
    "type": "object",
    "properties": {
        "to": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "cc": {"type": ["string", "null"]},
        "n": {"type": "number", "exclusiveMinimum": -5, "maximum": -1},
    },
    "required": ["to", "n"],
}
REFS = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1},
        "label": {"const": "path"},
    },
    "required": ["points", "label"],
}
CALLS = required_schema(
    [_tool("get_weather", WEATHER), _tool("create_event", EVENT), _tool("get_time", None)],
    parallel=True,
)

# (schema, instances): every prefix of each instance's text must close.
CASES = {
    "weather": (WEATHER, [{"city": "Paris \"la\" \\ville\\u00e9 ☀", "unit": "fahrenheit"}]),
    "event": (EVENT, [{"title": "Dentist", "all_day": False,
                       "when": {"date": "2024-03-03", "hour": 9}}]),
    "email": (EMAIL, [{"to": ["a@b.c", "d@e.f", "x"], "cc": None, "n": -2.5e0},
                      {"to": ["s", "t"], "cc": "me", "n": -1}]),
    "refs": (REFS, [{"points": [{"x": -12, "y": 30}, {"x": 1, "y": 2}], "label": "path"}]),
    "calls": (CALLS, [[{"name": "get_weather", "parameters": {"city": "Oslo"}},
                       {"name": "create_event", "parameters": {"title": "Run", "when": {
                           "date": "today", "hour": 7}}},
                       {"name": "get_time", "parameters": {}}]]),
    "scalars": ({"anyOf": [{"type": "integer", "minimum": 10}, {"type": "boolean"},
                           {"type": "null"}, {"type": "string", "enum": ["yes", "no"]}]},
                [123, True, False, None, "yes", "no"]),
}  # fmt: skip


def _texts(instance: object) -> list[str]:
    compact = json.dumps(instance, ensure_ascii=False, separators=(",", ":"))
    return [compact, json.dumps(instance, ensure_ascii=False, indent=1)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_prefix_closes_into_a_valid_instance(name: str) -> None:
    schema, instances = CASES[name]
    validator = jsonschema.Draft202012Validator(schema)
    for instance in instances:
        assert validator.is_valid(instance)
        for text in _texts(instance):
            for cut in range(len(text) + 1):
                prefix = text[:cut]
                closing = closing_text(prefix, schema)
                assert closing is not None, (name, prefix)
                value = json.loads(prefix + closing)
                assert validator.is_valid(value), (name, prefix, closing)
            assert closing_text(text, schema) == ""


def test_the_closings_are_the_short_ones() -> None:
    assert closing_text('{"city":"Par', WEATHER) == '"}'
    assert closing_text('{"city":"Paris","unit":"fahr', WEATHER) == 'enheit"}'
    assert closing_text('{"city":"Paris","u', WEATHER) == 'nit":"celsius"}'
    assert closing_text('{"city":"Paris",', WEATHER) == '"unit":"celsius"}'
    assert closing_text('{"title":"', EVENT) == 'aa","when":{"date":"","hour":3}}'
    assert closing_text('{"to":["x"', EMAIL) == ',""],"n":-1}'
    assert closing_text('{"to":["x","y"],"n":-1.', EMAIL) == "0}"
    assert closing_text('{"to":["x","y"],"n":-', EMAIL) == "1}"
    assert closing_text("1", {"type": "integer", "minimum": 10}) == "0"
    assert closing_text('{"title":"a\\', EVENT) == 'n","when":{"date":"","hour":3}}'
    assert closing_text('["a\\u00', {"type": "array", "items": {"type": "string"}}) == '00"]'
    assert closing_text("tr", {"type": "boolean"}) == "ue"
    assert closing_text("", CALLS) == '[{"name":"get_weather","parameters":{"city":""}}]'
    # The call's name picks its schema: the event's required arguments, not the weather's.
    assert (closing_text('[{"name":"create_event","parameters":{"title":"x', CALLS)
            == 'a","when":{"date":"","hour":3}}}]')  # fmt: skip
    assert minimal_value(REFS) == '{"points":[{"x":0,"y":0}],"label":"path"}'


@pytest.mark.parametrize(
    "prefix, schema",
    [
        ('{"city":"Pa\ufffd', WEATHER),  # cut inside a UTF-8 character
        ('{"city":"x"}}', WEATHER),  # not JSON
        ('{"town":"', WEATHER | {"additionalProperties": False}),  # no such property
        ('"a', {"type": "string", "pattern": "^a+$"}),
        ("", {"type": "string", "format": "date"}),
        ("", {"type": "integer", "multipleOf": 7, "minimum": 1}),
        ("", {"type": "object", "required": ["a"], "not": {"required": ["a"]}}),
        ("", {"$ref": "https://example.com/schema.json"}),
        ('"\\ud83d', {"type": "string"}),  # between the two halves of a surrogate pair
    ],
)
def test_what_it_cannot_close_is_none(prefix: str, schema: dict) -> None:
    assert closing_text(prefix, schema) is None


@pytest.fixture(scope="module")
def backends():
    from pagedinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    made = {name: create_backend(name, tokenizer, 49152, disable_any_whitespace=True)
            for name in ("xgrammar", "guidance")}  # fmt: skip
    yield tokenizer, made
    for backend in made.values():
        backend.destroy()


@pytest.mark.parametrize("name", ["calls", "event", "email", "refs"])
def test_the_grammars_take_the_closed_text(backends, name: str) -> None:
    """What the engine forces must be what the request's grammar accepts (compact JSON, as
    forced tool calls use): each backend takes prefix + closing to an end."""
    tokenizer, made = backends
    schema, instances = CASES[name]
    text = _texts(instances[0])[0]
    cuts = range(0, len(text) + 1, max(1, len(text) // 12))
    for backend_name, backend in made.items():
        for cut in cuts:
            closed = text[:cut] + closing_text(text[:cut], schema)
            assert grammar_accepts_text(
                backend, tokenizer, StructuredOutputOptions.JSON, json.dumps(schema), closed
            ), (backend_name, closed)
