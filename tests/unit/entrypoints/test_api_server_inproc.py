"""The OpenAI server in process: FastAPI's TestClient over `FakeEngine`, an object shaped like
`AsyncLLM` (generate, input_processor, tokenizer, max_model_len, errored, ...) that answers
with scripted outputs, so the wire format is checked in seconds with no model.

`fake_engine.py` says what the fake answers. The real-process tests
(tests/integration/test_openai_server.py and others) stay the reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app
from pagedinfer.sampling_params import RequestOutputKind
from tests.unit.entrypoints.fake_engine import REPLIES, FakeEngine

pytestmark = pytest.mark.timeout(60)

KEY = "sk-unit"
MODEL = DEFAULT_MODEL_NAME
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    """A server that takes clients' kv_transfer_params (as behind a disaggregation proxy)."""
    app = build_app(engine, MODEL, KEY, accept_kv_transfer_params=True)
    with TestClient(app, headers=AUTH) as test_client:
        yield test_client


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_refused_by_default(engine: FakeEngine, route: str) -> None:
    """Without a transfer secret or --trust-kv-transfer-params a client's kv_transfer_params
    are a 400 naming the field; the engine sees nothing."""
    body: dict[str, Any] = {"max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}}
    if route == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with TestClient(build_app(engine, MODEL, KEY), headers=AUTH) as client:
        resp = client.post(route, json=body)
        assert_error(resp, 400, "BadRequestError", "transfer secret", "kv_transfer_params")
        del body["kv_transfer_params"]
        assert client.post(route, json=body).status_code == 200
    assert len(engine.params) == 1


def events(text: str) -> list[Any]:
    """The SSE payloads of a stream, [DONE] as the string; every event is `data: ...\\n\\n`."""
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") for b in blocks), blocks
    payloads = [b[len("data: ") :] for b in blocks]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def assert_error(resp: Any, status: int, kind: str, message: str, param: Any = ...) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["code"] == status
    assert message in error["message"], error["message"]
    if param is not ...:
        assert error["param"] == param


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"prompt": "hi", "temperature": 3}, "temperature: Input should be", "temperature"),
        ({"prompt": "hi", "n": 0}, "n: Input should be greater than or equal to 1", "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs:", "logprobs"),
        ({}, "prompt: Field required", "prompt"),
        ({"prompt": []}, "prompt: at least one prompt is needed", "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt: streaming takes one prompt", "prompt"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias keys must be token ids", None),
        ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "at most one", None),
        ({"prompt": "hi", "n": 2, "kv_transfer_params": {}}, "kv_transfer_params needs n", None),
        ({"prompt": ["a", "b"], "kv_transfer_params": {}}, "takes one prompt", "prompt"),
        ({"prompt": "x" * 300}, "too long", None),
        ({"prompt": [[5], [5000]]}, "out of vocabulary", None),
        ({"prompt": "hi", "priority": False}, "'priority' (only 0 is supported)", None),
        ({"prompt": "hi", "best_of": True}, "'best_of'", None),
    ],
)
def test_completion_validation_errors(
    client: TestClient, engine: FakeEngine, body: dict[str, Any], message: str, param: Any
) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, "BadRequestError", message, param)
    assert not engine.params  # nothing reached the engine


def test_chat_validation_and_framework_errors(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    resp = client.post("/v1/chat/completions", json=bad_part)
    assert_error(resp, 400, "BadRequestError", "only text content parts", "messages")
    resp = client.post("/v1/chat/completions", json={"messages": []})
    assert_error(resp, 400, "BadRequestError", "messages: List should have at least 1", "messages")
    resp = client.post("/v1/chat/completions", json={**chat, "model": "gpt-9"})
    assert_error(resp, 404, "NotFoundError", "The model 'gpt-9' does not exist", "model")
    resp = client.post("/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert_error(client.get("/v1/nowhere"), 404, "NotFoundError", "Not Found", None)
    assert_error(client.get("/v1/completions"), 405, "MethodNotAllowedError", "Method Not")


def test_engine_failure_is_400(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "FAIL"})
    assert_error(resp, 400, "BadRequestError", "grammar failed to compile", None)
    chat = {"messages": [{"role": "user", "content": "FAIL"}], "stream": True}
    resp = client.post("/v1/chat/completions", json=chat)
    assert resp.status_code == 200
    assert events(resp.text) == [
        {"error": {"message": "grammar failed to compile", "type": "BadRequestError", "code": 400}}
    ]


def test_engine_dies_mid_stream(client: TestClient) -> None:
    body = {"prompt": "DIE", "stream": True, "stream_options": {"include_usage": True}}
    resp = client.post("/v1/completions", json=body)
    first, error, usage, done = events(resp.text)
    assert first["choices"][0]["text"] == "r"
    assert error == {
        "error": {"message": "Engine core died.", "type": "ServiceUnavailableError", "code": 503}
    }
    assert usage["usage"]["completion_tokens"] == 1 and done == "[DONE]"


# ------------------------------------------------------------------------------- answers


def test_completion_n_usage_echo_and_stop(client: TestClient, engine: FakeEngine) -> None:
    body = {"prompt": ["ab", "c"], "n": 2, "stop": "e", "top_k": -1, "echo": True}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["id"].startswith("cmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts == ["abr", "abblu", "cr", "cblu"]  # echo, then cut at the stop string
    assert [c["stop_reason"] for c in out["choices"]] == ["e"] * 4
    assert all(c["finish_reason"] == "stop" and c["logprobs"] is None for c in out["choices"])
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    params = next(iter(engine.params.values()))
    assert params.stop == ["e"] and params.top_k == 0 and params.max_tokens == 16
    assert params.output_kind == RequestOutputKind.FINAL_ONLY


def test_completion_logprobs_and_length(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "red" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["r", "e", "d"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"r": -0.5, "?": -2.0}, {"e": -0.5, "?": -2.0}, {"d": -0.5, "?": -2.0}],
        "text_offset": [0, 1, 2],
    }


def test_chat_logprobs_and_kv_transfer_params(client: TestClient, engine: FakeEngine) -> None:
    engine.num_cached_tokens = 4
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["kv_transfer_params"] == {"remote_block_ids": [1]}
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": "re"}
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    first = choice["logprobs"]["content"][0]
    assert first == {
        "token": "r",
        "logprob": -0.5,
        "bytes": [114],
        "top_logprobs": [{"token": "r", "logprob": -0.5, "bytes": [114]}],
    }
    prompt_tokens = len("user: hi\nassistant: ")
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_completion_stream_framing_and_usage(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "stream": True, "echo": True}
    body["stream_options"] = {"include_usage": True}
    resp = client.post("/v1/completions", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = events(resp.text)
    assert chunks[-1] == "[DONE]"
    *deltas, usage = chunks[:-1]
    assert [d["choices"][0]["text"] for d in deltas] == ["hir", "e", "d", " "]
    assert [d["choices"][0]["finish_reason"] for d in deltas] == [None, None, None, "length"]
    assert all(set(d) == {"id", "object", "created", "model", "choices"} for d in deltas)
    assert len({d["id"] for d in chunks[:-1]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == 6


def test_chat_stream_n2_roles_and_no_usage(client: TestClient, engine: FakeEngine) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    chunks = events(client.post("/v1/chat/completions", json=body).text)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])
    text: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert chunk["object"] == "chat.completion.chunk"
        for c in chunk["choices"]:
            assert set(c) == {"index", "delta", "logprobs", "finish_reason"}
            assert ("role" in c["delta"]) == (text[c["index"]] == "")
            text[c["index"]] += c["delta"]["content"]
    assert text == {0: REPLIES[0], 1: REPLIES[1]}
    assert not engine.aborted
    params = next(iter(engine.params.values()))
    assert params.output_kind == RequestOutputKind.DELTA and params.max_tokens is None


# ----------------------------------------------------- auth, models, tokenize, health


def test_auth(engine: FakeEngine) -> None:
    with TestClient(build_app(engine, MODEL, KEY)) as anonymous:
        resp = anonymous.get("/v1/models")
        assert_error(resp, 401, "AuthenticationError", "Invalid or missing API key.", None)
        resp = anonymous.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert resp.status_code == 401
        assert anonymous.get("/health").status_code == 200  # only /v1 wants the key
        assert anonymous.get("/v1/models", headers=AUTH).status_code == 200


def test_models_version_and_metrics(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert set(card) == {"id", "object", "created", "owned_by", "max_model_len"}
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", 256)
    assert client.get("/version").json()["version"]
    metrics = client.get("/metrics").text
    assert "pagedinfer:num_requests_waiting" in metrics and "2.0" in metrics


def test_tokenize_and_detokenize(client: TestClient) -> None:
    resp = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
    assert resp.json() == {
        "count": 2,
        "max_model_len": 256,
        "tokens": [97, 98],
        "token_strs": ["<a>", "<b>"],
    }
    resp = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
    assert resp.json()["count"] == len("user: a\nassistant: ")
    assert "token_strs" not in resp.json()
    resp = client.post("/tokenize", json={})
    assert_error(resp, 400, "BadRequestError", "exactly one of 'prompt' and 'messages'", "prompt")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    resp = client.post("/detokenize", json={"tokens": [1, 5000]})
    assert_error(resp, 400, "BadRequestError", "ids out of range [0, 1000): [5000]", "tokens")


def test_tokenizer_info_is_off_by_default(client: TestClient) -> None:
    """As vLLM's: the endpoint shows the chat template, so a server answers it only when
    started with --enable-tokenizer-info-endpoint (on: tests/integration/test_openai_server)."""
    resp = client.get("/tokenizer_info")
    assert_error(resp, 404, "NotFoundError", "--enable-tokenizer-info-endpoint", None)


def test_dead_engine(client: TestClient, engine: FakeEngine) -> None:
    engine.dead = True
    assert_error(client.get("/health"), 503, "ServiceUnavailableError", "dead", None)
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert_error(resp, 503, "ServiceUnavailableError", "Engine core is dead.", None)
    assert "Traceback" not in resp.text  # the first line only
    resp = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert_error(resp, 503, "ServiceUnavailableError", "Engine core is dead.", None)
    assert "pagedinfer:" in client.get("/metrics").text  # the last known values


def test_build_app_registers_its_stat_logger(engine: FakeEngine) -> None:
    build_app(engine)
    assert len(engine.stat_loggers) == 1


def test_a_model_without_a_chat_template_serves_completions_only(engine: FakeEngine) -> None:
    engine.tokenizer.chat_template = None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(engine, MODEL, KEY), headers=AUTH) as client:
        resp = client.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert "--chat-template" in error["message"] and error["param"] == "messages"
        tokenize = client.post("/tokenize", json={"model": MODEL, "messages": chat["messages"]})
        assert tokenize.status_code == 400 and "--chat-template" in tokenize.text
        done = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert done.status_code == 200


def test_chat_template_given_to_the_server_replaces_the_models(engine: FakeEngine) -> None:
    engine.tokenizer.chat_template = None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    app = build_app(engine, MODEL, KEY, chat_template="T")
    with TestClient(app, headers=AUTH) as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        tokens = client.post("/tokenize", json={"model": MODEL, "messages": chat["messages"]})
    (ids,) = engine.prompts.values()
    assert "".join(map(chr, ids)) == "[T]user: hi\nassistant: "
    assert tokens.json()["tokens"] == ids


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def test_cache_salt_reaches_the_engine(client: TestClient, engine: FakeEngine) -> None:
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        assert client.post(route, json={**body, "cache_salt": "tenant-a"}).status_code == 200
        assert client.post(route, json=body).status_code == 200
        resp = client.post(route, json={**body, "cache_salt": ""})
        assert_error(resp, 400, "BadRequestError", "at least 1 character", "cache_salt")
    assert list(engine.salts.values()) == ["tenant-a", None, "tenant-a", None]


def test_tenants_by_api_key_get_their_own_salt(engine: FakeEngine) -> None:
    """`--isolate-tenants api-key`: each key its own salt (a digest: the key itself never
    reaches the engine); a request's own cache_salt is kept within its tenant's."""
    app = build_app(engine, MODEL, ["key-one", "key-two"], isolate_tenants="api-key")
    with TestClient(app) as client:
        for key in ("key-one", "key-two", "key-one"):
            resp = client.post(
                "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"}
            )
            assert resp.status_code == 200
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "key-two"})
        assert resp.status_code == 200
        resp = client.post(
            "/v1/completions",
            json={**COMPLETION, "cache_salt": "s"},
            headers={"Authorization": "Bearer key-one"},
        )
        assert resp.status_code == 200
        bad = client.post("/v1/completions", json=COMPLETION, headers={"x-api-key": "key-3"})
        assert bad.status_code == 401
    one, two, one_again, two_chat, one_salted = engine.salts.values()
    assert one == one_again and two == two_chat and one != two
    assert None not in (one, two, one_salted) and one_salted not in (one, two)
    assert not any("key-" in str(salt) for salt in engine.salts.values())


def test_tenants_by_header(engine: FakeEngine) -> None:
    app = build_app(engine, MODEL, isolate_tenants="header:X-Tenant")
    with TestClient(app) as client:
        for tenant in ("acme", "globex", "acme"):
            resp = client.post("/v1/completions", json=COMPLETION, headers={"X-Tenant": tenant})
            assert resp.status_code == 200
        missing = client.post("/v1/chat/completions", json=CHAT)
        assert_error(missing, 400, "BadRequestError", "X-Tenant header")
        # A client's own header beside the one a proxy added: neither is believed.
        twice = client.post("/v1/completions", json=COMPLETION,
                            headers=[("X-Tenant", "acme"), ("X-Tenant", "globex")])  # fmt: skip
        assert_error(twice, 400, "BadRequestError", "given 2 times")
    acme, globex, acme_again = engine.salts.values()
    assert acme == acme_again != globex


@pytest.mark.parametrize("source", ["api-key", "header:", "tenant"])
def test_isolate_tenants_needs_a_source(engine: FakeEngine, source: str) -> None:
    with pytest.raises(ValueError, match="--isolate-tenants"):
        build_app(engine, MODEL, isolate_tenants=source)


def test_a_client_leaving_mid_body_is_no_server_error(engine: FakeEngine) -> None:
    """The body middleware answers a body cut short by a disconnect (a 400 nobody reads),
    rather than returning nothing, which the middlewares above it would turn into a 500."""
    import asyncio

    app = build_app(engine, MODEL)
    messages = [
        {"type": "http.request", "body": b'{"prompt": "hi', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("t", 80), "client": ("c", 1), "root_path": ""}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert b"closed the connection" in sent[1]["body"]


def test_text_response_format_beside_a_guided_field(client: TestClient, engine: FakeEngine) -> None:
    """`response_format` "text" constrains nothing: a guided field beside it is the one
    constraint (schemathesis found this refused as "json_schema needs a 'schema'")."""
    schema = {"type": "object"}
    body = {**CHAT, "guided_json": schema, "response_format": {"type": "text"}}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert list(engine.params.values())[-1].structured_outputs.json == schema
    resp = client.post("/v1/completions", json={**COMPLETION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}})  # fmt: skip
    assert_error(resp, 400, "BadRequestError", "needs json_schema.schema", "response_format")


def test_ignored_fields_at_their_defaults_compare_as_json_numbers(
    client: TestClient, engine: FakeEngine
) -> None:
    for extra in ({"priority": 0.0}, {"priority": 0}, {"best_of": 1.0}, {"best_of": None}):
        resp = client.post("/v1/completions", json={**COMPLETION, **extra})
        assert resp.status_code == 200, (extra, resp.text)
