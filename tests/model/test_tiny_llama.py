"""Our model + paged KV cache vs transformers' plain forward, on a tiny random Llama (fp32).

Prompt logprobs expose the logits of every prompt position, so comparing them with
transformers' log_softmax checks the whole path (loader, fused projections, RoPE, GQA,
paged attention, chunked prefill, batching) to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer import LLM, SamplingParams

from .tiny import VOCAB

transformers = pytest.importorskip("transformers")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [5, 37, 64, 100, 3, 129]
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0]  # [len, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},  # whole prompts in one step, fast attention path
        {"max_num_batched_tokens": 16},  # every prompt in chunks over a cached prefix
        {"attention_backend": "torch_ref", "max_num_batched_tokens": 40, "block_size": 4},
    ],
    ids=["whole", "chunked", "torch_ref"],
)
def test_prompt_logprobs_match_transformers(tiny_dir, hf_model, engine_kwargs) -> None:
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=8 * 2**20, **engine_kwargs)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        expected = _hf_logprobs(hf_model, ids)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert entry is not None
            for token_id, lp in entry.items():
                want = expected[pos - 1, token_id].item()
                assert lp.logprob == pytest.approx(want, abs=1e-5, rel=2e-6)
            top5 = set(expected[pos - 1].topk(5).indices.tolist())
            assert top5 <= set(entry)


def test_greedy_generation_matches_transformers(tiny_dir, hf_model) -> None:
    llm = LLM(
        tiny_dir,
        dtype="float32",
        kv_cache_memory_bytes=8 * 2**20,
        block_size=8,
        max_num_batched_tokens=48,
    )
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            gen = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == gen[0, len(ids) :].tolist()


def test_q8_lm_head_close_to_dense_in_bf16(tiny_dir) -> None:
    """Small bf16 steps of an HF-directory model use a Q8_0 quantisation of the LM head; it
    must stay close to the dense one (same argmax on most rows, small relative error) and
    large steps stay dense."""
    llm = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory_bytes=8 * 2**20)
    model = llm.llm_engine.engine_core.executor.worker.model
    assert model.lm_head_quant is not None and model.lm_head_quant.kind == "Q8"
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 64, generator=g).to(torch.bfloat16)  # 4 rows: int8 path
    dense = torch.nn.functional.linear(hidden, model.embed_tokens.weight).float()
    quant = model.compute_logits(hidden).float()
    rel = (quant - dense).abs().max() / dense.abs().max()
    assert rel < 0.02
    assert (quant.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.75
    cut = llm.llm_engine.engine_core.executor.worker.quant_max_tokens
    big = torch.randn(cut + 1, 64, generator=g).to(torch.bfloat16)  # above the cut-off: dense
    expected = torch.nn.functional.linear(big, model.embed_tokens.weight).float()
    assert torch.equal(model.compute_logits(big).float(), expected)
