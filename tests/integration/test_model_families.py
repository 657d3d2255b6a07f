"""Every supported family, from a Hugging Face directory and from GGUF, token-exact with
transformers (float32, greedy) through the engine's paths: batching, chunked prefill,
preemption, prefix-cache hits and tensor parallelism.

The checkpoints are tiny random-weight models built by transformers itself
(`tests/model/families.py`): 6 query heads over 2 KV heads, the family's own features (QKV
biases for Qwen2, QK-norm for Qwen3, Llama 3.1's and YaRN's RoPE scaling, Phi-3's fused
projections and longrope), converted to GGUF under llama.cpp's names. The windowed families
(Mistral, Qwen2's sliding layers, Gemma, Phi-3) have windows of 20-24 tokens, shorter than
every prompt and than a chunk of them. Phi-3's longrope picks its long or short factors by
max_model_len, transformers per call: the tests at the end run it where the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.model.families import FAMILIES, convert_to_gguf, make_family_dir, reference_greedy

pytestmark = pytest.mark.integration

MAX_NEW = 10


def _block_bytes(hf_dir: str) -> int:
    """One KV block of the checkpoint: layers * (k, v) * kv heads * head_dim * fp32 * 16."""
    import json
    import os

    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4 * 16


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


EVERY_PATH = [f for f in FAMILIES if not FAMILIES[f].get("long_prompts_only")]
"""The families whose outputs equal transformers' for every prompt (not `phi3-long`)."""

FORMATS = [
    (family, fmt)
    for family in EVERY_PATH
    for fmt in ("hf", "gguf")
    if fmt == "hf" or FAMILIES[family]["gguf_arch"] is not None
]


@pytest.fixture(scope="module", params=EVERY_PATH)
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
        block_size=16,  # 14 small blocks: the prompts preempt each other; hits of 32 tokens
        kv_cache_memory_bytes=14 * _block_bytes(checkpoint.hf_dir),
    ) as llm:
        outs = _generate(llm, _prompts())
        assert [list(o.outputs[0].token_ids) for o in outs] == checkpoint.expected
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
        hits = _generate(llm, _hit_prompts(_prompts()))
    assert [list(o.outputs[0].token_ids) for o in hits] == checkpoint.expected_hits
    assert max(o.num_cached_tokens for o in hits) >= 32


PARALLEL = [("qwen2", 2, 1), ("gemma3", 2, 1), ("gemma2", 1, 2), ("phi3", 2, 1)]


@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp"), PARALLEL, indirect=["checkpoint"],
    ids=[f"{f}-tp{t}-pp{p}" for f, t, p in PARALLEL],
)  # fmt: skip
def test_family_matches_transformers_in_parallel(checkpoint: Checkpoint, tp: int, pp: int) -> None:
    """TP=2 over 6 query / 2 KV heads, each rank reading its rows of the GGUF file (and its
    slices of Qwen2's QKV biases; Gemma 3's windowed and global layers, QK-norm per head;
    its rows of each part of Phi-3's fused attn_qkv and ffn_up); PP=2 splits Gemma 2's
    sliding and global layers over two stages. Llama's TP is tested on the real model
    (tests/integration/test_executors.py)."""
    from pagedinfer import LLM

    with LLM(
        checkpoint.gguf, dtype="float32", max_model_len=256, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, max_num_batched_tokens=48,
    ) as llm:  # fmt: skip
        outs = _generate(llm, _prompts())
    assert [list(o.outputs[0].token_ids) for o in outs] == checkpoint.expected


SPECULATIVE = [("mistral", "ngram"), ("gemma3", "ngram"), ("gemma2", "draft")]


@pytest.mark.parametrize(
    ("checkpoint", "method"), SPECULATIVE, indirect=["checkpoint"],
    ids=[f"{f}-{m}" for f, m in SPECULATIVE],
)  # fmt: skip
def test_family_speculative_decoding_keeps_greedy_outputs(
    checkpoint: Checkpoint, method: str
) -> None:
    """Speculation over windowed layers: verifying k drafted tokens is a chunk of k + 1
    rows, each with its own window; the accepted tokens must be the greedy ones."""
    from pagedinfer import LLM

    # Repeated 12-token runs (48-60 tokens): the n-gram proposer finds matches in them.
    prompts = [p[:12] * (4 + i % 2) for i, p in enumerate(_prompts())]
    expected = reference_greedy(checkpoint.hf_dir, prompts, MAX_NEW)
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    else:  # the model's own first layer drafts (self-speculation)
        spec = {"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": 1}
    spec["disable_by_batch_size"] = None  # speculate in the batched steps too
    with LLM(
        checkpoint.hf_dir, dtype="float32", max_model_len=256, speculative_config=spec,
        log_stats_interval_s=0,
    ) as llm:  # fmt: skip
        outs = _generate(llm, prompts)
        assert llm.get_stats()["spec_num_draft_tokens"] > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.mark.parametrize("checkpoint", ["gemma2"], indirect=True)
def test_final_logit_soft_cap_reaches_the_logprobs(checkpoint: Checkpoint) -> None:
    """A soft cap on the logits keeps the greedy token (tanh is monotone) but not the
    logprobs: they must be transformers' capped ones."""
    import torch
    import transformers

    from pagedinfer import LLM, SamplingParams

    prompts = _prompts()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint.hf_dir, dtype=torch.float32
    )
    with torch.no_grad():
        expected = [
            torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1).max().item()
            for p in prompts
        ]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    with LLM(checkpoint.gguf, dtype="float32", max_model_len=160) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outs]
    assert got == pytest.approx(expected, abs=1e-4)


GGUF_FAMILIES = [f for f in FAMILIES if FAMILIES[f]["gguf_arch"] is not None]


@pytest.mark.parametrize("checkpoint", GGUF_FAMILIES, indirect=True)
def test_gguf_exported_as_hf_directory_runs_the_same_in_transformers(
    checkpoint: Checkpoint, tmp_path
) -> None:
    """`export_hf_dir` (for peers that cannot read GGUF) writes every family's own config
    keys (windows, layer types, Gemma's scalars) and weights (Gemma's norms without the 1
    the GGUF file adds): transformers on the export generates the original's tokens."""
    import torch

    from pagedinfer.model.loader import export_hf_dir

    if checkpoint.family == "llama3":  # llama.cpp's rope_freqs have no exact HF form
        with pytest.raises(ValueError, match="RoPE frequency factors from a GGUF file"):
            export_hf_dir(checkpoint.gguf, tmp_path / "hf", torch.float32)
        return
    out = export_hf_dir(checkpoint.gguf, tmp_path / "hf", torch.float32)
    assert reference_greedy(out, _prompts(), MAX_NEW) == checkpoint.expected


# ---- Phi-3's longrope: long factors above the original context, short ones within it -----


@dataclass
class LongRopeCheckpoint:
    """`phi3-long` (original context 64, max_position_embeddings 256) and transformers'
    greedy tokens of prompts all longer than 64 (it runs the long factors for them
    throughout) and of prompts that stay within 64 with their new tokens (short factors)."""

    hf_dir: str
    gguf: str
    expected_long: list[list[int]]
    expected_short: list[list[int]]

    def path(self, fmt: str) -> str:
        return self.hf_dir if fmt == "hf" else self.gguf


def _phi3_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lengths, 1)]


def _long_prompts() -> list[list[int]]:
    """Three prompts of 65-120 tokens: past the original context from the first token on."""
    return _phi3_prompts((65, 90, 120))


def _short_prompts() -> list[list[int]]:
    """Three prompts of 20-54 tokens: with their 10 new tokens, within the original context."""
    return _phi3_prompts((20, 37, 54))


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory) -> LongRopeCheckpoint:
    root = tmp_path_factory.mktemp("phi3-long")
    hf_dir = make_family_dir("phi3-long", str(root / "hf"))
    return LongRopeCheckpoint(
        hf_dir,
        convert_to_gguf(hf_dir, str(root / "model.gguf")),
        reference_greedy(hf_dir, _long_prompts(), MAX_NEW),
        reference_greedy(hf_dir, _short_prompts(), MAX_NEW),
    )


def _rope_cos(llm, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine's RoPE cos table, the one built for `max_model_len`)."""
    from pagedinfer.model.rotary import RotaryEmbedding

    worker = llm.llm_engine.engine_core.executor.worker
    built = RotaryEmbedding.of(worker.arch, worker.arch.max_position_embeddings, max_model_len)
    return worker.model.rotary.cos, built.cos


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_long_factors_match_transformers(phi3_long: LongRopeCheckpoint, fmt: str) -> None:
    """max_model_len 160 > 64: the long factors for every position, chunked prefill
    included; transformers runs them too, since every prompt is longer than 64."""
    from pagedinfer import LLM

    with LLM(
        phi3_long.path(fmt), dtype="float32", max_model_len=160, max_num_batched_tokens=32
    ) as llm:
        outs = _generate(llm, _long_prompts())
        engine, long_tables = _rope_cos(llm, 160)
        assert torch.equal(engine, long_tables)
    assert [list(o.outputs[0].token_ids) for o in outs] == phi3_long.expected_long


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_short_factors_within_the_original_context(
    phi3_long: LongRopeCheckpoint, fmt: str
) -> None:
    """max_model_len 64 = the original context: the short factors, as transformers runs
    for sequences that never pass 64 tokens (under a longer max_model_len these prompts
    would run the long ones: the tables differ)."""
    from pagedinfer import LLM

    with LLM(
        phi3_long.path(fmt), dtype="float32", max_model_len=64, max_num_batched_tokens=32
    ) as llm:
        outs = _generate(llm, _short_prompts())
        engine, short_tables = _rope_cos(llm, 64)
        assert torch.equal(engine, short_tables)
        assert not torch.equal(engine, _rope_cos(llm, 65)[1])
    assert [list(o.outputs[0].token_ids) for o in outs] == phi3_long.expected_short
