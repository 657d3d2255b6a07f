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
