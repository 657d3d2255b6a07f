"""vLLM's smaller request options on the real model: `bad_words`, `truncate_prompt_tokens`
and the engine's `logprobs_mode`."""

from __future__ import annotations

import math

import pytest

from pagedinfer import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=256,
               log_stats_interval_s=0)  # fmt: skip


def _text(llm: LLM, prompt, **params) -> str:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, **params),
                       use_tqdm=False)  # fmt: skip
    return out[0].outputs[0].text


def test_bad_words_are_never_written(llm: LLM) -> None:
    free = _text(llm, PROMPT)
    assert "Paris" in free, free
    banned = _text(llm, PROMPT, bad_words=["Paris"])
    assert "Paris" not in banned and banned != free, banned
    # A word of several tokens: its last token is banned only after the others.
    word = free.split()[1] if len(free.split()) > 1 else free.split()[0]
    assert word not in _text(llm, PROMPT, bad_words=["Paris", word])


def test_truncate_prompt_tokens_keeps_the_prompt_end(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Lorem ipsum dolor sit amet. " * 30 + PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=12)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-12:]
    alone = llm.generate({"prompt_token_ids": ids[-12:]}, SamplingParams(temperature=0,
                         max_tokens=8), use_tqdm=False)[0]  # fmt: skip
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_processed_logprobs_are_the_filtered_distribution() -> None:
    llm = LLM(dtype="float32", kv_cache_memory_bytes=32 * 2**20, max_model_len=128,
              log_stats_interval_s=0, logprobs_mode="processed_logprobs")  # fmt: skip
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=6, logprobs=5, seed=3)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    for token, entries in zip(completion.token_ids, completion.logprobs):
        # Top-5 filtering leaves five tokens: their probabilities are the whole mass.
        assert math.isclose(sum(math.exp(e.logprob) for e in entries.values()
                                if math.isfinite(e.logprob)), 1.0, abs_tol=1e-4)  # fmt: skip
        assert token in entries and math.isfinite(entries[token].logprob)
