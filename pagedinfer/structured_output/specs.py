"""Structured-output specs: their kinds, their strings, and the parsing and JSON-schema
rewriting that both grammar backends share.

A spec is a `StructuredOutputKey`: its kind (`StructuredOutputOptions`) and its string
(`canonical_spec` makes one from a list or dict). The strings, by kind:
- JSON: a JSON schema (a JSON object); JSON_OBJECT: any JSON object (spec ignored);
- REGEX: the whole output matches the regex;
- CHOICE: a JSON list of strings; the output is exactly one of them;
- GRAMMAR: an EBNF/GBNF grammar with a `root` rule (`::=` definitions), or a Lark grammar with a
  `start` rule (`:` definitions); see `grammar_is_lark`;
- STRUCTURAL_TAG: vLLM's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`.

`check_spec_bounds` refuses a spec too deep or too long before anything recurses over it
(a copy, a backend's compiler). The `parse_*` functions raise `StructuredOutputSpecError`
(a ValueError) naming what is wrong with a spec. `forbid_additional_properties` and
`exact_date_formats` rewrite a JSON schema before a backend compiles it;
`iter_schema_nodes` walks its subschemas.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EXACT_FORMAT_PATTERNS",
    "MAX_SPEC_CHARS",
    "MAX_SPEC_DEPTH",
    "StructuredOutputKey",
    "StructuredOutputOptions",
    "StructuredOutputSpecError",
    "canonical_spec",
    "check_spec_bounds",
    "choice_alternatives",
    "exact_date_formats",
    "forbid_additional_properties",
    "grammar_is_lark",
    "iter_schema_nodes",
    "parse_choice",
    "parse_json_schema",
    "parse_structural_tag",
]


class StructuredOutputOptions(enum.Enum):
    """What kind of constraint a spec string describes."""

    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    CHOICE = enum.auto()
    GRAMMAR = enum.auto()  # EBNF/GBNF or Lark, told apart by grammar_is_lark
    STRUCTURAL_TAG = enum.auto()


StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputSpecError(ValueError):
    """A spec is invalid, or a backend cannot take it; the message names the problem."""


MAX_SPEC_DEPTH = 64
"""Nesting levels of a spec: JSON objects and arrays (a schema's subschema is two: its
"properties" object and the subschema), or brackets of a regex or grammar string."""
MAX_SPEC_CHARS = 256 << 10
"""Characters of a spec (a JSON spec as serialized)."""


def check_spec_bounds(name: str, spec: Any) -> None:
    """StructuredOutputSpecError when `spec` (a structured-outputs field's value: a dict, a
    list, a string) nests deeper than `MAX_SPEC_DEPTH` or is longer than `MAX_SPEC_CHARS`.
    Iterative: a spec nested 100,000 deep is refused without a RecursionError."""
    if isinstance(spec, str):
        if len(spec) > MAX_SPEC_CHARS:
            raise StructuredOutputSpecError(
                f"{name}: {len(spec)} characters; at most {MAX_SPEC_CHARS} are taken"
            )
        depth = deepest = 0
        for ch in spec:  # brackets of any kind, quoted or not: a bound, not a parse
            if ch in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif ch in ")]}" and depth:
                depth -= 1
    else:
        deepest, size = 0, 0
        stack: list[tuple[Any, int]] = [(spec, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, dict):
                deepest = max(deepest, depth)
                items = list(node.values())
                size += sum(len(str(k)) + 4 for k in node)
            elif isinstance(node, list):
                deepest = max(deepest, depth)
                items = node
            else:
                size += len(str(node)) + 2
                continue
            if deepest > MAX_SPEC_DEPTH or size > MAX_SPEC_CHARS:
                break
            stack.extend((item, depth + 1) for item in items)
        if size > MAX_SPEC_CHARS:
            raise StructuredOutputSpecError(
                f"{name}: more than {MAX_SPEC_CHARS} characters; at most that many are taken"
            )
    if deepest > MAX_SPEC_DEPTH:
        raise StructuredOutputSpecError(
            f"{name}: nested more than {MAX_SPEC_DEPTH} levels deep; at most {MAX_SPEC_DEPTH} "
            "are taken"
        )


def canonical_spec(kind: StructuredOutputOptions, spec: str | list[str] | dict[str, Any]) -> str:
    """The spec string of a key: lists and dicts as compact JSON.

    Keys are NOT sorted: both libraries emit object properties in the schema's declared order,
    so `sort_keys=True` would change what a JSON schema generates. Strings pass unchanged.
    """
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, dict)):
        return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    raise TypeError(f"a {kind.name} spec must be a string, list or dict, not {type(spec)}")


# ---- parsing the spec strings ------------------------------------------------------------------

_COMMENT = re.compile(r"(#|//).*$")


def grammar_is_lark(spec: str) -> bool:
    """Whether a GRAMMAR spec is Lark rather than EBNF/GBNF (vLLM's rule: a grammar with any
    `::=` definition outside comments is EBNF; anything else is taken for Lark)."""
    for line in spec.splitlines():
        line = _COMMENT.sub("", line).strip()
        if "::=" in line:
            return False
    return True


def parse_json_schema(spec: str) -> dict[str, Any]:
    """A JSON schema spec as a dict, or ValueError saying why it is not one."""
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, TypeError) as e:
        raise StructuredOutputSpecError(f"invalid JSON schema: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise StructuredOutputSpecError(
            f"invalid JSON schema: expected a JSON object, got {type(schema).__name__}"
        )
    return schema


def parse_choice(spec: str) -> list[str]:
    """A CHOICE spec (JSON list of strings) as a list, or ValueError."""
    try:
        choices = json.loads(spec)
    except (json.JSONDecodeError, TypeError) as e:
        raise StructuredOutputSpecError(
            f"invalid choice spec: not a JSON list of strings ({e})"
        ) from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise StructuredOutputSpecError("invalid choice spec: expected a JSON list of strings")
    if not choices:
        raise StructuredOutputSpecError("invalid choice spec: the list of choices is empty")
    return choices


def choice_alternatives(choices: list[str]) -> str:
    """`"a" | "b"`: the choices as string literals, for an EBNF or Lark rule body.

    JSON escaping (quotes, backslashes, control characters as \\n or \\u0001; other characters
    as themselves) is understood by both xgrammar's EBNF and llguidance's Lark.
    """
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_structural_tag(spec: str) -> tuple[list[dict[str, Any]], list[str]]:
    """vLLM's structural tag spec as (structures, triggers), or ValueError."""
    try:
        obj = json.loads(spec)
    except (json.JSONDecodeError, TypeError) as e:
        raise StructuredOutputSpecError(f"invalid structural tag: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or "structures" not in obj or "triggers" not in obj:
        raise StructuredOutputSpecError(
            'invalid structural tag: expected {"structures": [...], "triggers": [...]}'
        )
    structures, triggers = obj["structures"], obj["triggers"]
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise StructuredOutputSpecError(
            "invalid structural tag: triggers must be non-empty strings"
        )
    if not isinstance(structures, list) or not structures:
        raise StructuredOutputSpecError(
            "invalid structural tag: structures must be a non-empty list"
        )
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise StructuredOutputSpecError(
                'invalid structural tag: each structure needs "begin", "schema", "end"'
            )
        if not any(s["begin"].startswith(t) for t in triggers):
            raise StructuredOutputSpecError(
                f"invalid structural tag: no trigger starts {s['begin']!r}"
            )
    return structures, triggers


# ---- walking and rewriting JSON schemas --------------------------------------------------------

# JSON schema keywords whose values are data, not subschemas.
_DATA_KEYWORDS = frozenset(
    {"enum", "const", "default", "examples", "required", "dependentRequired", "title"}
)
# Keywords whose values map names to subschemas.
_SCHEMA_MAP_KEYWORDS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def iter_schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every (sub)schema dict in a JSON schema, the root first, depth first."""
    stack = [schema] if isinstance(schema, dict) else []
    while stack:
        node = stack.pop()
        yield node
        children: list[Any] = []
        for key, value in node.items():
            if key in _DATA_KEYWORDS or key.startswith("x-"):
                continue
            if key in _SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                children.extend(value.values())
            elif isinstance(value, dict):
                children.append(value)
            elif isinstance(value, list):
                children.extend(value)
        stack.extend(reversed([c for c in children if isinstance(c, dict)]))


def forbid_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` where every object schema that lists `properties` or
    `patternProperties` but says nothing of `additionalProperties` gets
    `"additionalProperties": false` (the `disable_additional_properties` option)."""
    schema = json.loads(json.dumps(schema))
    for node in iter_schema_nodes(schema):
        if "additionalProperties" not in node and (
            "properties" in node or "patternProperties" in node
        ):
            node["additionalProperties"] = False
    return schema


# RFC 3339 `full-date` with only days that exist (proleptic Gregorian leap years), and
# `date-time` built on it. Neither library's own format is exact: xgrammar 0.2 takes day 31 in
# any month ("2023-04-31", "2023-02-30"), llguidance takes 02-29 in any year ("2023-02-29").
_MONTH_DAY = (
    "(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"  # the 1st-28th of any month
    "|(0[13-9]|1[0-2])-(29|30)"  # the 29th and 30th but in February
    "|(0[13578]|1[02])-31"
)
_LEAP_YEAR = "[0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00"
_FULL_DATE = f"([0-9]{{4}}-({_MONTH_DAY})|({_LEAP_YEAR})-02-29)"
_FULL_TIME = (  # RFC 3339: leap second 60, optional fraction, "Z" or a +hh:mm offset
    "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?"
    "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
# A dotted quad without leading zeros: both libraries' own "ipv4" took "83.41.08.001"
# (measured: tests/integration/test_json_schema_corpus.py), which validators refuse.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
EXACT_FORMAT_PATTERNS = {
    "date": f"^{_FULL_DATE}$",
    "date-time": f"^{_FULL_DATE}[Tt]{_FULL_TIME}$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
}


def exact_date_formats(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` where each string schema with `"format": "date"`, `"date-time"`
    or `"ipv4"` and no `pattern` of its own gets the exact `pattern` of that format instead
    (see `EXACT_FORMAT_PATTERNS`), so that neither library can emit a day that does not
    exist or an address with a leading zero.
    `schema` itself is returned when nothing changes."""

    def targets(node: dict[str, Any]) -> bool:
        declared = node.get("type")
        types = {declared} if isinstance(declared, str) else set(declared or ())
        return (
            node.get("format") in EXACT_FORMAT_PATTERNS
            and "pattern" not in node
            and (not types or "string" in types)
        )

    if not any(targets(node) for node in iter_schema_nodes(schema)):
        return schema
    schema = json.loads(json.dumps(schema))
    for node in iter_schema_nodes(schema):
        if targets(node):
            node["pattern"] = EXACT_FORMAT_PATTERNS[node.pop("format")]
    return schema
