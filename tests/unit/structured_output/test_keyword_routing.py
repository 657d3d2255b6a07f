"""Guided decoding never lies: for each JSON schema keyword, a schema, an instance it
allows and one it forbids. Each backend either refuses the schema or enforces it (accepts
the first instance to its end, rejects the second); "auto" picks a backend that enforces
it, or refuses naming the keyword. Measured, xgrammar 0.2 accepted the forbidden instance
of `not`, `oneOf`, `if`/`then`, `dependentRequired`, `dependentSchemas` and of an `anyOf`
beside `required`: `unsupported_json_features` now lists them, so "auto" sends such schemas
to llguidance (which enforces or refuses every one of these). If a library upgrade starts
ignoring a keyword, this test says which."""

from __future__ import annotations

import json

import pytest

from pagedinfer.structured_output.backend import (
    StructuredOutputSpecError,
    create_backend,
    grammar_accepts_text,
    resolve_auto_backend,
)
from pagedinfer.structured_output.specs import StructuredOutputOptions

pytestmark = pytest.mark.timeout(300)

VOCAB = 49152
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# keyword -> (schema, an instance it allows, one it forbids)
PROBES = {
    "not": ({**OBJ_AB, "required": ["a"], "not": {"properties": {"a": {"const": 1}}}},
            {"a": 2}, {"a": 1}),
    "anyOf beside required": ({**OBJ_AB, "required": ["a"], "anyOf": [
        {"required": ["b"]}, {"properties": {"a": {"const": 5}}}]}, {"a": 5}, {"a": 1}),
    "anyOf beside properties": ({**OBJ_AB, "required": ["a"], "anyOf": [{"type": "object"}]},
                                {"a": 5}, {}),
    "oneOf (overlapping)": ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
                            1.5, 3),
    "oneOf (disjoint)": ({"type": "object", "properties": {"k": {"type": "string"}},
                          "required": ["k"], "oneOf": [{"properties": {"k": {"const": "x"}}},
                                                       {"properties": {"k": {"const": "y"}}}]},
                         {"k": "x"}, {"k": "z"}),
    "if/then": ({**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
                {"a": 1, "b": 2}, {"a": 1}),
    "dependentRequired": ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2},
                          {"a": 1}),
    "dependentSchemas": ({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
                         {"a": 1, "b": 2}, {"a": 1}),
    "allOf": ({"allOf": [{**OBJ_AB, "required": ["a"]}, {"required": ["b"]}]},
              {"a": 1, "b": 2}, {"a": 1}),
    "const": ({"const": "hi"}, "hi", "ho"),
    "enum": ({"enum": [1, 2]}, 2, 3),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    "minimum": ({"type": "number", "minimum": 3}, 3.5, 2.5),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2], [1, 2, 3]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}],
                     "items": {"type": "integer"}}, ["a", 1], [1, 1]),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "aa", "ab"),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc"),
    "additionalProperties": ({**OBJ_AB, "additionalProperties": False}, {"a": 1}, {"c": 2}),
    "required": ({**OBJ_AB, "required": ["a"]}, {"a": 1}, {}),
    "$ref": ({"$defs": {"p": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]}, {"a": 1}, {"a": "x"}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "s", True),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                    [1, 2], [1, 1]),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"ab": 1}, {"b": 1}),
    "contains": ({"type": "array", "contains": {"const": 1}}, [1], [2]),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 7),
    "format date": ({"type": "string", "format": "date"}, "2024-02-03", "2024-13-40"),
    "patternProperties": ({"type": "object", "patternProperties": {"^s": {"type": "string"}}},
                          {"s1": "x"}, {"s1": 1}),
    "unevaluatedProperties": ({**OBJ_AB, "unevaluatedProperties": False}, {"a": 1}, {"c": 1}),
}  # fmt: skip


@pytest.fixture(scope="module")
def backends():
    from pagedinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    made = {name: create_backend(name, tokenizer, VOCAB, disable_any_whitespace=True)
            for name in ("xgrammar", "guidance")}  # fmt: skip
    yield tokenizer, made
    for backend in made.values():
        backend.destroy()


def _accepts(tokenizer, backend, schema: dict, instance: object) -> bool:
    """Whether the compiled schema takes the instance's compact JSON to an end."""
    text = json.dumps(instance, separators=(",", ":"))
    return grammar_accepts_text(
        backend, tokenizer, StructuredOutputOptions.JSON, json.dumps(schema), text
    )


def _verdict(tokenizer, backend, schema, good, bad) -> str:
    try:
        backend.validate(StructuredOutputOptions.JSON, json.dumps(schema))
    except ValueError:
        return "refuses"
    allowed = _accepts(tokenizer, backend, schema, good)
    forbidden = _accepts(tokenizer, backend, schema, bad)
    return "enforces" if allowed and not forbidden else f"lies (good {allowed}, bad {forbidden})"


@pytest.mark.parametrize("keyword", sorted(PROBES))
def test_no_backend_lies_and_auto_picks_one_that_enforces(backends, keyword) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer, made = backends
    schema, good, bad = PROBES[keyword]
    # The probe itself is right (formats asserted, as guided decoding enforces them).
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    assert validator.is_valid(good) and not validator.is_valid(bad)
    verdicts = {name: _verdict(tokenizer, b, schema, good, bad) for name, b in made.items()}
    assert all(v in ("refuses", "enforces") for v in verdicts.values()), verdicts
    try:
        chosen = resolve_auto_backend(StructuredOutputOptions.JSON, json.dumps(schema),
                                      disable_any_whitespace=True)  # fmt: skip
    except StructuredOutputSpecError as exc:
        assert set(verdicts.values()) == {"refuses"}, verdicts
        assert "xgrammar:" in str(exc) and "guidance:" in str(exc)
    else:
        assert verdicts[chosen] == "enforces", (chosen, verdicts)


def test_the_refusal_names_the_keyword() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "not": {"required": ["b"]}}  # fmt: skip
    with pytest.raises(StructuredOutputSpecError, match="xgrammar: .*not"):
        resolve_auto_backend(StructuredOutputOptions.JSON, json.dumps(schema))
    # A property called "not" is a name, not the keyword.
    named = {"type": "object", "properties": {"not": {"type": "string"}}, "required": ["not"]}
    assert resolve_auto_backend(StructuredOutputOptions.JSON, json.dumps(named)) == "xgrammar"
