"""`kv_cache_dtype="int8"` on the real model (SmolLM2, float32): capacity and agreement.

The int8 cache is close to the float one, not equal (docs/kv_cache.md has the measured
agreement), so these tests pin what must hold exactly and bound the rest:
- capacity: the same memory holds 256/68 as many tokens (rows of 64 float32 values become
  64 codes and a 4-byte scale);
- a fresh prefill attends to its own exact K/V, so every request's first token equals
  transformers' float32 one; later tokens read the int8 rows;
- chunked prefill and prefix-cache hits read int8 context through the paged kernel; the
  engine hands every block back afterwards.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import MAX_NEW_TOKENS

pytestmark = pytest.mark.integration


def _llm(**kwargs):
    from pagedinfer import LLM

    opts = {"dtype": "float32", "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048}
    opts.update(kwargs)
    return LLM(**opts)


def _run(llm, prompts: list[list[int]]):
    from pagedinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in _run(llm, prompts)]


def _kv(llm):
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def _agreement(outputs: list[list[int]], expected: list[list[int]]) -> float:
    """The share of expected tokens before each output's first difference."""
    same = 0
    for out, ref in zip(outputs, expected, strict=True):
        same += next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
    return same / sum(len(ref) for ref in expected)


@pytest.fixture(scope="module")
def int8_llm():
    return _llm(kv_cache_dtype="int8")


def test_capacity_is_the_row_ratio(int8_llm) -> None:
    # 128 MiB holds 22 float32 blocks of 128 tokens: each count is rounded down by up to a
    # block, so the int8 count lies within one float block's worth (256 / 68 blocks) of
    # the row ratio.
    float_blocks = _kv(_llm()).num_blocks
    assert abs(_kv(int8_llm).num_blocks - float_blocks * 256 / 68) < 256 / 68


def test_first_tokens_exact_then_close(int8_llm, prompts, hf_outputs) -> None:
    outputs = _generate(int8_llm, prompts)
    for i, (out, ref) in enumerate(zip(outputs, hf_outputs)):
        assert out[0] == ref[0], f"prompt {i}: the prefill's own token differs"
    # Measured on the AVX2 tier: 0.64 of the tokens come before each output's first
    # difference (a difference changes all that follows; float32 is at 1.0 in
    # test_hf_parity.py). The bound leaves room for other tiers' rounding.
    assert _agreement(outputs, hf_outputs) > 0.4
    kv = _kv(int8_llm)
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_chunks_and_prefix_hits_read_the_int8_context(prompts, hf_outputs) -> None:
    """A 64-token budget splits the long prompts into chunks over their cached (int8)
    prefix; running them twice serves the second round from the prefix cache."""
    llm = _llm(kv_cache_dtype="int8", max_num_batched_tokens=64)
    long_prompts, expected = prompts[8:], hf_outputs[8:]
    first = _generate(llm, long_prompts)
    second = _run(llm, long_prompts)
    again = [list(o.outputs[0].token_ids) for o in second]
    assert all(o.num_cached_tokens >= 256 for o in second)  # served from the prefix cache
    # Measured on the AVX2 tier: 0.99 and 0.80.
    assert _agreement(first, expected) > 0.6
    assert _agreement(again, first) > 0.5
    kv = _kv(llm)
    assert kv.get_num_free_blocks() == kv.num_blocks
    kv.block_pool.check_integrity()
