"""schemathesis hooks for `test_openapi_schemathesis.py`: the rules across fields that the
OpenAPI document cannot state (JSON Schema has no way to count tokens, compare two fields'
values or parse a string as JSON), applied to the *schema-valid* cases only, so that
`positive_data_acceptance` checks what a client obeying docs/serving.md ("Rules across
fields") may send. Negative cases are left as generated.

Each rule repairs the case rather than dropping it (coverage kept): the repaired request is
what a client told the rule would have sent. The context-length rule needs the prompt's
length in tokens, which only the server knows (its chat template, its tokenizer): the hook
asks it with the same request at `max_tokens` 1 and reads `usage`.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import schemathesis
from schemathesis import GenerationMode

from pagedinfer.structured_output.backend_guidance import validate_guidance_spec
from pagedinfer.structured_output.specs import StructuredOutputOptions

BASE = os.environ.get("PAGEDINFER_SCHEMATHESIS_BASE", "")
MAX_MODEL_LEN = int(os.environ.get("PAGEDINFER_SCHEMATHESIS_MAX_MODEL_LEN", "0"))

# Completions and chat: the guided-decoding fields, at most one given
# (`serving_engine.request_structured_outputs`).
_GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Each generating route's output-length field, and where its usage counts the prompt.
_LENGTH = {
    "/v1/completions": ("max_tokens", "prompt_tokens"),
    "/v1/chat/completions": ("max_completion_tokens", "prompt_tokens"),
    "/v1/responses": ("max_output_tokens", "input_tokens"),
    "/v1/messages": ("max_tokens", "input_tokens"),
}


def _guided_given(body: dict[str, Any]) -> list[str]:
    given = [name for name in _GUIDED if body.get(name) is not None]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        given.insert(0, "response_format")
    return given


def _one_guided_field(body: dict[str, Any]) -> None:
    """At most one guided-decoding field: the first one given stays."""
    for name in _guided_given(body)[1:]:
        body[name] = None


def _tool_name(path: str, tool: dict[str, Any]) -> str:
    return tool["function"]["name"] if path == "/v1/chat/completions" else tool["name"]


def _choice(path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """A request's tool choice as ("none" | "auto" | "required" | "named", the object
    holding the named function's `name`); no choice: "auto" with tools, else "none"."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if body.get("tools") else "none"), None
    if isinstance(choice, str):
        return choice, None
    if path == "/v1/chat/completions":
        return "named", choice["function"]
    if path == "/v1/messages":
        kind = {"auto": "auto", "any": "required", "none": "none"}.get(choice["type"], "named")
        return kind, choice if kind == "named" else None
    return "named", choice


def _constrained(path: str, body: dict[str, Any]) -> list[str]:
    """The fields that constrain the output besides tools."""
    if path == "/v1/responses":
        fmt = (body.get("text") or {}).get("format") or {}
        return ["text"] if fmt.get("type", "text") != "text" else []
    return _guided_given(body) if path == "/v1/chat/completions" else []


def _tools_consistent(path: str, body: dict[str, Any]) -> None:
    """Tools: distinct function names; a tool choice other than "none" needs tools, a
    named one among them; a forced choice ("required", named) or strict tools constrain
    the output themselves, so no guided field or JSON format beside them
    (`tool_choice.plan_tools`)."""
    tools = body.get("tools") or []
    seen: set[str] = set()
    distinct = []
    for tool in tools:
        if _tool_name(path, tool) not in seen:
            seen.add(_tool_name(path, tool))
            distinct.append(tool)
    if tools:
        body["tools"] = distinct
    kind, named = _choice(path, body)
    if kind == "none":
        return
    if not distinct:
        body["tool_choice"] = {"type": "none"} if path == "/v1/messages" else "none"
        return
    if named is not None and named["name"] not in seen:
        named["name"] = _tool_name(path, distinct[0])
    strict = kind == "auto" and any(
        (t["function"] if path == "/v1/chat/completions" else t).get("strict") for t in distinct
    )
    if kind in ("required", "named") or strict:
        for name in _constrained(path, body):
            body[name] = None


def _call_arguments_are_objects(path: str, body: dict[str, Any]) -> None:
    """A history's tool-call `arguments` are the JSON text of an object (or empty)."""
    if path == "/v1/responses":
        items = body.get("input")
        holders = [i for i in items if i.get("type") == "function_call"] if isinstance(
            items, list) else []  # fmt: skip
    else:
        holders = [call["function"] for message in body.get("messages") or []
                   for call in message.get("tool_calls") or []]  # fmt: skip
    for holder in holders:
        text = holder.get("arguments", "{}")
        try:
            ok = text == "" or isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        if not ok:
            holder["arguments"] = "{}"


def _within_context(path: str, body: dict[str, Any], headers: dict[str, str]) -> bool:
    """The prompt plus the output length within `--max-model-len`: the output length is
    cut to the room the prompt leaves; False if the prompt leaves none. A request the
    server refuses at one output token for another reason is left as it is (its refusal
    is then what the check sees)."""
    if path == "/v1/completions" and body.get("max_tokens") == 0:
        return True  # scoring an echoed prompt: no output at all
    field, counted = _LENGTH[path]
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is not None:
        field = "max_tokens"  # chat: the older name, when the newer is not given
    asked = body.get(field)
    probe = {**body, field: 1, "stream": False}
    if path in ("/v1/completions", "/v1/chat/completions"):
        probe["min_tokens"] = 0
        probe.pop("stream_options", None)
    request = urllib.request.Request(
        BASE + path, json.dumps(probe).encode(), {**headers, "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            usage = json.load(answer).get("usage") or {}
    except urllib.error.HTTPError as refusal:
        return "maximum context length" not in refusal.read().decode(errors="replace")
    prompt = usage.get(counted)
    if not isinstance(prompt, int):
        return True
    room = MAX_MODEL_LEN - prompt
    if room < 1:
        return False
    if asked is not None and asked > room:
        body[field] = room
    # Unset, the output may fill the room (16 tokens on /v1/completions, as in OpenAI's API).
    limit = body.get(field) or (min(16, room) if path == "/v1/completions" else room)
    minimum = body.get("min_tokens")
    if isinstance(minimum, int) and minimum > limit:
        body["min_tokens"] = limit
    return True


def _integers(value: Any) -> Iterator[int]:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _integers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _integers(item)


def _spellable(value: Any) -> Any:
    """`value` with each character SmolLM2's vocabulary cannot write replaced by "x": six
    control characters and the unassigned planes 4-11 (U+40000-U+BFFFF, UTF-8 lead bytes
    F1, F2) have no byte token (its GGUF's `tokenizer.ggml.tokens`), so a prompt of them
    alone is empty and guided decoding rightly finds a choice or pattern needing one
    unsatisfiable."""
    if isinstance(value, str):
        return _UNSPELLABLE.sub("x", value)
    if isinstance(value, dict):
        return {_spellable(k): _spellable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_spellable(item) for item in value]
    return value


_UNSPELLABLE = re.compile("[\x04\x06\x13\x14\x16\x1d\U00040000-\U000bffff]")


def _compiles(kind: StructuredOutputOptions, spec: Any) -> bool:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    try:
        validate_guidance_spec(kind, text)
    except ValueError:
        return False
    return True


_STAND_INS = {
    StructuredOutputOptions.GRAMMAR: 'start: "x"',
    StructuredOutputOptions.REGEX: "x",
    StructuredOutputOptions.JSON: {"type": "object"},
}


def _specs_compile(path: str, body: dict[str, Any]) -> None:
    """Grammars, patterns and JSON schemas that the grammar compiler takes: the document
    can type them only as strings and objects, so one that does not compile is replaced
    by a stand-in of its kind."""
    grammar, regex, schema = (StructuredOutputOptions.GRAMMAR, StructuredOutputOptions.REGEX,
                              StructuredOutputOptions.JSON)  # fmt: skip
    holders: list[tuple[dict[str, Any], str, StructuredOutputOptions]] = [
        (body, "guided_grammar", grammar), (body, "guided_regex", regex),
        (body, "guided_json", schema),
    ]  # fmt: skip
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        holders += [(structured, "grammar", grammar), (structured, "regex", regex),
                    (structured, "json", schema)]  # fmt: skip
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        holders.append((fmt["json_schema"], "schema", schema))
    fmt = (body.get("text") or {}).get("format") if path == "/v1/responses" else None
    if isinstance(fmt, dict):
        holders.append((fmt, "schema", schema))
    for tool in body.get("tools") or []:
        if path == "/v1/chat/completions":
            holders.append((tool["function"], "parameters", schema))
        else:
            holders.append((tool, "input_schema" if path == "/v1/messages" else "parameters",
                            schema))  # fmt: skip
    for holder, key, kind in holders:
        spec = holder.get(key)
        if spec is not None and not _compiles(kind, spec):
            holder[key] = _STAND_INS[kind]


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    """A schema-valid case made to obey the rules across fields (repaired in place), or
    dropped where no repair can: a prompt longer than the context by itself, and integers
    beyond 64 bits (schemathesis's validator compares those as doubles, so 2**63 + 191
    passes for no greater than the document's bound 2**63 - 1; the server refuses it,
    rightly)."""
    meta = case.meta
    if meta is None or meta.generation.mode is not GenerationMode.POSITIVE:
        return True
    if not isinstance(case.body, dict):
        return True
    if not all(-(2**63) <= n < 2**63 for n in _integers(case.body)):
        return False
    case.body = body = _spellable(case.body)
    path = case.operation.path
    if path in ("/v1/completions", "/v1/chat/completions"):
        _one_guided_field(body)
    if path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        _tools_consistent(path, body)
    if path in ("/v1/chat/completions", "/tokenize", "/v1/responses"):
        _call_arguments_are_objects(path, body)
    if path in _LENGTH:
        _specs_compile(path, body)
    if path in _LENGTH and BASE:
        headers = {k: v for k, v in (case.headers or {}).items() if isinstance(v, str)}
        return _within_context(path, body, headers)
    return True
