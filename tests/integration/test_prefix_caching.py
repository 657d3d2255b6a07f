"""Chunked prefill, prefix caching and preemption on the real model: results never change.

Every output here is compared with Hugging Face transformers' greedy tokens (float32, same
GGUF weights) or with an unconstrained run of our own engine.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import MAX_NEW_TOKENS

pytestmark = pytest.mark.integration

BLOCK = 16


def _greedy(max_tokens: int = MAX_NEW_TOKENS):
    from pagedinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _llm(**kwargs):
    from pagedinfer import LLM

    # 16-token blocks (the default is 128): the prompts here share prefixes of a few blocks.
    opts = {"dtype": "float32", "kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 2048,
            "block_size": BLOCK}  # fmt: skip
    opts.update(kwargs)
    return LLM(**opts)


def _free_blocks_all_back(llm) -> None:
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    kv.block_pool.check_integrity()


@pytest.mark.parametrize("budget", [16, 64, 256])
@pytest.mark.parametrize("threshold", [0, 8, 48])
def test_greedy_parity_over_budgets_and_chunk_caps(budget, threshold, prompts, hf_outputs):
    llm = _llm(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outs, hf_outputs)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged"
    _free_blocks_all_back(llm)


@pytest.fixture(scope="module")
def shared_prefix_case(prompts, tokenizer):
    """A long 'system prompt' (the first long parity prompt) and questions appended to it."""
    system = prompts[8]
    questions = [
        "What is the main point?",
        "Summarise this in one sentence.",
        "Which word appears most often?",
    ]
    shared = [system + tokenizer.encode(" " + q) for q in questions]
    unrelated = prompts[0]
    return system, shared, unrelated


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_shared_prefix_hits_and_parity(algo, shared_prefix_case, hf_greedy) -> None:
    system, shared, unrelated = shared_prefix_case
    llm = _llm(prefix_caching_hash_algo=algo)
    (warm,) = llm.generate({"prompt_token_ids": system}, _greedy(), use_tqdm=False)
    assert warm.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == hf_greedy(system)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in [*shared, unrelated]], _greedy(), use_tqdm=False
    )
    for ids, out in zip(shared, outs):
        assert out.outputs[0].token_ids == hf_greedy(ids)
        # The shared part rounded down to whole blocks, never covering the last token.
        assert out.num_cached_tokens == (len(system) // BLOCK) * BLOCK
        assert out.num_cached_tokens < len(ids)
    assert outs[-1].num_cached_tokens == 0
    assert outs[-1].outputs[0].token_ids == hf_greedy(unrelated)
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] >= 3 * (len(system) // BLOCK) * BLOCK
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    _free_blocks_all_back(llm)


def test_identical_prompt_recomputes_its_last_block(shared_prefix_case) -> None:
    system, _, _ = shared_prefix_case
    llm = _llm()
    first = llm.generate({"prompt_token_ids": system}, _greedy(8), use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": system}, _greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == ((len(system) - 1) // BLOCK) * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_cache_salt_isolates_tenants(shared_prefix_case) -> None:
    system, shared, _ = shared_prefix_case
    llm = _llm()
    llm.generate({"prompt_token_ids": system, "cache_salt": "a"}, _greedy(4), use_tqdm=False)
    outs = llm.generate(
        [
            {"prompt_token_ids": shared[0], "cache_salt": "a"},
            {"prompt_token_ids": shared[1], "cache_salt": "b"},
            {"prompt_token_ids": shared[2]},
        ],
        _greedy(4),
        use_tqdm=False,
    )
    assert outs[0].num_cached_tokens == (len(system) // BLOCK) * BLOCK
    assert outs[1].num_cached_tokens == 0  # another salt shares nothing
    assert outs[2].num_cached_tokens == 0  # nor does no salt
    # No block id is shared between the salted and unsalted requests' tables: checked by
    # construction of the hashes; here the observable effect is the zero hit length.


def test_prefix_caching_off_gives_the_same_outputs(prompts, hf_outputs) -> None:
    llm = _llm(enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert llm.get_stats()["prefix_cache_queries"] == 0


def test_reset_prefix_cache(shared_prefix_case) -> None:
    system, shared, _ = shared_prefix_case
    llm = _llm()
    llm.generate({"prompt_token_ids": system}, _greedy(2), use_tqdm=False)
    assert llm.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": shared[0]}, _greedy(2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_many_preemptions_change_nothing(prompts, hf_outputs) -> None:
    """A KV pool of 768 tokens for 12 requests of up to ~760: repeated preemption and
    resumption (through the prefix cache); outputs equal HF's, no block leaks."""
    per_block = 2 * 30 * BLOCK * 3 * 64 * 4  # fp32 K and V, 30 layers, 3 kv heads, dim 64
    # A small budget admits several long prompts chunk by chunk, so they compete for blocks.
    llm = _llm(kv_cache_memory_bytes=48 * per_block, max_model_len=768, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] >= 3
    for i, (out, expected) in enumerate(zip(outs, hf_outputs)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged under preemption"
    _free_blocks_all_back(llm)
