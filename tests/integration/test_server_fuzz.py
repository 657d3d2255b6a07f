"""Fuzzing `pagedinfer serve` over HTTP: well over 500 malformed requests against a real
server process on loopback, built from the server's own OpenAPI schema (`GET /openapi.json`),
so that every POST route it declares (completions, chat, and /tokenize, /detokenize when
present) is covered without listing its fields here.

The rule under test: bad input gets a 4xx with an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`) for that request alone; nothing is ever
a 5xx or a hang, and afterwards the server is alive, correct and idle.

- a deterministic sweep: every field of every POST route, alone, with each of its malformed
  values (about 1,000 requests);
- hypothesis (derandomized, so CI runs the same requests): random mixes per POST route and
  unknown routes / wrong methods (about 700 requests);
- targeted requests for edges found or feared, each with the statuses a correct server may
  give, and last the checks that the server is alive, correct and has nothing left running.

Malformations: wrong JSON types for each field, out-of-range numbers (schema bounds +-1,
NaN/Infinity literals, 2**63/2**64/2**70), missing required fields, unknown models,
empty/huge/nested-wrong prompts and token ids (negative, >= the vocabulary, empty lists),
messages with wrong roles or unknown content parts, very long strings, lone surrogates,
logit_bias with non-int keys or out-of-vocab ids, stop lists of non-strings, extra unknown
fields, duplicate keys, truncated JSON, JSON arrays/scalars instead of objects, deep nesting,
5,000-digit numbers, invalid UTF-8 and non-JSON bodies, wrong content types, a wrong or
missing API key, wrong HTTP methods on known routes, unknown routes.

Every request is kept cheap: a body that could be valid always carries `max_tokens` (and
`max_completion_tokens`, `max_output_tokens`) <= 4 unless the malformation is about that
field, and then it is given only values that must be rejected. Failures are recorded, not
raised (no shrinking: a hang would cost a timeout per shrink step), and every distinct one is
reported at the end.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = pytest.mark.integration

requests = pytest.importorskip("requests")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ENGINE = small_engine_flags(max_model_len=256)
KEY = "sk-fuzz-key"
MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 256
TIMEOUT = 30.0  # seconds per request; every valid fuzz request generates <= 4 tokens
FUZZ_PER_ROUTE = 150  # random malformed requests per POST route of the schema (at least)
FUZZ_MIN_POST = 500  # ... and at least this many over all POST routes together
FUZZ_ROUTING = 100  # unknown routes and wrong methods
MIN_REQUESTS = 500
MAX_CHEAP_TOKENS = 4
# Fields that bound the work a request does: always set (small) unless being fuzzed.
COST_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CONTENT_FIELDS = ("prompt", "messages", "tokens", "input")  # what a route works on

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def server():
    """`pagedinfer serve` with an API key (so that both the 401 path and validation are
    fuzzed); its output goes to a file (hundreds of error lines would fill a pipe)."""
    srv = ServerProcess("--api-key", KEY, *ENGINE)
    yield srv.base
    srv.stop(graceful_timeout_s=10)


# --------------------------------------------------------------------------- requests


@dataclass
class Req:
    """One HTTP request. `openai_error`: a 4xx must have the OpenAI error body (a known
    route and method); otherwise (FastAPI's own 404/405) any JSON object is accepted."""

    kind: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    openai_error: bool = True

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 240 else self.body[:240]
        more = "" if self.body is None or len(self.body) <= 240 else f"...({len(self.body)} B)"
        return f"<{self.kind}: {self.method} {self.path} {self.headers} {body!r}{more}>"


@dataclass
class Tally:
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    # (status, sorted top-level keys of the body) seen for FastAPI-routed errors (404/405).
    plain_error_shapes: set[tuple[int, tuple[str, ...]]] = field(default_factory=set)


TALLY = Tally()


def _auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _json_headers() -> dict[str, str]:
    return {"Content-Type": "application/json", **_auth()}


def _dumps(obj: Any) -> bytes:
    """JSON with NaN/Infinity literals allowed and lone surrogates kept as \\u escapes."""
    return json.dumps(obj, allow_nan=True).encode()


def _send(base: str, req: Req, timeout: float = TIMEOUT) -> requests.Response:
    return requests.request(
        req.method,
        base + req.path,
        data=req.body,
        headers=req.headers,
        timeout=timeout,
        allow_redirects=False,
    )


def _problem(req: Req, resp: requests.Response) -> str | None:
    """What is wrong with the answer to a malformed request, or None."""
    status = resp.status_code
    text = resp.text[:300]
    if status >= 500:
        return f"{status} {text!r}"
    if 300 <= status < 400:  # e.g. FastAPI's trailing-slash redirect
        return None if resp.headers.get("location") else f"{status} without Location"
    if req.method == "HEAD":
        return None
    ctype = resp.headers.get("content-type", "")
    anthropic = req.path.startswith("/v1/messages")
    if status < 300:
        if "text/event-stream" in ctype and req.path.startswith(("/v1/messages", "/v1/responses")):
            # Typed events (`event: NAME`), ended by the API's last event, no [DONE].
            names = [ln[7:] for ln in resp.text.splitlines() if ln.startswith("event: ")]
            last = "message_stop" if anthropic else ("response.completed", "response.incomplete")
            if not names or names[-1] not in last:
                return f"{status} stream not ended by its last event: {resp.text[-300:]!r}"
            return None
        if "text/event-stream" in ctype:
            events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"{status} SSE stream not ended by [DONE]: {resp.text[-300:]!r}"
            for event in events[:-1]:
                try:
                    chunk = json.loads(event)
                except ValueError:
                    return f"{status} SSE event is not JSON: {event[:300]!r}"
                if "error" in chunk:
                    return f"{status} SSE stream carries an error: {event[:300]!r}"
            return None
        try:
            json.loads(resp.content)
        except ValueError:
            return f"{status} body is not JSON: {text!r}"
        return None
    try:
        body = json.loads(resp.content)
    except ValueError:
        return f"{status} error body is not JSON ({ctype}): {text!r}"
    if not isinstance(body, dict):
        return f"{status} error body is not a JSON object: {text!r}"
    if not req.openai_error:
        TALLY.plain_error_shapes.add((status, tuple(sorted(body))))
        return None
    err = body.get("error")
    if anthropic:  # Anthropic's shape: {"type": "error", "error": {...}}
        if body.get("type") != "error" or not isinstance(err, dict):
            return f"{status} error body is not Anthropic-style: {text!r}"
        if not isinstance(err.get("type"), str) or not str(err.get("message", "")).strip():
            return f"{status} Anthropic error without a type or message: {text!r}"
        return None
    if not isinstance(err, dict):
        return f"{status} error body is not OpenAI-style: {text!r}"
    if not isinstance(err.get("message"), str) or not err["message"].strip():
        return f"{status} error without a message: {text!r}"
    if not isinstance(err.get("type"), str) or not err["type"]:
        return f"{status} error without a type: {text!r}"
    for key in ("param", "code"):
        if key not in err:
            return f"{status} error without {key!r}: {text!r}"
    return None


def _run_one(base: str, req: Req, timeout: float = TIMEOUT) -> tuple[int | None, str | None]:
    """Send `req`, count it; returns (status or None, what is wrong with the answer)."""
    TALLY.sent += 1
    try:
        resp = _send(base, req, timeout)
    except requests.exceptions.Timeout:
        return None, f"no answer within {timeout:.0f} s (hang)"
    except requests.exceptions.RequestException as exc:
        return None, f"connection error: {exc!r}"
    TALLY.statuses[resp.status_code] = TALLY.statuses.get(resp.status_code, 0) + 1
    return resp.status_code, _problem(req, resp)


def _assert_alive(base: str) -> None:
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    resp = requests.post(base + "/v1/completions", json=body, headers=_auth(), timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"]


# --------------------------------------------------------------------------- the schema


@pytest.fixture(scope="module")
def openapi(server) -> dict[str, Any]:
    resp = requests.get(server + "/openapi.json", timeout=30)
    assert resp.status_code == 200
    spec = resp.json()
    assert spec["paths"], spec
    return spec


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        node: Any = spec
        for part in ref[2:].split("/"):
            node = node[part]
        schema = node
    return schema


def _variants(schema: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of an anyOf/oneOf (resolved), or [schema]."""
    schema = _resolve(schema, spec)
    alts = schema.get("anyOf") or schema.get("oneOf")
    if alts:
        return [v for alt in alts for v in _variants(alt, spec)]
    return [schema]


def _types(schema: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """The JSON types a field accepts ("any" when the schema does not say)."""
    out = set()
    for v in _variants(schema, spec):
        t = v.get("type")
        if isinstance(t, list):
            out.update(t)
        elif t:
            out.add(t)
        elif "enum" in v and all(isinstance(x, str) for x in v["enum"]):
            out.add("string")
        else:
            out.add("any")
    return out


def _is_message_list(schema: dict[str, Any], spec: dict[str, Any]) -> bool:
    for v in _variants(schema, spec):
        if v.get("type") == "array":
            item = _resolve(v.get("items", {}), spec)
            if "role" in item.get("properties", {}):
                return True
    return False


def _is_int_list(schema: dict[str, Any], spec: dict[str, Any]) -> bool:
    return any(
        v.get("type") == "array" and _resolve(v.get("items", {}), spec).get("type") == "integer"
        for v in _variants(schema, spec)
    )


# --------------------------------------------------------------------------- strategies

SHORT_TEXTS = ["Hello", "The capital of France is", "1, 2, 3,", "Bonjour", "x"]
token_id = st.integers(0, VOCAB_SIZE - 1)
token_ids = st.lists(token_id, min_size=1, max_size=4)


def _roles(spec: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    for v in _variants(schema, spec):
        item = _resolve(v.get("items", {}), spec)
        role = item.get("properties", {}).get("role")
        if role:
            for rv in _variants(role, spec):
                if "enum" in rv:
                    return list(rv["enum"])
    return ["user"]


def _valid_messages(roles: list[str]) -> st.SearchStrategy:
    content = st.one_of(
        st.sampled_from(SHORT_TEXTS),
        st.lists(
            st.builds(lambda t: {"type": "text", "text": t}, st.sampled_from(SHORT_TEXTS)),
            min_size=1,
            max_size=2,
        ),
    )
    message = st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(roles), content)
    return st.lists(message, min_size=1, max_size=2)


def _valid(name: str, schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy:
    """Cheap, (mostly) valid values for a field: the baseline a malformation starts from."""
    if name in COST_FIELDS:
        return st.integers(1, MAX_CHEAP_TOKENS)
    if name == "model":
        return st.sampled_from([MODEL, None])
    if name == "n":
        return st.integers(1, 2)
    if name == "prompt":
        prompt = st.one_of(
            st.sampled_from(SHORT_TEXTS),
            token_ids,
            st.lists(st.sampled_from(SHORT_TEXTS), min_size=1, max_size=2),
            st.lists(token_ids, min_size=1, max_size=2),
        )
        types = _types(schema, spec)
        return prompt if "array" in types else st.sampled_from(SHORT_TEXTS)
    if _is_message_list(schema, spec):
        return _valid_messages(_roles(spec, schema))
    if name in ("logprobs", "top_logprobs") and "integer" in _types(schema, spec):
        return st.integers(0, 3)
    if name == "min_tokens":
        return st.integers(0, 1)
    if name == "logit_bias":
        return st.dictionaries(token_id.map(str), st.floats(-5, 5), max_size=2)
    if name == "stop":
        return st.one_of(st.sampled_from(["\n", "."]), st.lists(st.sampled_from(["\n", "."])))
    if _is_int_list(schema, spec):
        return st.lists(token_id, max_size=4)
    return _valid_from_schema(schema, spec, depth=0)


def _valid_from_schema(schema: dict[str, Any], spec: dict[str, Any], depth: int):
    alts = []
    for v in _variants(schema, spec):
        t = v.get("type")
        if "enum" in v:
            alts.append(st.sampled_from(v["enum"]))
        elif t == "null":
            alts.append(st.none())
        elif t == "boolean":
            alts.append(st.booleans())
        elif t == "integer":
            lo = int(v.get("minimum", -5))
            hi = int(v.get("maximum", lo + 20))
            alts.append(st.integers(lo, min(hi, lo + 20)))
        elif t == "number":
            lo = v.get("minimum", v.get("exclusiveMinimum", -5.0))
            hi = v.get("maximum", lo + 10.0)
            alts.append(
                st.floats(
                    lo, hi, exclude_min="exclusiveMinimum" in v, allow_nan=False, width=32
                ).map(float)
            )
        elif t == "string":
            alts.append(st.text(max_size=12))
        elif t == "array" and depth < 2:
            item = v.get("items", {})
            alts.append(
                st.lists(
                    _valid_from_schema(item, spec, depth + 1),
                    min_size=int(v.get("minItems", 0)),
                    max_size=2,
                )
            )
        elif t == "object" and depth < 2:
            props = v.get("properties", {})
            alts.append(
                st.fixed_dictionaries(
                    {},
                    optional={k: _valid_from_schema(s, spec, depth + 1) for k, s in props.items()},
                )
            )
    return st.one_of(alts) if alts else st.none()


# Values of each JSON type; a field gets the ones of types it does not accept.
WRONG_TYPE_POOL: dict[str, list[Any]] = {
    "null": [None],
    "boolean": [True, False],
    "integer": [0, -1, 7, 2**40],
    "number": [0.5, -3.25, 1e-300, 1.5e10],
    "string": ["", "abc", "1", "true", "null", "NaN", "1e3", "-1", " ", "\x00", "\ud800", "💥💥"],
    "array": [[], [None], ["a", 1], [[1, 2]], [{}], [1.5]],
    "object": [{}, {"a": 1}, {"text": "x"}, {"role": "user"}, {"0": None}],
}
HUGE_INTS = [2**63, 2**64, 2**70, 10**30, -(2**63) - 1, -(2**70)]
SPECIAL_FLOATS = [NAN, INF, -INF, 1e308, -1e308, 5e-324]
LONG_STRINGS = ["x" * 100_000, "Hello world. " * 3_000, "é" * 50_000, "\u0000" * 1_000]


def _costly(name: str, value: Any) -> bool:
    """A value pydantic would accept for a cost field that lets a request generate more
    than MAX_CHEAP_TOKENS tokens ("5", True is 1 and fine, 1.5e10 is an int to pydantic)."""
    if name not in COST_FIELDS or isinstance(value, bool):
        return False
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            return False
    if isinstance(value, float) and (value != value or not value.is_integer()):
        return False
    return isinstance(value, (int, float)) and MAX_CHEAP_TOKENS < value < 2**64


def _wrong_type_values(
    name: str, schema: dict[str, Any], spec: dict[str, Any], compact: bool = False
) -> list[Any]:
    accepted = _types(schema, spec)
    if "any" in accepted:
        return []
    out = []
    for t, values in WRONG_TYPE_POOL.items():
        if t in accepted or (t == "integer" and "number" in accepted):
            continue
        out.extend(values[:2] if compact else values)
    if "integer" in accepted and "number" not in accepted:
        out.extend([1.5] if compact else [0.5, 1.5, -2.25])
    return [v for v in out if not _costly(name, v)]


def _out_of_range_values(
    name: str, schema: dict[str, Any], spec: dict[str, Any], compact: bool = False
) -> list[Any]:
    out: list[Any] = []
    for v in _variants(schema, spec):
        t = v.get("type")
        if t in ("integer", "number"):
            lo, hi, xlo = v.get("minimum"), v.get("maximum"), v.get("exclusiveMinimum")
            if lo is not None:
                out += [lo - 1] if compact else [lo - 1, lo - 100]
                if t == "number":
                    out.append(lo - 1e-6)
            if xlo is not None:
                out += [xlo, xlo - 1]
            if hi is not None:
                out += [hi + 1, 1e9] if compact else [hi + 1, hi * 1000 + 1, 1e9]
                if t == "number":
                    out.append(hi + 1e-6)
            if compact:
                out += [2**63, 2**64, -(2**63) - 1, NAN, INF, -INF, 1e308]
            else:
                out += HUGE_INTS + SPECIAL_FLOATS
        elif t == "string":
            out += LONG_STRINGS[:1] if compact else list(LONG_STRINGS)
            out += ["\ud800", "a\x00b"] if compact else ["\ud800", "\udfff\ud800", "a\x00b"]
        elif t == "array":
            item = _resolve(v.get("items", {}), spec)
            if item.get("type") == "string":
                out.append(["x" * 100_000])
                if name not in CONTENT_FIELDS:  # 5,000 prompts would be 5,000 requests
                    out.append(["x"] * 5_000)
            out += [[[[[]]]], [None] * 3]
    return [v for v in out if not _costly(name, v)]


def _semantic_values(name: str, schema: dict[str, Any], spec: dict[str, Any]) -> list[Any]:
    """Malformations that need to know what a field means (chosen by name or shape)."""
    if name == "prompt":
        return [
            [],
            [[]],
            [""],
            "",
            [[1, "a"]],
            [["a"]],
            [[[1]]],
            [[-1]],
            [[VOCAB_SIZE]],
            [-5],
            [VOCAB_SIZE],
            [VOCAB_SIZE - 1, VOCAB_SIZE],
            [2**70],
            [2**64],
            [1.5],
            [True],
            [None],
            [1, "a"],
            ["a", 1],
            [[1], "a"],
            {"a": 1},
            [1] * MAX_MODEL_LEN,
            [[1] * 300],
            "Hello world. " * 400,
            ["x", "Hello world. " * 400],
            [[2**63]],
        ]
    if _is_message_list(schema, spec):
        user = "user"
        return [
            [],
            [{}],
            [None],
            ["user"],
            {"role": user, "content": "x"},
            [{"role": "wizard", "content": "x"}],
            [{"role": "USER", "content": "x"}],
            [{"role": None, "content": "x"}],
            [{"role": 1, "content": "x"}],
            [{"content": "x"}],
            [{"role": user, "content": 5}],
            [{"role": user, "content": {"type": "text", "text": "x"}}],
            [{"role": user, "content": ["x"]}],
            [{"role": user, "content": [{"type": "text"}]}],
            [{"role": user, "content": [{"text": "x"}]}],
            [{"role": user, "content": [{"type": "text", "text": 5}]}],
            [{"role": user, "content": [{"type": "text", "text": None}]}],
            [{"role": user, "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": user, "content": [{"type": "input_audio", "input_audio": {}}]}],
            [{"role": user, "content": [{"type": "wat"}]}],
            [{"role": user, "content": [None]}],
            [{"role": user, "content": [[]]}],
            [{"role": user, "content": "Hello world. " * 400}],
            [{"role": user, "content": "x" * 100_000}],
            [{"role": user, "content": [{"type": "text", "text": "x"}] * 500}],
            [{"role": user, "content": "x"}] * 2_000,
            [{"role": user, "content": "\ud800"}],
            [{"role": "tool", "content": None}],
            [{"role": "assistant", "content": []}],
        ]
    if name == "logit_bias":
        return [
            {"abc": 1},
            {"1.5": 1},
            {"-1": 1},
            {str(VOCAB_SIZE): 1},
            {"": 1},
            {"1e3": 1},
            {"0x10": 1},
            {" 7": 1},
            {"99999999999999999999999": 1},
            {"1": "a"},
            {"1": None},
            {"1": [1]},
            {"1": NAN},
            {"1": INF},
            {"1": -INF},
            {"1": 1e308},
            {str(i): 1.0 for i in range(5_000)},
            [1, 2],
        ]
    if name == "stop":
        return [[1, 2], [None], [""], "", [["a"]], {"a": 1}, ["x"] * 1_000, "x" * 10_000, [1.5]]
    if name == "stream_options":
        return [{"include_usage": "maybe"}, [], "yes", {"include_usage": None}]
    if _is_int_list(schema, spec):
        return [
            [-1],
            [VOCAB_SIZE],
            [2**63],
            [2**64],
            [10**100],
            [1.5],
            ["1"],
            ["a"],
            [[1]],
            [None],
            [NAN],
            [1] * 100_000,
            list(range(VOCAB_SIZE - 2, VOCAB_SIZE + 2)),
        ]
    return []


UNKNOWN_MODELS = [
    "gpt-4",
    "",
    " " + MODEL,
    MODEL.lower(),
    MODEL + "\x00",
    "../../etc/passwd",
    "m" * 10_000,
    "\ud800",
]


@dataclass
class Route:
    path: str
    props: dict[str, dict[str, Any]]
    required: list[str]
    # category ("wrong_type", "out_of_range", "semantic", "unknown_model") -> field name ->
    # malformed values for it; `field_values` merges the categories.
    pools: dict[str, dict[str, list[Any]]]
    field_values: dict[str, st.SearchStrategy]


def _post_routes(spec: dict[str, Any], compact: bool = False) -> list[Route]:
    """The POST routes of the schema with their fields' malformed values (`compact`: fewer
    values of the same kinds, for the exhaustive sweep)."""
    routes = []
    for path, ops in sorted(spec["paths"].items()):
        op = ops.get("post")
        if not op:
            continue
        content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
        schema = _resolve(content.get("schema", {"type": "object"}), spec)
        props = schema.get("properties", {})
        pools: dict[str, dict[str, list[Any]]] = {}
        for name, sub in props.items():
            for category, bad in (
                ("wrong_type", _wrong_type_values(name, sub, spec, compact)),
                ("out_of_range", _out_of_range_values(name, sub, spec, compact)),
                ("semantic", _semantic_values(name, sub, spec)),
                (
                    "unknown_model",
                    UNKNOWN_MODELS[: 4 if compact else None] if name == "model" else [],
                ),
            ):
                if bad:
                    pools.setdefault(category, {})[name] = bad
        merged: dict[str, list[Any]] = {}
        for per_field in pools.values():
            for name, bad in per_field.items():
                merged.setdefault(name, []).extend(bad)
        values = {name: st.sampled_from(bad) for name, bad in merged.items()}
        routes.append(Route(path, props, list(schema.get("required", [])), pools, values))
    return routes


def _baseline(route: Route, spec: dict[str, Any]) -> st.SearchStrategy:
    """A cheap, possibly valid body: required fields, cost bounds, some optional fields."""
    always = {n: _valid(n, s, spec) for n, s in route.props.items() if n in route.required}
    always.update({n: _valid(n, route.props[n], spec) for n in COST_FIELDS if n in route.props})
    optional = {n: _valid(n, s, spec) for n, s in route.props.items() if n not in always}
    return st.fixed_dictionaries(always, optional=optional)


EXTRA_FIELDS = st.dictionaries(
    st.sampled_from(["foo", "best_of", "suffix", "functions", "tools", "__proto__", "x" * 300]),
    st.sampled_from([None, 1, "x", [], {}, {"a": [1]}, -(2**70), NAN]),
    min_size=1,
    max_size=3,
)


def _body_request(kind: str, path: str, body: Any) -> Req:
    return Req(kind, "POST", path, _dumps(body), _json_headers())


@st.composite
def _field_malformation(draw, route: Route, spec: dict[str, Any]) -> Req:
    """One field (sometimes two or three) given a value of one malformation category."""
    body = dict(draw(_baseline(route, spec)))
    category = draw(st.sampled_from(sorted(route.pools)))
    pool = route.pools[category]
    name = draw(st.sampled_from(sorted(pool)))
    body[name] = draw(st.sampled_from(pool[name]))
    chosen = [name]
    if draw(st.integers(0, 3)) == 0:  # more malformed fields, of any category
        others = sorted(set(route.field_values) - {name})
        for other in draw(st.lists(st.sampled_from(others), max_size=2, unique=True)):
            body[other] = draw(route.field_values[other])
            chosen.append(other)
    kind = f"{category}:" + ",".join(chosen)
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(EXTRA_FIELDS))
        kind += "+extra"
    return _body_request(kind, route.path, body)


@st.composite
def _structural_malformation(draw, route: Route, spec: dict[str, Any]) -> Req:
    body = dict(draw(_baseline(route, spec)))
    how = draw(
        st.sampled_from(["missing", "empty", "extra", "duplicate_bad_last", "duplicate_bad_first"])
    )
    if how == "missing":
        gone = route.required or sorted(set(route.props) - set(COST_FIELDS))
        drop = draw(st.lists(st.sampled_from(gone), min_size=1, unique=True)) if gone else []
        for name in drop:
            body.pop(name, None)
        return _body_request("missing:" + ",".join(drop), route.path, body)
    if how == "empty":
        return _body_request("empty_object", route.path, {})
    if how == "extra":
        body.update(draw(EXTRA_FIELDS))
        return _body_request("extra_fields", route.path, body)
    # Duplicate keys: json.loads keeps the last one.
    names = sorted(route.field_values)
    name = draw(st.sampled_from(names))
    bad = _dumps({name: draw(route.field_values[name])})[1:-1]
    good = _dumps(body)[1:-1]
    parts = [good, bad] if how == "duplicate_bad_last" else [bad, good]
    raw = b"{" + b", ".join(p for p in parts if p) + b"}"
    return Req(f"{how}:{name}", "POST", route.path, raw, _json_headers())


@st.composite
def _raw_malformation(draw, route: Route, spec: dict[str, Any]) -> Req:
    good = _dumps(draw(_baseline(route, spec)))
    how = draw(
        st.sampled_from(
            [
                "truncated",
                "invalid_utf8",
                "not_json",
                "array",
                "scalar",
                "empty_body",
                "deep_nesting",
                "cesu_surrogate",
                "bom",
                "trailing_garbage",
                "number_literal",
            ]
        )
    )
    if how == "truncated":
        cut = draw(st.integers(0, max(0, len(good) - 1)))
        raw = good[:cut]
    elif how == "invalid_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80"]))
        where = draw(st.integers(0, len(good)))
        raw = good[:where] + junk + good[where:]
        starts = [i + 4 for i in range(len(good)) if good[i : i + 4] == b'": "']
        if starts and draw(st.booleans()):  # inside a string value: well-formed JSON
            where = draw(st.sampled_from(starts))
            raw = good[:where] + junk + good[where:]
    elif how == "not_json":
        raw = draw(
            st.sampled_from(
                [b"not json", b"prompt=hi&max_tokens=1", b"<xml/>", b"\x00\x01\x02", b"{{}}"]
            )
        )
    elif how == "array":
        raw = b"[" + good + b"]"
    elif how == "scalar":
        raw = draw(st.sampled_from([b"null", b"1", b'"prompt"', b"true", b"NaN", b"-Infinity"]))
    elif how == "empty_body":
        raw = b""
    elif how == "deep_nesting":
        depth = draw(st.sampled_from([100, 5_000, 100_000]))
        key = draw(st.sampled_from(sorted(route.props) or ["x"]))
        raw = b'{"' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "cesu_surrogate":
        raw = json.dumps({"prompt": "\ud800", "tokens": [1]}, ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    elif how == "bom":
        raw = b"\xef\xbb\xbf" + good
    elif how == "trailing_garbage":
        raw = good + draw(st.sampled_from([b"}", b" x", b",", b"\x00", b"{}"]))
    else:  # number_literal: NaN/Infinity, 1e999, a 5000-digit integer where a number goes
        num = [
            n
            for n, s in route.props.items()
            if {"number", "integer"} & _types(s, spec) and n not in COST_FIELDS
        ]
        name = draw(st.sampled_from(num or ["max_tokens"]))
        lit = draw(
            st.sampled_from(
                [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"9" * 5_000, b"-0"]
            )
        )
        raw = good[:-1] + (b", " if good != b"{}" else b"") + b'"' + name.encode() + b'": '
        raw += lit + b"}"
    return Req(f"raw:{how}", "POST", route.path, raw, _json_headers())


@st.composite
def _header_malformation(draw, route: Route, spec: dict[str, Any]) -> Req:
    body = _dumps(draw(_baseline(route, spec)))
    how = draw(st.sampled_from(["content_type", "no_content_type", "bad_auth", "no_auth"]))
    headers = _json_headers()
    if how == "content_type":
        headers["Content-Type"] = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/xml",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=xyz",
                    "application/json; charset=latin-1",
                    "application/vnd.api+json",
                    "application/octet-stream",
                    "*/*",
                    "application/",
                    ";;;",
                ]
            )
        )
        if draw(st.booleans()):
            headers["Content-Encoding"] = "gzip"  # a lie: the body is not compressed
    elif how == "no_content_type":
        headers.pop("Content-Type")
    elif how == "bad_auth":
        headers["Authorization"] = draw(
            st.sampled_from(["Bearer wrong", "Bearer", "Basic Zm9vOmJhcg==", KEY, "Bearer " * 50])
        )
    else:
        headers.pop("Authorization")
    return Req(f"header:{how}", "POST", route.path, body, headers)


UNKNOWN_PATHS = [
    "/",
    "/v1",
    "/v1/",
    "/v2/completions",
    "/v1/complete",
    "/v1/chat",
    "/v1/chat/completion",
    "/v1/completions/1",
    "/v1/completions/",
    "/v1/embeddings",
    "/v1/models/" + MODEL,
    "/v1/models/nope",
    "/v1//completions",
    "/%00",
    "/%ff%fe",
    "/..%2f..%2fetc%2fpasswd",
    "/v1/completions%00",
    "/docs/../v1/completions",
    "/" + "a" * 4_000,
]


@st.composite
def _route_malformation(draw, spec: dict[str, Any]) -> Req:
    """Unknown routes and wrong methods on known ones (FastAPI answers these)."""
    if draw(st.booleans()):
        path = draw(
            st.one_of(
                st.sampled_from(UNKNOWN_PATHS),
                st.text(min_size=1, max_size=20).map(lambda s: "/" + urllib.parse.quote(s)),
            )
        )
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
        body = _dumps({"prompt": "x", "max_tokens": 1}) if method != "GET" else None
        return Req("unknown_route", method, path, body, _json_headers())
    path = draw(st.sampled_from(sorted(spec["paths"])))
    allowed = {m.upper() for m in spec["paths"][path]}
    wrong = sorted({"GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"} - allowed)
    method = draw(st.sampled_from(wrong))
    body = _dumps({"prompt": "x", "max_tokens": 1}) if method in ("PUT", "PATCH") else None
    return Req("wrong_method", method, path, body, _json_headers(), openai_error=method != "HEAD")


def _post_strategy(route: Route, spec: dict[str, Any]) -> st.SearchStrategy:
    """Malformed requests to one POST route: half of them about single fields."""
    return st.one_of(
        _field_malformation(route, spec),
        _field_malformation(route, spec),
        _field_malformation(route, spec),
        _structural_malformation(route, spec),
        _raw_malformation(route, spec),
        _header_malformation(route, spec),
    )


# --------------------------------------------------------------------------- tests


def test_schema_has_the_post_routes(openapi) -> None:
    posts = {r.path for r in _post_routes(openapi)}
    assert {"/v1/completions", "/v1/chat/completions"} <= posts, posts


class _Campaign:
    """Sends requests and records what is wrong with their answers. Stops sending once the
    server is dead (a 5xx or no answer, then /health not 200), naming the request that
    killed it: every later answer would be the same 503."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.sent = 0
        self.by_path: dict[str, int] = {}
        self.failures: list[str] = []
        self.dead: str | None = None
        if not _healthy(server):
            pytest.fail("the server was already dead before this test (an earlier test?)")

    def send(self, req: Req) -> None:
        if self.dead:
            return
        self.sent += 1
        self.by_path[req.path] = self.by_path.get(req.path, 0) + 1
        status, problem = _run_one(self.server, req)
        if problem is None:
            return
        self.failures.append(f"{problem}\n    request: {req!r}")
        if (status is None or status >= 500) and not _healthy(self.server):
            self.dead = f"DEAD (/health not 200) right after {req!r}"

    def check(self, what: str, routes: list[Route]) -> None:
        """Every answer was right, and the server is still alive and correct."""
        alive = self.dead or "alive and correct"
        if not self.dead:
            try:
                _assert_alive(self.server)
            except (AssertionError, OSError, requests.exceptions.RequestException) as exc:
                alive = f"NOT alive or not correct: {exc!r}"[:600]
        print(
            f"\n{what}: {self.sent} requests, {len(self.failures)} bad answers; by route "
            f"{ {r.path: self.by_path.get(r.path, 0) for r in routes} }; all statuses so far "
            f"{dict(sorted(TALLY.statuses.items()))}; FastAPI-routed error shapes "
            f"{sorted(TALLY.plain_error_shapes)}; server {alive}"
        )
        unique: dict[str, str] = {}
        for failure in self.failures:  # in order: the first of a kind is the one to fix
            unique.setdefault(failure.split("\n")[0][:100], failure)
        assert not self.failures and alive == "alive and correct", (
            f"{what}: {len(self.failures)} of {self.sent} malformed requests got a bad answer "
            f"({len(unique)} distinct); afterwards the server is {alive}:\n"
            + "\n".join(list(unique.values())[:40])
        )


def _healthy(server: str) -> bool:
    try:
        return requests.get(server + "/health", timeout=10).status_code == 200
    except requests.exceptions.RequestException:
        return False


def _fixed_valid(name: str, schema: dict[str, Any], spec: dict[str, Any]) -> Any:
    if name == "prompt":
        return "Hello"
    if _is_message_list(schema, spec):
        return [{"role": "user", "content": "Hello"}]
    if _is_int_list(schema, spec):
        return [1, 2]
    resolved = _resolve(schema, spec)
    if "default" in resolved:
        return resolved["default"]
    first = _variants(schema, spec)[0]
    return {
        "string": "x",
        "integer": int(first.get("minimum", 1)),
        "number": float(first.get("minimum", 1.0)),
        "boolean": False,
        "array": [],
        "object": {},
    }.get(first.get("type"))


def _minimal_body(route: Route, spec: dict[str, Any]) -> dict[str, Any]:
    """A valid, cheap body: the required fields, one content field, max_tokens 1."""
    body = {n: _fixed_valid(n, route.props[n], spec) for n in route.required}
    if not any(n in body for n in CONTENT_FIELDS):
        for name in CONTENT_FIELDS:
            if name in route.props:
                body[name] = _fixed_valid(name, route.props[name], spec)
                break
    body.update({n: 1 for n in COST_FIELDS if n in route.props})
    return body


def _sweep(route: Route, spec: dict[str, Any]):
    """Every malformed value of every field of the route, one at a time, on a valid body."""
    base = _minimal_body(route, spec)
    for name in sorted(route.props):
        for category, per_field in sorted(route.pools.items()):
            for value in per_field.get(name, []):
                body = dict(base)
                if name in CONTENT_FIELDS and name not in route.required:
                    for other in CONTENT_FIELDS:  # e.g. /tokenize wants exactly one
                        if other not in route.required:
                            body.pop(other, None)
                body[name] = value
                yield _body_request(f"sweep:{category}:{name}", route.path, body)


def test_every_field_with_every_malformed_value(server, openapi) -> None:
    """Deterministic sweep over the schema: each field of each POST route, alone, with each
    of its malformed values (wrong types, out of range, semantic); nothing may be a 5xx, a
    hang or an error without the OpenAI body, and the server stays alive and correct."""
    routes = _post_routes(openapi, compact=True)
    campaign = _Campaign(server)
    for route in routes:
        for req in _sweep(route, openapi):
            campaign.send(req)
    campaign.check("sweep", routes)
    assert campaign.sent >= MIN_REQUESTS, campaign.sent


def test_fuzz_malformed_requests(server, openapi) -> None:
    """Hypothesis: at least FUZZ_PER_ROUTE random malformed requests to every POST route of
    the schema (fields mixed, structure, raw bytes, headers), plus unknown routes and wrong
    methods; nothing may be a 5xx, a hang or an error without the OpenAI body (FastAPI's own
    404/405: any JSON), and the server stays alive and correct."""
    routes = _post_routes(openapi)
    per_route = max(FUZZ_PER_ROUTE, -(-FUZZ_MIN_POST // len(routes)))
    campaign = _Campaign(server)

    def fuzz(strategy: st.SearchStrategy, examples: int) -> None:
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            # No shrinking: failures are recorded, not raised (a hang would cost a timeout
            # per shrink step), and every distinct one is reported at the end.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.large_base_example,
            ],
        )
        @given(data=st.data())
        def run(data) -> None:
            campaign.send(data.draw(strategy, label="request"))

        run()

    for route in routes:
        fuzz(_post_strategy(route, openapi), per_route)
    fuzz(_route_malformation(openapi), FUZZ_ROUTING)
    campaign.check("fuzz", routes)
    assert campaign.sent >= MIN_REQUESTS, campaign.sent
    for route in routes:
        assert campaign.by_path.get(route.path, 0) >= per_route, campaign.by_path


# Targeted cases: each a minimal request for an edge the random mix may not hit, with the
# statuses a correct server may give. `timeout` is short where a correct answer is instant.
TARGETED: list[tuple[str, str, Any, set[int], float]] = [
    # Integers beyond int64/uint64 must be rejected, not crash msgpack in the engine client.
    ("seed_2**64", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**64}, {400}, 30),
    ("seed_-2**63-1", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": -(2**63) - 1}, {400}, 30),  # noqa: E501
    ("seed_2**64_stream", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**64, "stream": True}, {400}, 30),  # noqa: E501
    ("seed_2**64-1_n2", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**64 - 1, "n": 2}, {200, 400}, 30),  # noqa: E501
    ("chat_seed_2**64", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": 2**64}, {400}, 30),  # noqa: E501
    ("top_k_2**64", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 2**64}, {200, 400}, 30),  # noqa: E501
    ("max_tokens_2**64", "/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, {400}, 30),
    ("max_completion_tokens_2**64", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**64}, {400}, 30),  # noqa: E501
    # Prompts: too long, out of vocabulary, empty.
    ("prompt_too_long_text", "/v1/completions", {"prompt": "Hello world. " * 400, "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("prompt_len_eq_max_model_len", "/v1/completions", {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("chat_prompt_too_long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello world. " * 400}], "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("prompt_id_eq_vocab", "/v1/completions", {"prompt": [VOCAB_SIZE], "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("prompt_id_negative", "/v1/completions", {"prompt": [[-1]], "max_tokens": 1}, {400}, 30),
    ("prompt_id_2**64", "/v1/completions", {"prompt": [2**64], "max_tokens": 1}, {400}, 30),
    ("prompt_empty_list", "/v1/completions", {"prompt": [], "max_tokens": 1}, {400}, 30),
    ("prompt_empty_inner", "/v1/completions", {"prompt": [[]], "max_tokens": 1}, {400}, 30),
    ("prompt_empty_string", "/v1/completions", {"prompt": "", "max_tokens": 1}, {400}, 30),
    ("prompt_list_non_ints", "/v1/completions", {"prompt": [[1, "a"]], "max_tokens": 1}, {400}, 30),  # noqa: E501
    # Ranges.
    ("n_0", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 0}, {400}, 30),
    ("n_huge", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 10**6}, {400}, 30),
    ("temperature_1e9", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 1e9}, {400}, 30),  # noqa: E501
    ("top_p_0", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_p": 0}, {400}, 30),
    ("logprobs_1000", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 1000}, {400}, 30),  # noqa: E501
    ("top_logprobs_21", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 21}, {400}, 30),  # noqa: E501
    ("max_tokens_negative", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, {400}, 30),
    ("greedy_n_2", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 2, "temperature": 0}, {400}, 30),  # noqa: E501
    ("min_tokens_gt_max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 3}, {400}, 30),  # noqa: E501
    ("temperature_nan", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}', {400}, 30),  # noqa: E501
    ("top_p_infinity", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "top_p": Infinity}', {400}, 30),  # noqa: E501
    # logit_bias, stop.
    ("logit_bias_key_abc", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"abc": 1}}, {400}, 30),  # noqa: E501
    ("logit_bias_key_vocab", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(VOCAB_SIZE): 1}}, {400}, 30),  # noqa: E501
    ("logit_bias_key_negative", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"-1": 1}}, {400}, 30),  # noqa: E501
    ("stop_non_strings", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": [1, 2]}, {400}, 30),  # noqa: E501
    ("stop_empty_string", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": [""]}, {400}, 30),  # noqa: E501
    ("stop_token_ids_vocab", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [VOCAB_SIZE]}, {400}, 30),  # noqa: E501
    # Chat messages.
    ("chat_no_messages", "/v1/chat/completions", {"messages": [], "max_tokens": 1}, {400}, 30),
    ("chat_bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("chat_image_part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "max_tokens": 1}, {400}, 30),  # noqa: E501
    ("chat_lone_surrogate", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 1}, {400}, 30),  # noqa: E501
    # Model, body encoding.
    ("unknown_model", "/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 1}, {404}, 30),  # noqa: E501
    ("invalid_utf8_body", "/v1/completions", b'{"prompt": "\xff", "max_tokens": 1}', {400}, 30),
    ("invalid_utf8_chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 1}', {400}, 30),  # noqa: E501
    ("deep_nesting", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {400}, 30),  # noqa: E501
    ("int_literal_5000_digits", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * 5_000 + b"}", {400}, 30),  # noqa: E501
    ("truncated_json", "/v1/completions", b'{"prompt": "hi", "max_tok', {400}, 30),
    ("json_array_body", "/v1/completions", b'[{"prompt": "hi", "max_tokens": 1}]', {400}, 30),
    # /tokenize and /detokenize (skipped when the server has not got them).
    ("tokenize_empty_object", "/tokenize", {}, {400}, 30),
    ("tokenize_both", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {400}, 30),  # noqa: E501
    ("tokenize_bad_part", "/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {400}, 30),  # noqa: E501
    ("tokenize_unknown_model", "/tokenize", {"model": "gpt-4", "prompt": "x"}, {404}, 30),
    ("detokenize_vocab", "/detokenize", {"tokens": [VOCAB_SIZE]}, {400}, 30),
    ("detokenize_negative", "/detokenize", {"tokens": [-1]}, {400}, 30),
    ("detokenize_2**64", "/detokenize", {"tokens": [2**64]}, {400}, 30),
    ("detokenize_not_ints", "/detokenize", {"tokens": ["a"]}, {400}, 30),
    ("detokenize_missing", "/detokenize", {}, {400}, 30),
]  # fmt: skip


# Requests that a buggy server leaves running forever (each then holds its KV blocks and
# keeps the engine busy), so they run after the quick cases. A correct answer is instant:
# reject, or stop at max_model_len (the prompts leave ~5 tokens of room).
STUCK_PRONE: list[tuple[str, str, Any, set[int], float]] = [
    ("min_tokens_beyond_max_model_len", "/v1/completions", {"prompt": [1] * 250, "max_tokens": 20, "min_tokens": 20}, {200, 400}, 15),  # noqa: E501
    ("chat_min_tokens_no_max_tokens", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 220}], "min_tokens": 50}, {200, 400}, 15),  # noqa: E501
]  # fmt: skip


def _targeted(server, openapi, path, body, expected, timeout) -> None:
    if path not in openapi["paths"]:
        pytest.skip(f"{path} is not served")
    raw = body if isinstance(body, bytes) else _dumps(body)
    req = Req("targeted", "POST", path, raw, _json_headers())
    status, problem = _run_one(server, req, timeout=timeout)
    if (status is None or status >= 500) and not _healthy(server):
        pytest.fail(f"the server is dead ({problem}): killed by this or an earlier request")
    assert problem is None, f"{problem}\n    request: {req!r}"
    assert status in expected, f"status {status}, expected {sorted(expected)}: {req!r}"


@pytest.mark.parametrize(
    "path, body, expected, timeout", [c[1:] for c in TARGETED], ids=[c[0] for c in TARGETED]
)
def test_targeted_malformed_request(server, openapi, path, body, expected, timeout) -> None:
    _targeted(server, openapi, path, body, expected, timeout)


def test_unknown_route_and_wrong_method_answer_json(server) -> None:
    """The framework's own 404/405, in the OpenAI error shape too."""
    for method, path in [("POST", "/v1/nope"), ("GET", "/v1/completions"), ("PUT", "/health")]:
        req = Req("route", method, path, None, _auth())
        status, problem = _run_one(server, req)
        assert problem is None, f"{problem}\n    request: {req!r}"
        assert status in (404, 405), status


@pytest.mark.parametrize(
    "path, body, expected, timeout",
    [c[1:] for c in STUCK_PRONE],
    ids=[c[0] for c in STUCK_PRONE],
)
def test_request_that_cannot_finish_is_not_left_hanging(
    server, openapi, path, body, expected, timeout
) -> None:
    _targeted(server, openapi, path, body, expected, timeout)


def test_top_k_beyond_int64_does_not_kill_the_engine(server, openapi) -> None:
    """A top_k that fits msgpack (< 2**64) but not int64 must be rejected or clamped; run
    late because a server with the bug loses its engine (every later request is a 503)."""
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 1.0, "top_k": 2**63}
    _targeted(server, openapi, "/v1/completions", body, {200, 400}, TIMEOUT)
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        assert r.status == 200


def _running_requests(server: str) -> float | None:
    resp = requests.get(server + "/metrics", timeout=30)
    if resp.status_code == 404:
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in resp.text.splitlines()
        if line.startswith("pagedinfer:num_requests_running")
    )


def test_server_alive_and_idle_at_the_end(server) -> None:
    """Still serving correct completions after everything above, and no request left
    running in the engine (a stuck one would hold its KV blocks forever)."""
    _assert_alive(server)
    assert TALLY.sent >= MIN_REQUESTS, TALLY.sent
    running = _running_requests(server)
    if running is None:
        pytest.skip("no /metrics on this server")
    for _ in range(20):
        if running == 0:
            break
        time.sleep(0.25)
        running = _running_requests(server)
    assert running == 0, f"{running} requests still running in the engine after the fuzzing"
