"""The shortest text that turns a prefix of a JSON value into a value its schema accepts.

`closing_text(prefix, schema)` reads `prefix` (JSON cut anywhere: inside a string, a number,
a literal, between a key and its colon...) against `schema` and returns what to append so
that the whole validates: the open string closed, a number or literal finished, the required
properties still missing filled with their minimal values, arrays padded to `minItems`, every
container closed. None where it cannot say: the prefix is not JSON, the text stops inside a
character (the U+FFFD of a cut UTF-8 sequence) or an escape it cannot finish, or the schema
uses a keyword whose minimal instance this module does not construct (`pattern`, `format`,
`not`, `allOf`, `if`, `dependentRequired`, ... : `_UNSUPPORTED`).

Used by the structured-output manager for requests that must finish within max_tokens
(`StructuredOutputsParams.close_within_max_tokens`, forced tool calls): when the budget left
reaches the closing's length, the engine forces the closing's tokens, each checked by the
request's grammar first, so a grammar that disagrees only means nothing is forced. The
minimal values: const or the first enum value; null, false, 0 (or the nearest bound), "" (or
`minLength` letters), `minItems` minimal items, an object of its required properties; the
first `anyOf`/`oneOf`/type-list alternative that has one. Properties are completed in schema
order, which is the order both grammar backends emit them in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["closing_text", "minimal_value"]

_UNSUPPORTED = (
    "pattern", "format", "not", "allOf", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "prefixItems", "contains", "minContains",
    "minProperties", "patternProperties", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems", "contentEncoding", "contentMediaType",
)  # fmt: skip
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = set("0123456789+-.eE")
_DIGIT_TAILS = [""] + [f"{n:0{width}d}" for width in (1, 2, 3) for n in range(10**width)]


class _GiveUp(Exception):
    """The prefix or the schema is outside what this module completes."""


@dataclass
class _Frame:
    """An open object or array: the schema alternatives still possible and where it is."""

    kind: str  # "object" or "array"
    schemas: list[dict[str, Any]]
    state: str
    """object: "key?" (after `{`), "key" (after `,`), "colon", "value", "next" (after a value);
    array: "item?" (after `[`), "item" (after `,`), "next"."""
    keys: list[str] = field(default_factory=list)
    count: int = 0


class _Closer:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    # ------------------------------------------------------------------ schemas

    def resolve(self, schema: Any) -> dict[str, Any]:
        if schema is True or schema is None:
            return {}
        if not isinstance(schema, dict):
            raise _GiveUp("schema false")
        seen = 0
        while "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#") or seen > 32:
                raise _GiveUp(f"$ref {ref!r}")
            node: Any = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(node, dict) or part not in node:
                    raise _GiveUp(f"$ref {ref!r}")
                node = node[part]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            if not isinstance(node, dict) or any(k not in ("description", "title") for k in rest):
                raise _GiveUp("$ref beside other keywords")
            schema, seen = node, seen + 1
        if any(k in schema for k in _UNSUPPORTED):
            raise _GiveUp("unsupported keyword")
        return schema

    def alternatives(self, schema: Any) -> list[dict[str, Any]]:
        """`schema` as a list of simple alternatives: anyOf/oneOf expanded (no sibling
        assertions allowed beside them), a type list split into single types."""
        schema = self.resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if any(k not in (key, "description", "title", "$defs", "definitions")
                       for k in schema):  # fmt: skip
                    raise _GiveUp(f"{key} beside other keywords")
                return [alt for sub in schema[key] for alt in self.alternatives(sub)]
        types = schema.get("type")
        if isinstance(types, list):
            return [{**schema, "type": t} for t in types]
        return [schema]

    @staticmethod
    def type_of(schema: dict[str, Any]) -> str | None:
        if "type" in schema:
            return str(schema["type"])
        if "const" in schema or "enum" in schema:
            return None
        if any(k in schema for k in ("properties", "required", "additionalProperties")):
            return "object"
        if any(k in schema for k in ("items", "minItems", "maxItems")):
            return "array"
        if any(k in schema for k in ("minLength", "maxLength")):
            return "string"
        return None

    def fits(self, schema: dict[str, Any], first: str) -> bool:
        """Whether a value starting with `first` can match `schema`."""
        kind = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean",
                "n": "null"}.get(first, "number")  # fmt: skip
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return any(
                json.dumps(v, ensure_ascii=False).startswith(first)
                or (kind == "number" and isinstance(v, (int, float)))
                for v in values
            )
        t = self.type_of(schema)
        if t is None:
            return True
        return t == kind or (kind == "number" and t == "integer")

    def minimal_value(self, schema: Any) -> str:
        for alt in self.alternatives(schema):
            try:
                return self._minimal(alt)
            except _GiveUp:
                continue
        raise _GiveUp("no alternative has a minimal value")

    def _minimal(self, s: dict[str, Any]) -> str:
        if "const" in s:
            return json.dumps(s["const"], ensure_ascii=False, separators=(",", ":"))
        if "enum" in s:
            if not s["enum"]:
                raise _GiveUp("empty enum")
            return json.dumps(s["enum"][0], ensure_ascii=False, separators=(",", ":"))
        t = self.type_of(s)
        if t in (None, "null"):
            return "null"
        if t == "boolean":
            return "false"
        if t in ("integer", "number"):
            return self._number(s, t == "integer")
        if t == "string":
            if s.get("maxLength", math.inf) < s.get("minLength", 0):
                raise _GiveUp("minLength > maxLength")
            return '"' + "a" * int(s.get("minLength", 0)) + '"'
        if t == "array":
            n = int(s.get("minItems", 0))
            if n > 1 and s.get("uniqueItems"):
                raise _GiveUp("uniqueItems")
            if n and s.get("maxItems", math.inf) < n:
                raise _GiveUp("minItems > maxItems")
            return "[" + ",".join([self.minimal_value(s.get("items", {}))] * n) + "]"
        if t == "object":
            return "{" + ",".join(self._required_members(s, [])) + "}"
        raise _GiveUp(f"type {t!r}")

    @staticmethod
    def _number(s: dict[str, Any], integer: bool) -> str:
        """0 if the bounds allow it, else the allowed value nearest to 0 (a step inside an
        exclusive bound: 1 for integers, 1 or half the range for numbers)."""
        lo, hi = s.get("minimum", -math.inf), s.get("maximum", math.inf)
        lo_open = "exclusiveMinimum" in s and s["exclusiveMinimum"] >= lo
        hi_open = "exclusiveMaximum" in s and s["exclusiveMaximum"] <= hi
        lo = s["exclusiveMinimum"] if lo_open else lo
        hi = s["exclusiveMaximum"] if hi_open else hi

        def allowed(v: float) -> bool:
            return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

        if allowed(0):
            value: float = 0
        elif lo > 0:
            value = math.floor(lo) + 1 if integer and lo_open else math.ceil(lo) if integer else lo
            if not integer and lo_open:
                value = lo + 1 if allowed(lo + 1) else (lo + hi) / 2
        else:
            value = math.ceil(hi) - 1 if integer and hi_open else math.floor(hi) if integer else hi
            if not integer and hi_open:
                value = hi - 1 if allowed(hi - 1) else (lo + hi) / 2
        if not allowed(value) or math.isinf(value):
            raise _GiveUp("empty range")
        step = s.get("multipleOf")
        if step and value % step:
            raise _GiveUp("multipleOf")
        return repr(int(value)) if float(value).is_integer() else repr(float(value))

    def _property(self, s: dict[str, Any], key: str) -> Any:
        props = s.get("properties", {})
        if key in props:
            return props[key]
        extra = s.get("additionalProperties", True)
        if extra is False:
            raise _GiveUp(f"property {key!r} not allowed")
        return extra

    def _required_members(self, s: dict[str, Any], present: list[str]) -> list[str]:
        """`"key":minimal` for each required property not in `present`, in schema order."""
        required = [k for k in s.get("required", []) if k not in present]
        order = list(s.get("properties", {}))
        required.sort(key=lambda k: order.index(k) if k in order else len(order))
        return [json.dumps(k, ensure_ascii=False) + ":" + self.minimal_value(self._property(s, k))
                for k in required]  # fmt: skip

    # ----------------------------------------------------------------- the prefix

    def close(self, text: str) -> str:
        stack: list[_Frame] = []
        top = self.alternatives(self.root)  # the root value's alternatives
        done = False  # the root value is complete
        i, n = 0, len(text)

        def value_schemas() -> list[dict[str, Any]]:
            """The alternatives for the value that starts now."""
            if not stack:
                return top
            frame = stack[-1]
            if frame.kind == "array":
                return [a for s in frame.schemas for a in self.alternatives(s.get("items", {}))]
            key = frame.keys[-1]
            out = []
            for s in frame.schemas:
                try:
                    out += self.alternatives(self._property(s, key))
                except _GiveUp:
                    pass
            return out

        def value_done(scalar: Any = None, has_scalar: bool = False) -> None:
            nonlocal done
            if not stack:
                done = True
                return
            frame = stack[-1]
            if frame.kind == "array":
                frame.count += 1
            elif has_scalar:  # keep the object alternatives whose property takes this value
                key = frame.keys[-1]
                kept = [s for s in frame.schemas if self._takes(s, key, scalar)]
                frame.schemas = kept or frame.schemas
            frame.state = "next"

        while i < n:
            c = text[i]
            if c in " \t\n\r":
                i += 1
                continue
            if done:
                raise _GiveUp("text after the value")
            frame = stack[-1] if stack else None
            if frame is not None and frame.kind == "object" and frame.state in ("key?", "key"):
                if c == "}" and frame.state == "key?":
                    stack.pop()
                    value_done()
                    i += 1
                    continue
                if c != '"':
                    raise _GiveUp("expected a key")
                end = _string_end(text, i)
                if end is None:
                    return self._close_key(stack, text[i + 1 :])
                frame.keys.append(json.loads(text[i:end]))
                frame.state = "colon"
                i = end
                continue
            if frame is not None and frame.state == "colon":
                if c != ":":
                    raise _GiveUp("expected a colon")
                frame.state = "value"
                i += 1
                continue
            if frame is not None and frame.state == "next":
                close = "}" if frame.kind == "object" else "]"
                if c == ",":
                    frame.state = "key" if frame.kind == "object" else "item"
                elif c == close:
                    stack.pop()
                    value_done()
                else:
                    raise _GiveUp("expected , or a closing bracket")
                i += 1
                continue
            if frame is not None and frame.kind == "array" and frame.state == "item?" and c == "]":
                stack.pop()
                value_done()
                i += 1
                continue
            # a value starts here
            alts = [s for s in value_schemas() if self.fits(s, c)]
            if not alts:
                raise _GiveUp("no schema alternative takes this value")
            if c in "{[":
                kind = "object" if c == "{" else "array"
                stack.append(_Frame(kind, alts, "key?" if kind == "object" else "item?"))
                i += 1
                continue
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    tail = self._close_string(alts, text[i + 1 :])
                    value_done(json.loads(text[i:] + tail), True)
                    return tail + self._close_all(stack)
                value_done(json.loads(text[i:end]), True)
                i = end
                continue
            j = i
            while j < n and (text[j] in _NUMBER_CHARS or text[j].isalpha()):
                j += 1
            token = text[i:j]
            if j == n:  # the value may still be growing: finish it
                tail = self._finish_scalar(token, alts)
                value_done(json.loads(token + tail), True)
                return tail + self._close_all(stack)
            try:
                scalar = json.loads(token)
            except ValueError as exc:
                raise _GiveUp("bad literal") from exc
            value_done(scalar, True)
            i = j
        if done:
            return ""
        if not stack:  # nothing but whitespace so far
            return self.minimal_value(self.root)
        return self._close_all(stack)

    def _takes(self, s: dict[str, Any], key: str, value: Any) -> bool:
        try:
            alts = self.alternatives(self._property(s, key))
        except _GiveUp:
            return False
        for a in alts:
            if "const" in a and a["const"] != value:
                continue
            if "enum" in a and value not in a["enum"]:
                continue
            return True
        return False

    def _finish_scalar(self, token: str, alts: list[dict[str, Any]]) -> str:
        """Finish a literal, or a number so that it fits one of the numeric alternatives'
        bounds: the shortest run of digits that does ("" first), up to three."""
        for lit in _LITERALS:
            if lit.startswith(token):
                return lit[len(token) :]
        for tail in _DIGIT_TAILS:
            try:
                value = json.loads(token + tail)
            except ValueError:
                continue
            if isinstance(value, (int, float)) and any(self._number_fits(s, value) for s in alts):
                return tail
        raise _GiveUp("no number with this start fits")

    @staticmethod
    def _number_fits(s: dict[str, Any], value: float) -> bool:
        if "const" in s or "enum" in s:
            return value in ([s["const"]] if "const" in s else s["enum"])
        if s.get("type") == "integer" and not float(value).is_integer():
            return False
        if s.get("type") not in ("integer", "number", None):
            return False
        step = s.get("multipleOf")
        return (
            value >= s.get("minimum", -math.inf)
            and value <= s.get("maximum", math.inf)
            and value > s.get("exclusiveMinimum", -math.inf)
            and value < s.get("exclusiveMaximum", math.inf)
            and not (step and value % step)
        )

    def _close_string(self, alts: list[dict[str, Any]], body: str) -> str:
        """Finish a string value whose text so far (after the quote) is `body`."""
        if body.endswith("\ufffd"):
            raise _GiveUp("cut inside a character")
        tail = _finish_escape(body)
        chars = len(json.loads('"' + body + tail + '"'))
        for s in alts:
            if "const" in s or "enum" in s:
                values = [s["const"]] if "const" in s else s["enum"]
                for v in values:
                    raw = json.dumps(v, ensure_ascii=False)[1:]
                    if isinstance(v, str) and raw.startswith(body + tail):
                        return tail + raw[len(body + tail) :]
                continue
            if self.type_of(s) not in ("string", None):
                continue
            if chars > s.get("maxLength", math.inf):
                continue
            return tail + "a" * max(0, int(s.get("minLength", 0)) - chars) + '"'
        raise _GiveUp("no alternative takes this string")

    def _close_key(self, stack: list[_Frame], body: str) -> str:
        """Finish a key whose text so far is `body`, then its value, then everything."""
        if body.endswith("\ufffd"):
            raise _GiveUp("cut inside a character")
        tail = _finish_escape(body)
        frame = stack[-1]
        for s in frame.schemas:
            names = list(s.get("required", [])) + list(s.get("properties", {}))
            for name in dict.fromkeys(names):
                raw = json.dumps(name, ensure_ascii=False)[1:]
                if name not in frame.keys and raw.startswith(body + tail):
                    frame.keys.append(name)
                    frame.schemas = [s]
                    frame.state = "next"
                    value = self.minimal_value(self._property(s, name))
                    return tail + raw[len(body + tail) :] + ":" + value + self._close_all(stack)
        raise _GiveUp("no property starts with this key")

    def _close_all(self, stack: list[_Frame]) -> str:
        """Close every open container, innermost first, from its current state."""
        out = []
        for depth in range(len(stack) - 1, -1, -1):
            frame = stack[depth]
            out.append(self._close_frame(frame))
            if depth:
                stack[depth - 1].state = "next"
                if stack[depth - 1].kind == "array":
                    stack[depth - 1].count += 1
        return "".join(out)

    def _close_frame(self, frame: _Frame) -> str:
        for s in frame.schemas:
            try:
                return self._close_one(frame, s)
            except _GiveUp:
                continue
        raise _GiveUp("no alternative closes this container")

    def _close_one(self, frame: _Frame, s: dict[str, Any]) -> str:
        if frame.kind == "array":
            item = s.get("items", {})
            out, count = "", frame.count
            if frame.state == "item":  # after a comma
                out, count = self.minimal_value(item), count + 1
            missing = max(0, int(s.get("minItems", 0)) - count)
            if missing and s.get("uniqueItems"):
                raise _GiveUp("uniqueItems")
            parts = ([out] if out else []) + [self.minimal_value(item)] * missing
            lead = "," if parts and frame.state == "next" else ""
            return lead + ",".join(parts) + "]"
        out = ""
        if frame.state == "colon":
            out = ":" + self.minimal_value(self._property(s, frame.keys[-1]))
        elif frame.state == "value":
            out = self.minimal_value(self._property(s, frame.keys[-1]))
        members = self._required_members(s, frame.keys)
        if frame.state == "key":  # after a comma: some property must follow
            if not members:
                members = self._next_optional(s, frame.keys)
            return ",".join(members) + "}"
        lead = "," if members and frame.state != "key?" else ""
        return out + lead + ",".join(members) + "}"

    def _next_optional(self, s: dict[str, Any], present: list[str]) -> list[str]:
        """One property to follow a comma when none is required: the first declared one
        after the last present (the backends emit properties in schema order)."""
        order = list(s.get("properties", {}))
        after = max((order.index(k) + 1 for k in present if k in order), default=0)
        for name in order[after:]:
            if name not in present:
                key = json.dumps(name, ensure_ascii=False)
                return [key + ":" + self.minimal_value(s["properties"][name])]
        raise _GiveUp("a comma with no property left to follow it")


def _string_end(text: str, start: int) -> int | None:
    """The index after the string opening at `start`, or None if it is not closed."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _finish_escape(body: str) -> str:
    """What completes a trailing escape in a string's text (`\\` or `\\u12`), or ""."""
    run = len(body) - len(body.rstrip("\\"))
    if run % 2:
        return "n"
    at = body.rfind("\\u")
    if at >= 0 and (len(body[:at]) - len(body[:at].rstrip("\\"))) % 2 == 0:
        digits = body[at + 2 :]
        if len(digits) < 4 and all(ch in "0123456789abcdefABCDEF" for ch in digits):
            pad = "0" * (4 - len(digits))
            if 0xD800 <= int((digits + pad), 16) <= 0xDFFF:
                raise _GiveUp("cut inside a surrogate escape")
            return pad
    if at >= 0 and len(body) - at == 6 and 0xD800 <= int(body[at + 2 :], 16) <= 0xDBFF:
        raise _GiveUp("cut between surrogate escapes")
    return ""


def closing_text(prefix: str, schema: dict[str, Any]) -> str | None:
    """What to append to `prefix` (a JSON value cut anywhere) so that the whole matches
    `schema`, as short as this module knows; "" if it already does; None if it cannot say
    (see the module docstring)."""
    try:
        return _Closer(schema).close(prefix)
    except (_GiveUp, ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None


def minimal_value(schema: dict[str, Any]) -> str | None:
    """The shortest instance of `schema` this module builds (compact JSON), or None."""
    return closing_text("", schema)
