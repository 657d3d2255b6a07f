"""Greedy parity with Hugging Face transformers on the real default model (float32).

For the parity prompts of tests/data (8 short ones, 4 of more than 300 tokens), our greedy ids
(64 new tokens) must equal transformers' `generate(do_sample=False)` on the same GGUF
weights, whether each request runs alone or batched with all the others: continuous
batching, chunked prefill and paged attention must not change results.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import MAX_NEW_TOKENS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm():
    from pagedinfer import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=512 * 2**20, max_model_len=2048)


def _greedy():
    from pagedinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def test_greedy_parity_each_request_alone(llm, prompts, hf_outputs) -> None:
    for i, (ids, expected) in enumerate(zip(prompts, hf_outputs)):
        out = llm.generate({"prompt_token_ids": ids}, _greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged"


def test_greedy_parity_batched(llm, prompts, hf_outputs) -> None:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outs, hf_outputs)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged when batched"


def test_greedy_parity_small_budget_chunked_prefill(prompts, hf_outputs) -> None:
    """A 64-token budget forces every long prompt through several prefill chunks, mixed
    with other requests' decodes in the same steps."""
    from pagedinfer import LLM

    small = LLM(
        dtype="float32",
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=2048,
        max_num_batched_tokens=64,
    )
    outs = small.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outs, hf_outputs)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged with chunking"
