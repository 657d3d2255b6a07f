"""`pagedinfer serve` as a real server process on loopback, driven by the official `openai`
client: completions, chat, streaming, n=2, logprobs, stop strings, usage, seeds, errors.
Greedy text equals LLM.generate's for the same prompt."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai")

ENGINE = [
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(64 * 2**20),
    "--max-model-len",
    "512",
]
KEY = "sk-test-key"
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedinfer",
            "serve",
            "--port",
            str(port),
            "--api-key",
            KEY,
            *ENGINE,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


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
