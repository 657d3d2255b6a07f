"""Unit tests for the structured-output grammar backends (xgrammar and llguidance).

Each grammar is driven the way the engine drives it: fill the bitmask row, pick a token the mask
allows, accept it. Two "models" do the picking: a replay of a known text tokenised by the real
tokenizer (every token must be allowed in turn, then EOS), and a seeded sampler that prefers
closing tokens so that generation ends, whose decoded output is then checked against the spec.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch

from pagedinfer.structured_output import (
    StructuredOutputOptions,
    apply_token_bitmask,
    bitmask_words,
    canonical_spec,
    create_backend,
    grammar_is_lark,
    resolve_auto_backend,
)
from pagedinfer.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

SO = StructuredOutputOptions
BACKENDS = ["xgrammar", "guidance"]
VOCAB = 49152  # SmolLM2-135M: LM head rows == tokenizer vocab

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
}
PERSON_TEXT = (
    '{"name": "Ada", "age": 36, "color": "green", "tags": ["math", "code"], '
    '"address": {"city": "London", "zip": "12345"}}'
)
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITH_RE = re.compile(r"[0-9()+\-*/]+")


# ---- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from pagedinfer.tokenizer import Tokenizer

    return Tokenizer.from_model_path(None)


@pytest.fixture(scope="module")
def backends(tokenizer) -> dict[str, StructuredOutputBackend]:
    made = {name: create_backend(name, tokenizer, VOCAB) for name in BACKENDS}
    yield made
    for backend in made.values():
        backend.destroy()


@pytest.fixture(scope="module")
def whitespace_tokens(tokenizer) -> np.ndarray:
    """Tokens whose text is whitespace only (the sampler avoids them)."""
    flags = np.zeros(VOCAB, dtype=bool)
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        flags[i] = text != "" and text.strip() == ""
    return flags


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> np.ndarray:
    """Boolean [vocab] of the tokens a bitmask row allows (independent of apply_token_bitmask)."""
    packed = bitmask[row].numpy().view(np.uint8)  # little-endian host
    return np.unpackbits(packed, bitorder="little")[:vocab].astype(bool)


def mask_of(backend: StructuredOutputBackend, grammar: StructuredOutputGrammar) -> np.ndarray:
    bitmask = backend.allocate_token_bitmask(3)
    bitmask.zero_()
    grammar.fill_bitmask(bitmask, 1)
    return allowed(bitmask, 1, backend.vocab_size)


def replay(
    backend: StructuredOutputBackend, grammar: StructuredOutputGrammar, tokens: list[int]
) -> None:
    """Every token is allowed by the mask in turn and accepted; at every step the mask allows
    EOS exactly when validate_tokens([EOS]) does; at the end EOS is allowed and terminates."""
    eos = backend.eos_token_id
    for i, token in enumerate(tokens):
        mask = mask_of(backend, grammar)
        assert mask[token], f"token {i} ({token}) not allowed"
        assert mask[eos] == (grammar.validate_tokens([eos]) == [eos])
        assert grammar.accept_tokens("req", [token])
    mask = mask_of(backend, grammar)
    assert mask[eos], "EOS not allowed at the end"
    assert grammar.accept_tokens("req", [eos])
    assert grammar.is_terminated()


def generate(
    backend: StructuredOutputBackend,
    grammar: StructuredOutputGrammar,
    tokenizer,
    whitespace: np.ndarray,
    *,
    seed: int = 0,
    explore: int = 0,
    max_steps: int = 400,
) -> str:
    """A seeded stand-in for a model. For the first `explore` steps: a random allowed
    non-whitespace token other than EOS. Then: EOS as soon as allowed, else the first allowed
    closing token, else a random allowed non-whitespace token."""
    rng = random.Random(seed)
    eos = backend.eos_token_id
    prefer = [ids(tokenizer, s)[0] for s in ['"', "}", "]", ")", "1", "a"]]
    out: list[int] = []
    bitmask = backend.allocate_token_bitmask(1)
    for step in range(max_steps):
        grammar.fill_bitmask(bitmask, 0)
        mask = allowed(bitmask, 0, backend.vocab_size)
        assert mask.any() and not mask[tokenizer.vocab_size :].any()
        token = None
        if step >= explore:
            token = eos if mask[eos] else next((t for t in prefer if mask[t]), None)
        if token is None:
            choices = np.flatnonzero(mask & ~whitespace[: backend.vocab_size])
            if step < explore and len(choices) > 1:
                choices = choices[choices != eos]
            if len(choices) == 0:
                choices = np.flatnonzero(mask)
            token = int(choices[rng.randrange(len(choices))])
        assert grammar.accept_tokens("req", [token])
        if token == eos:
            assert grammar.is_terminated()
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tokenizer.decode(out)!r}")


def check_schema(schema: dict[str, Any], value: Any) -> None:
    """Validate with jsonschema when installed, else with a checker of the keywords used here."""
    try:
        import jsonschema
    except ImportError:
        _check(schema, value, "$")
    else:
        jsonschema.validate(value, schema)


def _check(schema: dict[str, Any], value: Any, path: str) -> None:
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
        "integer": int,
        "number": (int, float),
    }
    if "type" in schema:
        ok = isinstance(value, kinds[schema["type"]])
        if schema["type"] in ("integer", "number"):
            ok = ok and not isinstance(value, bool)
        assert ok, f"{path}: {value!r} is not {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if isinstance(value, str):
        assert len(value) >= schema.get("minLength", 0), f"{path}: too short"
        assert len(value) <= schema.get("maxLength", len(value)), f"{path}: too long"
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), f"{path}: {value!r} !~ pattern"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value)
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{path}: too few items"
        for i, item in enumerate(value):
            _check(schema.get("items", {}), item, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        for key, item in value.items():
            if key in props:
                _check(props[key], item, f"{path}.{key}")
            else:
                assert schema.get("additionalProperties", True) is not False, f"{path}.{key}"


# ---- JSON schema, JSON object ------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_replay_and_invalid(name, backends, tokenizer):
    backend = backends[name]
    spec = canonical_spec(SO.JSON, PERSON_SCHEMA)
    replay(backend, backend.compile_grammar(SO.JSON, spec), ids(tokenizer, PERSON_TEXT))

    grammar = backend.compile_grammar(SO.JSON, spec)
    assert not mask_of(backend, grammar)[ids(tokenizer, "[")[0]]  # must be an object
    # An enum value outside the enum: a strict prefix validates, the whole is refused, and a
    # refused accept changes nothing.
    bad = ids(tokenizer, '{"name": "Ada", "age": 36, "color": "purple"')
    prefix = grammar.validate_tokens(bad)
    assert len(prefix) < len(bad) and bad[: len(prefix)] == prefix
    before = mask_of(backend, grammar)
    assert not grammar.accept_tokens("req", bad)
    assert (mask_of(backend, grammar) == before).all() and not grammar.is_terminated()
    # Too few tags (minItems 2): "]" is refused after one item.
    grammar = backend.compile_grammar(SO.JSON, spec)
    head = ids(tokenizer, '{"name": "Ada", "age": 36, "color": "red", "tags": ["x"')
    assert grammar.accept_tokens("req", head)
    assert not mask_of(backend, grammar)[ids(tokenizer, "]")[0]]
    assert not mask_of(backend, grammar)[backend.eos_token_id]


@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_generation(name, backends, tokenizer, whitespace_tokens):
    backend = backends[name]
    spec = canonical_spec(SO.JSON, PERSON_SCHEMA)
    for seed in range(2):
        grammar = backend.compile_grammar(SO.JSON, spec)
        text = generate(backend, grammar, tokenizer, whitespace_tokens, seed=seed, explore=12)
        check_schema(PERSON_SCHEMA, json.loads(text))


@pytest.mark.parametrize("name", BACKENDS)
def test_json_object(name, backends, tokenizer, whitespace_tokens):
    backend = backends[name]
    text = '{"x": [1, {"y": null}], "z": "w", "t": true}'
    replay(backend, backend.compile_grammar(SO.JSON_OBJECT, ""), ids(tokenizer, text))
    grammar = backend.compile_grammar(SO.JSON_OBJECT, "")
    mask = mask_of(backend, grammar)
    assert not mask[ids(tokenizer, "[")[0]] and not mask[ids(tokenizer, '"')[0]]
    assert not mask[backend.eos_token_id]
    value = json.loads(generate(backend, grammar, tokenizer, whitespace_tokens, explore=10))
    assert isinstance(value, dict)


@pytest.mark.parametrize("name", BACKENDS)
def test_whitespace_and_additional_properties_flags(name, tokenizer):
    schema = canonical_spec(SO.JSON, {"type": "object", "properties": {"a": {"type": "integer"}}})
    compact = create_backend(name, tokenizer, VOCAB, disable_any_whitespace=True)
    grammar = compact.compile_grammar(SO.JSON, schema)
    assert grammar.validate_tokens(ids(tokenizer, '{"a":1}')) == ids(tokenizer, '{"a":1}')
    spaced = ids(tokenizer, '{"a": 1}')
    assert len(grammar.validate_tokens(spaced)) < len(spaced)

    loose = create_backend(name, tokenizer, VOCAB)
    grammar = loose.compile_grammar(SO.JSON, schema)
    for text in ['{"a":1}', '{ "a" : 1 }']:
        assert grammar.validate_tokens(ids(tokenizer, text)) == ids(tokenizer, text)
    extra = ids(tokenizer, '{"a": 1, "b": 2}')
    # llguidance follows JSON Schema (extra properties allowed); xgrammar is strict, as in vLLM.
    assert (grammar.validate_tokens(extra) == extra) == (name == "guidance")

    strict = create_backend(name, tokenizer, VOCAB, disable_additional_properties=True)
    grammar = strict.compile_grammar(SO.JSON, schema)
    assert len(grammar.validate_tokens(extra)) < len(extra)
    assert grammar.validate_tokens(ids(tokenizer, '{"a": 1}')) == ids(tokenizer, '{"a": 1}')


@pytest.mark.parametrize("name", BACKENDS)
def test_special_tokens_are_never_text(name, backends, tokenizer):
    backend = backends[name]
    grammar = backend.compile_grammar(SO.JSON, '{"type": "string"}')
    assert grammar.accept_tokens("req", ids(tokenizer, '"'))
    mask = mask_of(backend, grammar)
    assert mask[ids(tokenizer, "hello")[0]]
    specials = sorted(tokenizer.all_special_ids)
    assert not mask[specials].any()


# ---- regex, choice, grammars -------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_regex(name, backends, tokenizer, whitespace_tokens):
    backend = backends[name]
    pattern = r"\d{3}-[a-z]+"
    replay(backend, backend.compile_grammar(SO.REGEX, pattern), ids(tokenizer, "123-abc"))
    grammar = backend.compile_grammar(SO.REGEX, pattern)
    assert grammar.accept_tokens("req", ids(tokenizer, "123-"))
    assert not mask_of(backend, grammar)[backend.eos_token_id]  # needs a letter
    assert not grammar.accept_tokens("req", ids(tokenizer, "9"))
    assert grammar.validate_tokens(ids(tokenizer, "12a")) == []
    for seed in range(2):
        grammar = backend.compile_grammar(SO.REGEX, pattern)
        text = generate(backend, grammar, tokenizer, whitespace_tokens, seed=seed, explore=6)
        assert re.fullmatch(pattern, text, re.ASCII), text


@pytest.mark.parametrize("name", BACKENDS)
def test_choice(name, backends, tokenizer, whitespace_tokens):
    backend = backends[name]
    choices = ["yes", "no", "maybe"]
    spec = canonical_spec(SO.CHOICE, choices)
    for choice in choices:
        replay(backend, backend.compile_grammar(SO.CHOICE, spec), ids(tokenizer, choice))
    grammar = backend.compile_grammar(SO.CHOICE, spec)
    assert grammar.validate_tokens(ids(tokenizer, "yesno")) != ids(tokenizer, "yesno")
    assert grammar.validate_tokens(ids(tokenizer, " yes")) == []
    assert not mask_of(backend, grammar)[backend.eos_token_id]  # empty is not a choice
    for seed in range(3):
        grammar = backend.compile_grammar(SO.CHOICE, spec)
        assert generate(backend, grammar, tokenizer, whitespace_tokens, seed=seed) in choices
    odd = ['say "hi"\n', "back\\slash", "h\u00e9"]
    for choice in odd:
        replay(backend, backend.compile_grammar(SO.CHOICE, json.dumps(odd)), ids(tokenizer, choice))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("syntax", ["ebnf", "lark"])
def test_grammar(name, syntax, backends, tokenizer, whitespace_tokens):
    # xgrammar takes Lark too (compile_lark); llguidance converts EBNF/GBNF to Lark.
    backend = backends[name]
    spec = ARITH_EBNF if syntax == "ebnf" else ARITH_LARK
    assert grammar_is_lark(spec) == (syntax == "lark")
    replay(backend, backend.compile_grammar(SO.GRAMMAR, spec), ids(tokenizer, "(12+3)*4"))
    grammar = backend.compile_grammar(SO.GRAMMAR, spec)
    assert grammar.accept_tokens("req", ids(tokenizer, "1+"))
    assert not mask_of(backend, grammar)[backend.eos_token_id]
    assert grammar.validate_tokens(ids(tokenizer, "+")) == []
    assert grammar.validate_tokens(ids(tokenizer, ")")) == []
    for seed in range(2):
        grammar = backend.compile_grammar(SO.GRAMMAR, spec)
        text = generate(backend, grammar, tokenizer, whitespace_tokens, seed=seed, explore=12)
        assert ARITH_RE.fullmatch(text) and text.count("(") == text.count(")"), text
        assert len(text) >= 6, text


@pytest.mark.parametrize("name", BACKENDS)
def test_structural_tag(name, backends, tokenizer):
    backend = backends[name]
    spec = json.dumps(
        {
            "structures": [
                {
                    "begin": "<function=get>",
                    "schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
                    "end": "</function>",
                }
            ],
            "triggers": ["<function="],
        }
    )
    grammar = backend.compile_grammar(SO.STRUCTURAL_TAG, spec)
    text = 'I will call it. <function=get>{"x": 1}</function>'
    tokens = ids(tokenizer, text)
    assert grammar.validate_tokens(tokens) == tokens
    assert grammar.accept_tokens("req", tokens)
    assert grammar.accept_tokens("req", [backend.eos_token_id])
    grammar = backend.compile_grammar(SO.STRUCTURAL_TAG, spec)
    bad = ids(tokenizer, '<function=get>{"x": "no"}')
    assert len(grammar.validate_tokens(bad)) < len(bad)


# ---- state: rollback, validate, reset, termination ---------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_validate_reset(name, backends, tokenizer):
    backend = backends[name]
    eos = backend.eos_token_id
    grammar = backend.compile_grammar(SO.JSON, canonical_spec(SO.JSON, PERSON_SCHEMA))
    tokens = ids(tokenizer, PERSON_TEXT)
    initial = mask_of(backend, grammar)
    head, tail = tokens[:10], tokens[10:]
    assert grammar.accept_tokens("req", head)
    at_head = mask_of(backend, grammar)

    # validate_tokens: longest valid prefix, state untouched (also with EOS and junk after).
    assert grammar.validate_tokens(tail) == tail
    assert grammar.validate_tokens(tail + [eos]) == tail + [eos]
    assert grammar.validate_tokens(tail + [eos, eos]) == tail + [eos]
    assert grammar.validate_tokens(tail[:3] + [eos]) == tail[:3]
    junk = ids(tokenizer, "]]]")
    assert grammar.validate_tokens(tail[:4] + junk) == tail[:4]
    assert (mask_of(backend, grammar) == at_head).all()
    assert grammar.num_processed_tokens == len(head)

    # rollback: back to the same state, re-acceptance works.
    assert grammar.accept_tokens("req", tail[:5])
    grammar.rollback(5)
    assert (mask_of(backend, grammar) == at_head).all()
    assert grammar.accept_tokens("req", tail + [eos]) and grammar.is_terminated()
    # After EOS: only EOS allowed, nothing accepted; rolling back over EOS un-terminates.
    mask = mask_of(backend, grammar)
    assert mask[eos] and mask.sum() == 1
    assert not grammar.accept_tokens("req", [eos])
    assert grammar.validate_tokens([eos]) == []
    grammar.rollback(1 + len(tail))
    assert not grammar.is_terminated() and (mask_of(backend, grammar) == at_head).all()
    with pytest.raises(ValueError, match="roll back"):
        grammar.rollback(len(head) + 1)
    grammar.rollback(0)

    # reset: back to the start, from anywhere (also after termination).
    assert grammar.accept_tokens("req", tail + [eos])
    grammar.reset()
    assert not grammar.is_terminated() and grammar.num_processed_tokens == 0
    assert (mask_of(backend, grammar) == initial).all()
    replay(backend, grammar, tokens)


@pytest.mark.parametrize("name", BACKENDS)
def test_accept_is_all_or_nothing(name, backends, tokenizer):
    backend = backends[name]
    grammar = backend.compile_grammar(SO.CHOICE, '["yes", "no"]')
    eos = backend.eos_token_id
    assert not grammar.accept_tokens("req", [eos])  # cannot end before a choice
    assert not grammar.accept_tokens("req", ids(tokenizer, "yes") + ids(tokenizer, "!"))
    assert not grammar.accept_tokens("req", [eos] + ids(tokenizer, "yes"))
    assert grammar.accept_tokens("req", [])
    assert grammar.num_processed_tokens == 0 and not grammar.is_terminated()
    assert grammar.accept_tokens("req", ids(tokenizer, "no") + [eos])
    assert grammar.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_padded_model_vocab(name, tokenizer):
    """A model vocab larger than the tokenizer's and not a multiple of 32."""
    vocab = VOCAB + 100
    backend = create_backend(name, tokenizer, vocab)
    bitmask = backend.allocate_token_bitmask(2)
    assert bitmask.shape == (2, bitmask_words(vocab)) == (2, 1540)
    assert bitmask.dtype == torch.int32 and (bitmask == -1).all()
    grammar = backend.compile_grammar(SO.JSON_OBJECT, "")
    grammar.fill_bitmask(bitmask, 1)
    mask = allowed(bitmask, 1, vocab)
    assert mask[ids(tokenizer, "{")[0]] and not mask[VOCAB:].any()
    assert grammar.accept_tokens("req", ids(tokenizer, "{}") + [backend.eos_token_id])


def test_model_vocab_smaller_than_tokenizer(tokenizer):
    """Added tokens the model has no logits for: xgrammar drops them; llguidance cannot."""
    backend = create_backend("xgrammar", tokenizer, 40000)
    grammar = backend.compile_grammar(SO.JSON_OBJECT, "")
    bitmask = backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    assert bitmask.shape == (1, 1250) and allowed(bitmask, 0, 40000)[ids(tokenizer, "{")[0]]
    with pytest.raises(ValueError, match="xgrammar"):
        create_backend("guidance", tokenizer, 40000)


# ---- invalid specs, auto selection, caching ----------------------------------------------------

INVALID_SPECS = [
    (SO.JSON, '{"type": "object", "properties": {', "not valid JSON"),
    (SO.JSON, "[1, 2]", "expected a JSON object"),
    (SO.JSON, '{"type": "foo"}', "foo"),
    (SO.REGEX, r"\d{3}-[a-z", "regex"),
    (SO.REGEX, "(abc", "regex"),
    (SO.GRAMMAR, 'root ::= ( "a"', "grammar"),
    (SO.GRAMMAR, "root ::= undefined_rule", "undefined_rule"),
    (SO.GRAMMAR, "start: foo", "foo"),
    (SO.GRAMMAR, "   ", "empty"),
    (SO.CHOICE, "[]", "empty"),
    (SO.CHOICE, '["a", 1]', "list of strings"),
    (SO.CHOICE, "yes", "list of strings"),
    (SO.STRUCTURAL_TAG, '{"structures": []}', "structural tag"),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("kind", "spec", "message"), INVALID_SPECS)
def test_invalid_specs(name, kind, spec, message, backends):
    backend = backends[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.validate(kind, spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.compile_grammar(kind, spec)


UNSUPPORTED_BY_XGRAMMAR = [
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}, "multipleOf"),
    ({"type": "object", "patternProperties": {"^x_": {"type": "string"}}}, "patternProperties"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"s": {"type": "string", "format": "unknown"}}}, "format"),
    (
        {
            "type": "object",
            "allOf": [
                {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ],
        },
        "allOf with more than one schema",
    ),
]


@pytest.mark.parametrize(("schema", "feature"), UNSUPPORTED_BY_XGRAMMAR)
def test_auto_falls_back_to_guidance(schema, feature, backends):
    spec = canonical_spec(SO.JSON, schema)
    with pytest.raises(ValueError, match=feature):
        backends["xgrammar"].compile_grammar(SO.JSON, spec)
    assert resolve_auto_backend(SO.JSON, spec) == "guidance"
    backends["guidance"].compile_grammar(SO.JSON, spec)


def test_a_single_schema_allof_stays_with_xgrammar(backends, tokenizer):
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}},
                         "required": ["a"], "additionalProperties": False}]}  # fmt: skip
    spec = canonical_spec(SO.JSON, schema)
    assert resolve_auto_backend(SO.JSON, spec) == "xgrammar"
    grammar = backends["xgrammar"].compile_grammar(SO.JSON, spec)
    assert grammar.validate_tokens(ids(tokenizer, '{"a": 3}')) == ids(tokenizer, '{"a": 3}')
    assert not grammar.accept_tokens("r", ids(tokenizer, '{"a": 4}'))


def test_auto_backend_choice(backends, tokenizer):
    person = canonical_spec(SO.JSON, PERSON_SCHEMA)
    assert resolve_auto_backend(SO.JSON, person) == "xgrammar"
    assert resolve_auto_backend(SO.JSON_OBJECT, "") == "xgrammar"
    assert resolve_auto_backend(SO.REGEX, r"\d+") == "xgrammar"
    assert resolve_auto_backend(SO.CHOICE, '["a", "b"]') == "xgrammar"
    assert resolve_auto_backend(SO.GRAMMAR, ARITH_EBNF) == "xgrammar"
    assert resolve_auto_backend(SO.GRAMMAR, ARITH_LARK) == "guidance"
    # A string format xgrammar lacks but llguidance has ("unknown": any string).
    assert resolve_auto_backend(SO.JSON, '{"type": "string", "format": "unknown"}') == "guidance"
    # Neither library: uniqueItems (llguidance: unimplemented), a malformed schema.
    with pytest.raises(ValueError, match="xgrammar.*guidance.*uniqueItems"):
        resolve_auto_backend(SO.JSON, '{"type": "array", "uniqueItems": true}')
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_auto_backend(SO.JSON, '{"type": ')
    with pytest.raises(ValueError, match="regex"):
        resolve_auto_backend(SO.REGEX, "(abc")


@pytest.mark.parametrize("name", BACKENDS)
def test_compile_cache(name, tokenizer):
    backend = create_backend(name, tokenizer, VOCAB)
    spec = canonical_spec(SO.JSON, PERSON_SCHEMA)
    start = time.perf_counter()
    first = backend.compile_grammar(SO.JSON, spec)
    cold = time.perf_counter() - start
    size = backend.compiler.get_cache_size_bytes() if name == "xgrammar" else None
    start = time.perf_counter()
    second = backend.compile_grammar(SO.JSON, spec)
    warm = time.perf_counter() - start
    assert (backend.num_compiles, backend.num_cache_hits) == (1, 1)
    if name == "xgrammar":  # the library's own cache served it
        assert backend.compiler.get_cache_size_bytes() == size
        assert warm < cold
    # Independent state per request.
    assert first.accept_tokens("a", ids(tokenizer, '{"name"'))
    assert second.num_processed_tokens == 0 and mask_of(backend, second)[ids(tokenizer, "{")[0]]
    backend.compile_grammar(SO.REGEX, "a+")
    assert (backend.num_compiles, backend.num_cache_hits) == (2, 1)
    with pytest.raises(ValueError):
        backend.compile_grammar(SO.REGEX, "(a")
    assert backend.num_compiles == 2
    backend.destroy()
    backend.compile_grammar(SO.JSON, spec)
    assert backend.num_compiles == 3


def test_create_backend_rejects_unknown_name(tokenizer):
    with pytest.raises(ValueError, match="unknown structured output backend"):
        create_backend("auto", tokenizer, VOCAB)  # type: ignore[arg-type]


def test_spec_helpers():
    assert canonical_spec(SO.CHOICE, ["b", "a"]) == '["b","a"]'
    # Property order is kept: it decides the order the output lists properties in.
    assert canonical_spec(SO.JSON, {"b": 1, "a": 2}) == '{"b":1,"a":2}'
    assert canonical_spec(SO.JSON, '{"x": 1}') == '{"x": 1}'
    assert grammar_is_lark('start: "a"\n// x ::= y')
    assert not grammar_is_lark('# comment: x\nroot ::= "a"')


# ---- apply_token_bitmask ------------------------------------------------------------------------


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.tolist()
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            w = j // 32
            if w >= len(words[i]) or not (words[i][w] >> (j % 32)) & 1:
                out[i, j] = float("-inf")
    return out


@pytest.mark.parametrize("byteorder", ["little", "big"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "vocab", "words"), [(4, 100, 4), (3, 64, 2), (2, 70, 2), (1, 5, 1)]
)
def test_apply_token_bitmask_matches_naive(dtype, rows, vocab, words, byteorder, monkeypatch):
    """(4, 100, 4): vocab not a multiple of 32; (2, 70, 2): logits wider than the mask covers.
    "big" runs the word-shift path (the byte-view path assumes a little-endian host)."""
    monkeypatch.setattr(sys, "byteorder", byteorder)
    gen = torch.Generator().manual_seed(vocab * rows)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # all allowed
    expected = naive_apply(logits, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert logits.dtype == dtype
    assert torch.equal(logits, expected)


def test_apply_token_bitmask_real_mask(backends, tokenizer):
    backend = backends["guidance"]
    grammar = backend.compile_grammar(SO.REGEX, r"\d{3}-[a-z]+")
    bitmask = backend.allocate_token_bitmask(2)
    grammar.fill_bitmask(bitmask, 0)
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    expected = logits.clone()
    expected[0, ~torch.from_numpy(allowed(bitmask, 0))] = float("-inf")
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()  # an all-ones row leaves logits alone
    with pytest.raises(ValueError):
        apply_token_bitmask(logits, bitmask.to(torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask(logits[:1], bitmask)
