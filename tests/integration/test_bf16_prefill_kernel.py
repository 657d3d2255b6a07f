"""bfloat16 on the real model: prompts prefilled by the bfloat16 paged prefill kernel (in chunks
over a cached prefix, and over prefix-cache hits) score their tokens as the SDPA path does.

bfloat16 runs are not bit-comparable across attention implementations (the rounding of
every layer's output differs), so this compares each prompt token's log-probability:
the two paths differ by bfloat16 noise (measured: mean 0.035, p95 0.12 nats); an error in
the kernel's masking or paging moves them by whole nats. Skipped without AVX-512-BF16.
"""

from __future__ import annotations

import statistics

import pytest

from pagedinfer.kernels.cpu import load_cpu_kernels

_kernels = load_cpu_kernels()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        _kernels is None or not _kernels.prefill_attention_available(),
        reason="no AVX-512-BF16 here: the paged prefill kernel is not built in",
    ),
]


def _prompt_logprobs(llm, prompts: list[list[int]]) -> list[list[float]]:
    from pagedinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    result = []
    for out in outs:
        assert out.prompt_logprobs is not None
        result.append([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])
    return result


def _assert_close(a: list[list[float]], b: list[list[float]]) -> None:
    diffs = sorted(
        abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )
    assert statistics.mean(diffs) < 0.08, statistics.mean(diffs)
    assert diffs[int(0.95 * len(diffs))] < 0.3, diffs[int(0.95 * len(diffs))]


def test_kernel_prefill_scores_prompts_like_sdpa(prompts, tokenizer) -> None:
    from pagedinfer import LLM

    opts = {"dtype": "bfloat16", "kv_cache_memory_bytes": 128 * 2**20, "max_model_len": 2048}
    system = prompts[8]
    shared = [system + tokenizer.encode(" " + q) for q in ("Why?", "Say it again, briefly.")]
    batch = prompts[9:12] + shared

    reference = LLM(attention_backend="cpu_sdpa", enable_prefix_caching=False, **opts)
    assert reference.llm_engine.engine_core.executor.worker.backend.name == "cpu_sdpa"
    expected = _prompt_logprobs(reference, batch)
    del reference

    # Dense products as in the reference (which has no C++ build, hence no quantised path):
    # the 64-token steps would otherwise take the int8-activation products (bfloat16's
    # default up to 256 rows on AVX-512), whose rounding is not what this test measures.
    llm = LLM(max_num_batched_tokens=64, quant_max_tokens=0, **opts)
    assert llm.llm_engine.engine_core.executor.worker.backend.prefill_kernel
    _prompt_logprobs(llm, [system])  # warm the prefix cache: `shared` then starts with hits
    got = _prompt_logprobs(llm, batch)
    _assert_close(got, expected)
