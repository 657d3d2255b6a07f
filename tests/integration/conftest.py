"""Fixtures shared by the integration tests: the parity prompts and Hugging Face's greedy
outputs for them (computed once per session, float32, same GGUF weights)."""

from __future__ import annotations

import json
import os

import pytest

MAX_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def tokenizer(default_gguf_path):
    from pagedinfer.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_gguf_path)


@pytest.fixture(scope="session")
def prompts(tokenizer, shared_dir) -> list[list[int]]:
    """The 8 example prompts plus the first 4 ShareGPT prompts of 300-700 tokens."""
    with open(os.path.join(shared_dir, "data", "example_prompts.txt"), encoding="utf-8") as f:
        short = [line.rstrip("\n") for line in f if line.strip()]
    with open(os.path.join(shared_dir, "data", "sharegpt_v3_sample.json"), encoding="utf-8") as f:
        rows = json.load(f)
    long: list[list[int]] = []
    for row in rows:
        turns = row.get("conversations", [])
        if not turns:
            continue
        ids = tokenizer.encode(turns[0]["value"])
        if 300 < len(ids) <= 700:
            long.append(ids)
        if len(long) == 4:
            break
    assert len(short) == 8 and len(long) == 4
    return [tokenizer.encode(p) for p in short] + long


@pytest.fixture(scope="session")
def hf_greedy(default_gguf_path):
    """prompt ids -> Hugging Face transformers' greedy continuation (memoised)."""
    transformers = pytest.importorskip("transformers")
    import torch

    os.environ["HF_HUB_OFFLINE"] = "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf_path),
        gguf_file=os.path.basename(default_gguf_path),
        dtype=torch.float32,
    )
    model.eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                input_ids = torch.tensor([ids])
                gen = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=model.config.eos_token_id,
                )
            cache[key] = gen[0, len(ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def hf_outputs(prompts, hf_greedy) -> list[list[int]]:
    return [hf_greedy(ids) for ids in prompts]


# Tensor/pipeline parallel tests (test_executors.py, test_ray_executor.py): float32, so the
# sharded engines must equal the single-rank one token for token.
PARALLEL_ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 1024}
PARALLEL_MAX_TOKENS = 32


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int = PARALLEL_MAX_TOKENS):
    from pagedinfer import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="session")
def single_rank_run(prompts) -> tuple[list[list[int]], int]:
    """The single-rank engine's greedy outputs on `prompts` and its parameter bytes (the
    reference of every parallel configuration; computed once per session)."""
    from pagedinfer import LLM

    with LLM(**PARALLEL_ENGINE) as llm:
        info = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")[0]
        return greedy_token_ids(llm, prompts), info["param_bytes"]


def kill_mid_generation(llm, pid: int, warmup_s: float, max_tokens: int = 2000):
    """Generate in a thread, SIGKILL `pid` (a worker rank) after `warmup_s`, and wait for
    the generate call to fail: (the exceptions it raised, seconds from kill to failure)."""
    import signal
    import threading
    import time

    errors: list[BaseException] = []

    def run() -> None:
        try:
            greedy_token_ids(llm, [[5, 6, 7, 8]] * 4, max_tokens=max_tokens)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(warmup_s)  # mid-generation
    assert thread.is_alive(), "generation ended before the kill"
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive(), "generation still running 30 s after the kill"
    return errors, time.monotonic() - killed_at
