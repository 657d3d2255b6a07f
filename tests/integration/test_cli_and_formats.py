"""The `pagedinfer` CLI in real subprocesses, and loading the model as an HF directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedinfer import LLM, SamplingParams

pytestmark = pytest.mark.integration

SMALL = ["--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-model-len", "512"]


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedinfer", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_generate_prints_text() -> None:
    proc = _run(["generate", "--prompt", "Hello, my name is", "--max-tokens", "12", *SMALL])
    assert proc.returncode == 0, proc.stderr
    # Greedy continuation of this prompt by the default model (same as transformers).
    assert "Alex, and I'm a professional coach" in proc.stdout
    assert "finish_reason=length" in proc.stdout
    assert "KV cache:" in proc.stderr and "blocks" in proc.stderr  # startup log
    assert "output tok/s" in proc.stdout  # end-of-run throughput


def test_cli_chat_streams_a_reply() -> None:
    proc = _run(["chat", "--max-tokens", "16", *SMALL], stdin="What is the capital of France?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


def test_cli_rejects_bad_option() -> None:
    proc = _run(["generate", "--policy", "random"])
    assert proc.returncode != 0 and "invalid choice" in proc.stderr


def test_hf_directory_gives_the_same_greedy_tokens(tmp_path, default_gguf_path) -> None:
    import torch

    from pagedinfer.model.loader import export_hf_dir

    hf_dir = export_hf_dir(default_gguf_path, os.path.join(tmp_path, "smollm2"), torch.float32)
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = "The capital of France is"
    # Dense weights on both sides (an HF directory has no 4-bit codes).
    gguf = LLM(quant_max_tokens=0, **kwargs).generate(prompt, params, use_tqdm=False)[0]
    hf = LLM(hf_dir, **kwargs).generate(prompt, params, use_tqdm=False)[0]
    assert hf.prompt_token_ids == gguf.prompt_token_ids
    assert hf.outputs[0].token_ids == gguf.outputs[0].token_ids
    assert hf.outputs[0].text == gguf.outputs[0].text


def test_auto_activations_on_the_avx2_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the AVX2 tier `dtype="auto"` is float32 with int8 activations for the quantised
    products (llama.cpp's arithmetic: the tier's speed-first setting) and every step through
    them; an explicit `dtype="float32"` keeps exact activations and the exact cut-off."""
    from pagedinfer.kernels.cpu import cpu_isa

    if cpu_isa() not in ("avx2", "avx512", "amx"):
        pytest.skip(f"no AVX2 here ({cpu_isa()})")
    monkeypatch.setenv("PAGEDINFER_MAX_CPU_ISA", "avx2")
    seen = {}
    for dtype in ("auto", "float32"):
        with LLM(dtype=dtype, kv_cache_memory_bytes=32 * 2**20, max_model_len=256) as llm:
            worker = llm.llm_engine.engine_core.executor.worker
            down = worker.model.layers[0].mlp.down_proj
            seen[dtype] = (worker.dtype, down.quant.activations, worker.quant_max_tokens)
    assert seen["auto"] == (torch.float32, "int8", 2048)
    assert seen["float32"] == (torch.float32, "float32", 64)


def test_projections_without_a_dense_copy_when_every_step_is_quantised() -> None:
    """With `quant_max_tokens` >= `max_num_batched_tokens` the quantised kernels take every
    step, so the projections are loaded without their dense bf16 matrices: the parameters
    shrink by exactly those bytes, the quantised ones stay, and the greedy tokens equal those
    of the same cut-off with the dense copies kept (a larger token budget; every step of
    these prompts is within the cut-off either way)."""
    kwargs = dict(
        dtype="bfloat16", kv_cache_memory_bytes=64 * 2**20, max_model_len=512, quant_max_tokens=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = ["The capital of France is", "Here is a short poem about the sea:"]
    runs = {}
    for budget in (512, 1024):
        with LLM(max_num_batched_tokens=budget, **kwargs) as llm:
            worker = llm.llm_engine.engine_core.executor.worker
            mlp = worker.model.layers[0].mlp
            dense = {
                name: int(module.weight.numel()) * 2 if module.weight is not None else 0
                for name, module in worker.model.named_modules()
                if name.endswith("_proj") and module.quant is not None
            }
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[budget] = (
                [o.outputs[0].token_ids for o in outs],
                worker.rank_info(),
                sum(dense.values()),
                mlp.down_proj.weight is None,
            )
    lean, full = runs[512], runs[1024]
    assert lean[3] and not full[3]  # dropped only when every step is within the cut-off
    assert lean[2] == 0 and full[2] > 0
    assert full[1]["param_bytes"] - lean[1]["param_bytes"] == full[2]
    assert lean[1]["quant_bytes"] == full[1]["quant_bytes"] > 0
    assert lean[0] == full[0]
