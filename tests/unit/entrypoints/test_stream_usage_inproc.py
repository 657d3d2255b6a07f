"""`stream_options.continuous_usage_stats`, `bad_words` and `truncate_prompt_tokens` over
the app in process (`fake_engine.py`)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagedinfer.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, build_app
from tests.unit.entrypoints.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


def _chunks(response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_on_every_chunk(path) -> None:
    engine = FakeEngine(max_model_len=4096)
    engine.replies = ["abcd"] * 3
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 10, "stream": True}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with TestClient(build_app(engine, DEFAULT_MODEL_NAME)) as http:
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = _chunks(http.post(path, json={**body, "stream_options": options}))
        completion = [c["usage"]["completion_tokens"] for c in chunks]
        assert all("usage" in c for c in chunks)
        assert completion == sorted(completion) and completion[-1] == 4
        assert chunks[-1]["choices"] == []  # the final usage chunk
        prompt = {c["usage"]["prompt_tokens"] for c in chunks}
        assert len(prompt) == 1 and all(c["usage"]["total_tokens"] == c["usage"][
            "prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks)  # fmt: skip
        # Without continuous_usage_stats only the last chunk has it (vLLM: it also needs
        # include_usage).
        chunks = _chunks(http.post(path, json={**body, "stream_options": {"include_usage": True}}))
        assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
        bad = http.post(path, json={**body, "stream_options": {"include_usge": True}})
        assert bad.status_code == 400 and "include_usge" in bad.text


def test_bad_words_and_truncation_reach_the_engine() -> None:
    engine = FakeEngine(max_model_len=4096)
    engine.replies = ["ok"]
    with TestClient(build_app(engine, DEFAULT_MODEL_NAME)) as http:
        body = {"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 3,
                "bad_words": ["darn"], "truncate_prompt_tokens": 5}  # fmt: skip
        assert http.post("/v1/completions", json=body).status_code == 200
        (params,) = engine.params.values()
        assert params.bad_words == ["darn"] and params.truncate_prompt_tokens == 5
        bad = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0})
        assert bad.status_code == 400 and "truncate_prompt_tokens" in bad.text
