"""Every supported family, from a Hugging Face directory and from GGUF, token-exact with
transformers (float32, greedy) through the engine's paths: batching, chunked prefill,
preemption, prefix-cache hits and tensor parallelism.

The checkpoints are tiny random-weight models built by transformers itself
(`tests/model/families.py`): 6 query heads over 2 KV heads, the family's own features (QKV
biases for Qwen2, QK-norm for Qwen3, Llama 3.1's and YaRN's RoPE scaling), converted to
GGUF under llama.cpp's names.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.model.families import FAMILIES, convert_to_gguf, make_family_dir, reference_greedy

pytestmark = pytest.mark.integration

MAX_NEW = 10
BLOCK_BYTES = 3 * 2 * 2 * 16 * 4 * 16  # layers * (k, v) * kv heads * head_dim * fp32 * 16 tokens


def _prompts() -> list[list[int]]:
    """Four prompts of 30-120 tokens; with 14 KV blocks (224 tokens) they cannot all run
    at once."""
    return [[(11 * i + 7 * j) % 250 + 3 for j in range(30 + 30 * i)] for i in range(4)]


def _hit_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts sharing the first 48 tokens (three blocks) of the longer ones."""
    return [p[:48] + [5 + i, 9, 200] for i, p in enumerate(prompts[1:])]


@dataclass
class Checkpoint:
    family: str
    hf_dir: str
    gguf: str
    expected: list[list[int]]
    expected_hits: list[list[int]]

    def path(self, fmt: str) -> str:
        return self.hf_dir if fmt == "hf" else self.gguf


FORMATS = [
    (family, fmt)
    for family in FAMILIES
    for fmt in ("hf", "gguf")
    if fmt == "hf" or FAMILIES[family]["gguf_arch"] is not None
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    hf_dir = make_family_dir(family, str(root / "hf"))
    gguf = ""
    if FAMILIES[family]["gguf_arch"] is not None:
        gguf = convert_to_gguf(hf_dir, str(root / "model.gguf"))
    prompts = _prompts()
    return Checkpoint(
        family,
        hf_dir,
        gguf,
        reference_greedy(hf_dir, prompts, MAX_NEW),
        reference_greedy(hf_dir, _hit_prompts(prompts), MAX_NEW),
    )


def _generate(llm, prompts: list[list[int]]):
    from pagedinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize(
    ("checkpoint", "fmt"), FORMATS, indirect=["checkpoint"], ids=[f"{f}-{m}" for f, m in FORMATS]
)
def test_family_matches_transformers_through_every_path(checkpoint: Checkpoint, fmt: str) -> None:
    from pagedinfer import LLM

    with LLM(
        checkpoint.path(fmt),
        dtype="float32",
        max_model_len=160,
        max_num_batched_tokens=32,  # every prompt is prefilled in chunks, beside decodes
        kv_cache_memory_bytes=14 * BLOCK_BYTES,
    ) as llm:
        outs = _generate(llm, _prompts())
        assert [list(o.outputs[0].token_ids) for o in outs] == checkpoint.expected
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
        hits = _generate(llm, _hit_prompts(_prompts()))
    assert [list(o.outputs[0].token_ids) for o in hits] == checkpoint.expected_hits
    assert max(o.num_cached_tokens for o in hits) >= 32


@pytest.mark.parametrize("checkpoint", ["qwen2"], indirect=True)
def test_family_matches_transformers_with_tensor_parallelism(checkpoint: Checkpoint) -> None:
    """TP=2 over 6 query / 2 KV heads, each rank reading its rows of the GGUF file and its
    slices of the QKV biases. Llama's TP is tested on the real model
    (tests/integration/test_executors.py); QK-norm is per head, the same on every rank."""
    from pagedinfer import LLM

    with LLM(checkpoint.gguf, dtype="float32", max_model_len=256, tensor_parallel_size=2) as llm:
        outs = _generate(llm, _prompts())
    assert [list(o.outputs[0].token_ids) for o in outs] == checkpoint.expected
