"""`pagedinfer serve` as a real server process on loopback, driven by the official `openai`
client: completions, chat, streaming, n=2, logprobs, stop strings, usage, seeds, errors.
Greedy text equals LLM.generate's for the same prompt."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai")

ENGINE = small_engine_flags(max_model_len=512)
KEY = "sk-test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--enable-tokenizer-info-endpoint", *ENGINE)
    yield srv.base
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from pagedinfer import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)


def _raw(server: str, path: str, body: dict | None = None, key: str | None = KEY):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server + path, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_models_health_version(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _raw(server, "/health", key=None)[0] == 200
    status, body = _raw(server, "/version", key=None)
    assert status == 200 and body["version"]


def test_greedy_completion_equals_llm_generate(client, llm) -> None:
    from pagedinfer import SamplingParams

    prompt = "The capital of France is"
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert resp.choices[0].text == expected[0].outputs[0].text
    assert resp.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected[0].outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_equals_llm_chat_and_content_parts(client, llm) -> None:
    from pagedinfer import SamplingParams

    messages = [{"role": "user", "content": "Name three colours."}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=24, temperature=0
    )
    assert resp.choices[0].message.content == expected[0].outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    again = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=24, temperature=0
    )
    assert again.choices[0].message.content == resp.choices[0].message.content


def test_streaming_adds_up_with_usage(client) -> None:
    full = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0
    )
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and len(chunks) > 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=12, temperature=0,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas)


def test_n2_and_seeds(client) -> None:
    kwargs = dict(model=MODEL, prompt="My favourite food is", max_tokens=10, temperature=1.0)
    a = client.completions.create(n=2, seed=7, **kwargs)
    b = client.completions.create(n=2, seed=7, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20


def test_stop_strings_and_logprobs(client) -> None:
    base = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0)
    stop = base.choices[0].text.strip()[:2]
    cut = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[stop], logprobs=2
    )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    lp = cut.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == cut.usage.completion_tokens
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 400, "maximum model length"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "vocabulary"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}},
            400,
            "logit_bias",
        ),
    ],
)
def test_bad_requests_get_4xx_with_an_openai_error(server, path, body, status, needle) -> None:
    got, payload = _raw(server, path, body)
    assert got == status, payload
    assert needle in payload["error"]["message"]
    assert payload["error"]["code"] == status
    assert _raw(server, "/health", key=None)[0] == 200


def test_api_key_is_required(server) -> None:
    status, payload = _raw(server, "/v1/models", key=None)
    assert status == 401 and "API key" in payload["error"]["message"]
    assert _raw(server, "/v1/models", key="wrong")[0] == 401


def test_tokenize_and_detokenize(server, client) -> None:
    status, out = _raw(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and out["count"] == len(out["tokens"]) >= 2
    assert out["max_model_len"] == 512
    # The ids are the ones a completion prompt gets: usage counts the same number.
    done = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1)
    assert done.usage.prompt_tokens == out["count"]
    status, back = _raw(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == "Hello world"

    messages = [{"role": "user", "content": "Hi"}]
    status, chat = _raw(server, "/tokenize", {"messages": messages, "return_token_strs": True})
    chat_done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert status == 200 and chat["count"] == chat_done.usage.prompt_tokens
    assert len(chat["token_strs"]) == chat["count"]

    assert _raw(server, "/tokenize", {"prompt": "x", "messages": messages})[0] == 400
    assert _raw(server, "/tokenize", {})[0] == 400
    status, err = _raw(server, "/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and "out of range" in err["error"]["message"]
    status, err = _raw(server, "/detokenize", {"tokens": [1, -5]})
    assert status == 400 and "tokens.1: Input should be greater than" in err["error"]["message"]
    assert _raw(server, "/detokenize", {"model": "nope", "tokens": [1]})[0] == 404


def test_tokenizer_info_describes_the_served_tokenizer(server, llm) -> None:
    """What lm-evaluation-harness's remote tokenizer reads (benchmarks/bench_lm_eval.py runs
    the harness itself): the special tokens and the chat template chat requests use."""
    tokenizer = llm.get_tokenizer()
    status, info = _raw(server, "/tokenizer_info", key=None)
    assert status == 200
    assert info["eos_token"] == "<|im_end|>" == tokenizer.token_text(tokenizer.eos_token_id)
    assert info["bos_token"] == tokenizer.token_text(tokenizer.bos_token_id)
    assert info["chat_template"] == tokenizer.chat_template
    assert "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == 512 and info["vocab_size"] == tokenizer.vocab_size
    assert info["add_bos_token"] is tokenizer.add_bos_token
    # The special tokens round-trip through /tokenize as one id each, as the harness expects.
    body = {"prompt": info["eos_token"], "add_special_tokens": False}
    status, out = _raw(server, "/tokenize", body)
    assert out["tokens"] == [tokenizer.eos_token_id]


def _scrape(server: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _metric(samples, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, **labels}
    return sum(
        v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()
    )


def test_metrics_count_requests_tokens_and_latencies(server, client) -> None:
    before = _scrape(server)
    prompt = "The history of the printing press in Europe begins " * 28  # > 2 blocks of 128
    runs = [  # the second finds the first's blocks in the prefix cache
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )  # fmt: skip
        for _ in range(2)
    ]
    stop = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[","]
    )
    assert stop.choices[0].finish_reason == "stop"
    after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    P = "pagedinfer:"
    assert delta(P + "request_success_total", finished_reason="length") == 2
    assert delta(P + "request_success_total", finished_reason="stop") == 1
    assert delta(P + "generation_tokens_total") == 10 + stop.usage.completion_tokens
    prompt_tokens = sum(r.usage.prompt_tokens for r in [*runs, stop])
    assert delta(P + "prompt_tokens_total") == prompt_tokens
    assert delta(P + "request_prompt_tokens_sum") == prompt_tokens
    assert delta(P + "time_to_first_token_seconds_count") == 3
    assert delta(P + "e2e_request_latency_seconds_count") == 3
    # 4 gaps for each 5-token request, at least one for the stop request.
    assert delta(P + "inter_token_latency_seconds_count") >= 9
    assert delta(P + "time_to_first_token_seconds_sum") > 0
    assert delta(P + "request_generation_tokens_sum") == delta(P + "generation_tokens_total")
    assert delta(P + "prefix_cache_queries_total") > 0
    assert delta(P + "prefix_cache_hits_total") >= 32  # the repeated prompt's full blocks
    # Idle now: nothing running or waiting, no block in use.
    assert _metric(after, P + "num_requests_running") == 0
    assert _metric(after, P + "num_requests_waiting") == 0
    assert _metric(after, P + "kv_cache_usage_perc") == 0


def test_guided_decoding_fields(server, client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "pop": {"type": "integer"}},
        "required": ["city", "pop"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )  # fmt: skip
    value = json.loads(chat.choices[0].message.content)
    assert set(value) == {"city", "pop"} and isinstance(value["pop"], int)
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content":
                               'Return a JSON object with a single key "ok" set to true.'}],
        max_tokens=200,
        temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(
        model=MODEL, prompt="The best fruit is", max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["apple", "pear"]},
    )  # fmt: skip
    assert pick.choices[0].text in {"apple", "pear"}
    digits = client.completions.create(
        model=MODEL, prompt="My PIN is", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )  # fmt: skip
    assert digits.choices[0].text.isdigit() and len(digits.choices[0].text) == 4

    status, err = _raw(
        server, "/v1/completions",
        {"model": MODEL, "prompt": "x", "guided_json": '{"type": "object", "properties": '},
    )  # fmt: skip
    assert status == 400 and "structured outputs" in err["error"]["message"].lower()
    status, err = _raw(
        server, "/v1/completions",
        {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
    )  # fmt: skip
    assert status == 400 and "at most one" in err["error"]["message"]


def test_unimplemented_fields_are_refused_by_name_and_harmless_ones_ignored(server, client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # This server has no --tool-call-parser: "auto" (the default with tools) is refused.
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and"):
        client.chat.completions.create(**chat, tools=[tool])
    status, body = _raw(server, "/v1/chat/completions", {**chat, "functions": [tool]})
    assert status == 400 and "'functions' (deprecated by OpenAI" in body["error"]["message"]
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 1, "foo": 1, "best_of": 3}
    status, body = _raw(server, "/v1/completions", completion)
    assert status == 400
    assert "unsupported fields for /v1/completions: 'foo', 'best_of'" in body["error"]["message"]
    # Bookkeeping fields, and others at the value that changes nothing, are accepted.
    done = client.chat.completions.create(
        **chat, user="u1", metadata={"k": "v"}, store=False, parallel_tool_calls=True,
        extra_body={"priority": 0, "spaces_between_special_tokens": True},
    )  # fmt: skip
    assert done.choices[0].finish_reason == "length"
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=1, n=1)
    assert done.choices[0].finish_reason == "length"


def test_model_retrieve_request_id_and_stop_string_kept(server, client) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    req = urllib.request.Request(server + "/v1/models", headers={"X-Request-Id": "abc-123"})
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["X-Request-Id"] == "abc-123"
    kept = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=20, temperature=0.0, stop=[","],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text.endswith(",") and kept.choices[0].finish_reason == "stop"


def test_echo_scores_the_prompt_as_evaluation_tools_read_it(server, client, llm) -> None:
    """lm-evaluation-harness's `local-completions` loglikelihood request: echo, logprobs 1,
    max_tokens 0, a list of prompts. Each choice's logprobs cover the prompt tokens (the
    first null) and equal the offline engine's prompt logprobs."""
    from pagedinfer import SamplingParams

    prompts = ["The capital of France is Paris", "1, 2, 3, 4"]
    done = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0.0
    )
    assert done.usage.completion_tokens == 0
    offline = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    for choice, prompt, ref in zip(done.choices, prompts, offline):
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(ref.prompt_token_ids) == len(lp.token_logprobs)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
        assert all(len(top) >= 1 for top in lp.top_logprobs[1:])  # the top-1 (and the token)
    # Generating after the echo: the prompt's entries, then the new tokens', offsets running on.
    more = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=3, echo=True, logprobs=2, temperature=0.0
    ).choices[0]
    n_prompt = len(offline[1].prompt_token_ids)
    assert len(more.logprobs.tokens) == n_prompt + 3
    assert more.logprobs.text_offset == sorted(more.logprobs.text_offset)
    assert more.logprobs.text_offset[n_prompt] == len(prompts[1])
    status, body = _raw(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert status == 400 and "echo" in body["error"]["message"]


def test_prompt_logprobs_field_on_both_endpoints(server) -> None:
    status, body = _raw(
        server, "/v1/completions",
        {"model": MODEL, "prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": 2},
    )  # fmt: skip
    assert status == 200
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) >= 2 for e in entries[1:])
    first = next(iter(entries[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}
    messages = [{"role": "user", "content": "Hi"}]
    status, body = _raw(
        server, "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    )  # fmt: skip
    assert status == 200 and body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


def test_max_tokens_past_the_model_length_is_refused(server) -> None:
    """As vLLM's server: prompt + max_tokens beyond max_model_len (512) is a 400, not a
    silently shorter answer; within it, the request runs."""
    status, body = _raw(
        server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 600}
    )
    assert status == 400 and "maximum context length is 512 tokens" in body["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500}
    status, body = _raw(server, "/v1/chat/completions", chat)
    assert status == 400 and "in the prompt, 500 in the completion" in body["error"]["message"]
    status, _ = _raw(
        server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    )
    assert status == 200


def test_embeddings_match_llm_embed_beside_generation(server, client, llm) -> None:
    """/v1/embeddings through the official client (which asks for base64 and decodes it)
    equals `LLM.embed`, float and base64 alike, for both pooling types; run concurrently
    with greedy chat requests, it leaves their answers as they are alone."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedinfer import PoolingParams

    texts = ["The capital of France is Paris.", "def f(x): return x + 1",
             "Embeddings map text to vectors. " * 8]  # fmt: skip
    for pooling in ("last", "mean"):
        expected = [o.outputs.embedding for o in llm.embed(
            texts, PoolingParams(pooling_type=pooling), use_tqdm=False)]  # fmt: skip
        extra = {"pooling_type": pooling}
        got = client.embeddings.create(model=MODEL, input=texts, extra_body=extra)
        floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float",
                                          extra_body=extra)  # fmt: skip
        assert [d.index for d in got.data] == [0, 1, 2]
        assert got.usage.prompt_tokens == sum(
            len(llm.get_tokenizer().encode(t)) for t in texts)  # fmt: skip
        for e, a, b in zip(expected, got.data, floats.data):
            assert len(a.embedding) == 576
            assert max(abs(x - y) for x, y in zip(e, a.embedding)) < 1e-5
            assert max(abs(x - y) for x, y in zip(e, b.embedding)) < 1e-5

    messages = [[{"role": "user", "content": f"Name a fruit that is {c}."}]
                for c in ("red", "yellow", "green", "purple")]  # fmt: skip

    def chat(m):
        out = client.chat.completions.create(model=MODEL, messages=m, max_tokens=24,
                                             temperature=0)  # fmt: skip
        return out.choices[0].message.content

    def embed(i):
        return client.embeddings.create(model=MODEL, input=texts[i % 3]).data[0].embedding

    alone = [chat(m) for m in messages]
    with ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(chat, m) for m in messages]
        vectors = [pool.submit(embed, i) for i in range(8)]
        assert [f.result() for f in chats] == alone
        assert all(len(v.result()) == 576 for v in vectors)

    status, body = _raw(server, "/v1/embeddings", {"input": "x", "dimensions": 64})
    assert status == 400 and body["error"]["param"] == "dimensions"
    status, body = _raw(server, "/v1/embeddings", {"input": [], "model": MODEL})
    assert status == 400
