"""The xgrammar backend of structured outputs (the default).

Role: compile specs with one `xgrammar.GrammarCompiler` per backend (its cache on, so a repeated
spec is not recompiled) and drive one `xgrammar.GrammarMatcher` per request.

How specs map to xgrammar:
- JSON: `compile_json_schema(schema, any_whitespace=..., strict_mode=True)`. Strict mode (as in
  vLLM) already forbids properties a schema does not list, so `disable_additional_properties`
  changes little here. `disable_any_whitespace` gives compact JSON: `any_whitespace=False` with
  separators ("," , ":") (xgrammar's own default would be ", " and ": ").
  Schema features xgrammar ignores or mishandles are rejected up front, as vLLM does (see
  `unsupported_json_features`), so that "auto" sends them to llguidance; the "date" and
  "date-time" formats become exact patterns (`exact_date_formats`: xgrammar's own take
  "2023-04-31");
- JSON_OBJECT: the schema `{"type": "object"}` (any object);
- REGEX: `compile_regex`; CHOICE: an EBNF `root ::= "a" | "b"`;
- GRAMMAR: EBNF/GBNF through `compile_grammar` (root rule `root`), Lark through `compile_lark`
  (start rule `start`; "auto" sends Lark to llguidance, but an explicit xgrammar backend takes it);
- STRUCTURAL_TAG: vLLM's legacy format through `StructuralTag.from_legacy_structural_tag`.

Quirks handled here: a terminated matcher raises on `fill_next_token_bitmask`, and a rollback
past its history raises; EOS never reaches the matcher (see `MatcherGrammar`), and
`max_rollback_tokens` is not passed (deprecated in xgrammar 0.2, history is unlimited).
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from pagedinfer.structured_output.backend import MatcherGrammar, StructuredOutputBackend
from pagedinfer.structured_output.specs import (
    StructuredOutputOptions,
    StructuredOutputSpecError,
    choice_alternatives,
    exact_date_formats,
    forbid_additional_properties,
    grammar_is_lark,
    iter_schema_nodes,
    parse_choice,
    parse_json_schema,
    parse_structural_tag,
)
from pagedinfer.structured_output.tokenizer_info import xgrammar_tokenizer_info

if TYPE_CHECKING:
    import xgrammar

    from pagedinfer.tokenizer import Tokenizer

__all__ = [
    "XgrammarBackend",
    "XgrammarGrammar",
    "unsupported_json_features",
    "validate_xgrammar_spec",
]

# String formats xgrammar implements (the list vLLM checks against).
SUPPORTED_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
_ARRAY_UNSUPPORTED = ("contains", "minContains", "maxContains")
_OBJECT_UNSUPPORTED = ("minProperties", "maxProperties", "propertyNames", "patternProperties")
# Assertions and applicators xgrammar 0.2 compiles to "anything" (measured: it accepts
# instances they forbid; tests/unit/structured_output/test_keyword_routing.py). oneOf is
# enforced only when xgrammar can prove its branches disjoint, else read as anyOf.
_IGNORED_KEYWORDS = ("not", "oneOf", "if", "then", "else", "dependentRequired",
                     "dependentSchemas", "dependencies", "unevaluatedItems", "additionalItems",
                     "$dynamicRef", "$recursiveRef")  # fmt: skip
# Keywords that assert something of an instance (JSON Schema 2020-12 and draft 7), beside
# which an anyOf or allOf loses its siblings in xgrammar (measured: `{"required": ["a"],
# "anyOf": [...]}` accepted `{}`). Annotations (title, description, ...) do not count.
_ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties", "required",
    "dependentRequired", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "dependentSchemas", "dependencies", "prefixItems", "items", "additionalItems", "contains",
    "properties", "patternProperties", "additionalProperties", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
})  # fmt: skip
# Keywords that constrain one type only, which xgrammar enforces only in a node that
# declares `type` (measured on JSON-Schema-Test-Suite: `{"maximum": 3}` took 3.5,
# `{"required": ["a"]}` took `{}`); to a validator a typeless node allows other types.
_TYPED_KEYWORDS = (
    "maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum", "multipleOf",
    "minLength", "maxLength", "pattern", "format", "items", "prefixItems", "minItems",
    "maxItems", "properties", "required", "additionalProperties", "unevaluatedProperties",
)  # fmt: skip


def unsupported_json_features(schema: dict[str, Any]) -> list[str]:
    """JSON schema keywords in `schema` that xgrammar would ignore or not enforce (vLLM's
    list): `multipleOf`; array `uniqueItems`, `contains`, `minContains`, `maxContains`; string
    `format`s outside `SUPPORTED_STRING_FORMATS`; object `minProperties`, `maxProperties`,
    `propertyNames`, `patternProperties`. Beyond vLLM's list: a string's `minLength` (above 0)
    or `maxLength` together with its `pattern` or `format` (xgrammar 0.2 keeps the pattern or
    format and silently drops the length, so `{"format": "email", "maxLength": 10}` would
    let a 30-character address through), and an `allOf` of more than one schema (xgrammar
    0.2 warns and compiles such a node to "any JSON value"). A keyword counts when the node
    may have the type it applies to (its `type` says so, or it has no `type`). Also the
    keywords xgrammar ignores whatever the type (`_IGNORED_KEYWORDS`: `not`, `oneOf`,
    `if`/`then`/`else`, `dependentRequired`, ...), and an `anyOf` or `allOf` beside other
    assertions in the same node (xgrammar then drops the siblings). Keywords outside JSON
    Schema's vocabulary are annotations to a validator too, so they are not listed."""
    found: list[str] = []
    for depth, node in enumerate(iter_schema_nodes(schema)):
        found.extend(k for k in _IGNORED_KEYWORDS if k in node)
        if "type" not in node and not any(k in node for k in ("enum", "const", "$ref")):
            found.extend(f"{k} without type" for k in _TYPED_KEYWORDS if k in node)
        # References resolved by xgrammar: JSON pointers into this document only.
        found.extend(k for k in ("$anchor", "$dynamicAnchor") if k in node)
        if depth > 0 and "$id" in node:
            found.append("$id in a subschema")
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            found.append(f"$ref {ref!r}")
        for combinator in ("anyOf", "allOf"):
            siblings = sorted(k for k in node if k in _ASSERTIONS and k != combinator)
            if combinator in node and siblings:
                found.append(f"{combinator} beside {', '.join(siblings)}")
        declared = node.get("type")
        types = {declared} if isinstance(declared, str) else set(declared or ())

        def may_be(*names: str, types: set[Any] = types) -> bool:
            return not types or any(n in types for n in names)

        if may_be("number", "integer") and "multipleOf" in node:
            found.append("multipleOf")
        if may_be("array"):
            if node.get("uniqueItems"):
                found.append("uniqueItems")
            found.extend(k for k in _ARRAY_UNSUPPORTED if k in node)
        fmt = node.get("format")
        if may_be("string") and isinstance(fmt, str) and fmt not in SUPPORTED_STRING_FORMATS:
            found.append(f"string format {fmt!r}")
        if may_be("string") and ("maxLength" in node or node.get("minLength", 0) not in (0, None)):
            found.extend(
                f"minLength/maxLength with {k}" for k in ("pattern", "format") if k in node
            )
        if may_be("object"):
            found.extend(k for k in _OBJECT_UNSUPPORTED if k in node)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append("allOf with more than one schema")
    return list(dict.fromkeys(found))


_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def _clean_error(error: BaseException) -> str:
    """xgrammar's C++ message without its timestamp/source-location prefixes."""
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(error))).strip()
    return text or type(error).__name__


def _json_schema_text(spec: str, disable_additional_properties: bool) -> str:
    schema = parse_json_schema(spec)
    unsupported = unsupported_json_features(schema)
    if unsupported:
        raise StructuredOutputSpecError(
            "the xgrammar backend does not support these JSON schema features: "
            + ", ".join(unsupported)
        )
    rewritten = exact_date_formats(schema)
    if disable_additional_properties:
        rewritten = forbid_additional_properties(rewritten)
    if rewritten is schema:
        return spec
    return json.dumps(rewritten, ensure_ascii=False)


def _structural_tag(spec: str) -> Any:
    import xgrammar as xgr

    structures, triggers = parse_structural_tag(spec)
    items = []
    for s in structures:
        schema = s["schema"]
        if isinstance(schema, dict) and unsupported_json_features(schema):
            raise StructuredOutputSpecError(
                "the xgrammar backend does not support these JSON schema features: "
                + ", ".join(unsupported_json_features(schema))
            )
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
    return xgr.StructuralTag.from_legacy_structural_tag(items, triggers)


def _build(
    kind: StructuredOutputOptions,
    spec: str,
    *,
    disable_any_whitespace: bool,
    disable_additional_properties: bool,
    compiler: xgrammar.GrammarCompiler | None,
) -> Any:
    """Compile with `compiler`, or (None) only parse with `xgrammar.Grammar` (no tokenizer).

    Our own spec checks raise ValueError first; a library error becomes ValueError too.
    """
    import xgrammar as xgr

    grammar = xgr.Grammar
    opts = StructuredOutputOptions
    try:
        if kind in (opts.JSON, opts.JSON_OBJECT):
            if kind is opts.JSON:
                text = _json_schema_text(spec, disable_additional_properties)
            else:
                text = '{"type": "object"}'
            kw: dict[str, Any] = {
                "any_whitespace": not disable_any_whitespace,
                "separators": (",", ":") if disable_any_whitespace else None,
                "strict_mode": True,
            }
            if compiler is not None:
                return compiler.compile_json_schema(text, **kw)
            return grammar.from_json_schema(text, **kw)
        if kind is opts.REGEX:
            return compiler.compile_regex(spec) if compiler else grammar.from_regex(spec)
        if kind is opts.CHOICE:
            ebnf = "root ::= " + choice_alternatives(parse_choice(spec))
            return compiler.compile_grammar(ebnf) if compiler else grammar.from_ebnf(ebnf)
        if kind is opts.GRAMMAR:
            if not spec.strip():
                raise StructuredOutputSpecError("invalid grammar: the grammar is empty")
            if grammar_is_lark(spec):
                return compiler.compile_lark(spec) if compiler else grammar.from_lark(spec)
            return compiler.compile_grammar(spec) if compiler else grammar.from_ebnf(spec)
        if kind is opts.STRUCTURAL_TAG:
            tag = _structural_tag(spec)
            if compiler is not None:
                return compiler.compile_structural_tag(tag)
            return grammar.from_structural_tag(tag)
    except StructuredOutputSpecError:
        raise
    except Exception as e:  # RuntimeError and friends from the C++ side
        raise StructuredOutputSpecError(
            f"xgrammar cannot compile this {_kind_name(kind)}: {_clean_error(e)}"
        ) from None
    raise StructuredOutputSpecError(f"the xgrammar backend does not support {kind}")


def _kind_name(kind: StructuredOutputOptions) -> str:
    return {
        StructuredOutputOptions.JSON: "JSON schema",
        StructuredOutputOptions.JSON_OBJECT: "JSON object spec",
        StructuredOutputOptions.REGEX: "regex",
        StructuredOutputOptions.CHOICE: "choice",
        StructuredOutputOptions.GRAMMAR: "grammar",
        StructuredOutputOptions.STRUCTURAL_TAG: "structural tag",
    }[kind]


def validate_xgrammar_spec(
    kind: StructuredOutputOptions,
    spec: str,
    *,
    disable_any_whitespace: bool = False,
    disable_additional_properties: bool = False,
) -> None:
    """ValueError if xgrammar cannot take the spec; parses only (no tokenizer needed)."""
    _build(
        kind,
        spec,
        disable_any_whitespace=disable_any_whitespace,
        disable_additional_properties=disable_additional_properties,
        compiler=None,
    )


class XgrammarGrammar(MatcherGrammar):
    """One request's `xgrammar.GrammarMatcher`."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, eos_token_id: int) -> None:
        super().__init__(eos_token_id)
        self.matcher = matcher

    def _try_advance(self, tokens: list[int]) -> bool:
        matcher = self.matcher
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):
                if i:
                    matcher.rollback(i)
                return False
        return True

    def _count_valid(self, tokens: list[int]) -> int:
        matcher = self.matcher
        n = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def _can_end(self) -> bool:
        return bool(self.matcher.is_completed())

    def _lib_rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def _lib_reset(self) -> None:
        self.matcher.reset()

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend(StructuredOutputBackend):
    """Structured outputs through xgrammar."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        max_rollback_tokens: int = 0,
        max_threads: int = 8,
    ) -> None:
        super().__init__(
            tokenizer,
            vocab_size,
            disable_any_whitespace=disable_any_whitespace,
            disable_additional_properties=disable_additional_properties,
            max_rollback_tokens=max_rollback_tokens,
        )
        import xgrammar as xgr

        self.tokenizer_info = xgrammar_tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=True
        )
        # xgrammar does not report cache hits; its cache is unbounded, so a spec compiled
        # before is a hit. Cleared with the cache in destroy().
        self._compiled_keys: set[tuple[StructuredOutputOptions, str]] = set()
        self._keys_lock = threading.Lock()

    def _options(self) -> dict[str, bool]:
        return {
            "disable_any_whitespace": self.disable_any_whitespace,
            "disable_additional_properties": self.disable_additional_properties,
        }

    def compile_grammar(self, kind: StructuredOutputOptions, spec: str) -> XgrammarGrammar:
        import xgrammar as xgr

        compiled = _build(kind, spec, compiler=self.compiler, **self._options())
        key = (kind, spec)
        with self._keys_lock:
            hit = key in self._compiled_keys
            self._compiled_keys.add(key)
        self._count(hit=hit)
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.eos_token_id)

    def validate(self, kind: StructuredOutputOptions, spec: str) -> None:
        validate_xgrammar_spec(kind, spec, **self._options())

    def destroy(self) -> None:
        self.compiler.clear_cache()
        with self._keys_lock:
            self._compiled_keys.clear()
