"""Hugging Face transformers peer: the baseline everyone knows (and the fp32 correctness reference).

Loads the GGUF directly (`from_pretrained(dir, gguf_file=...)`). transformers 5.2x keeps GGUF
weights packed by default and, lacking its hub-published matmul kernel (none offline), unpacks
them inside every forward; --gguf-weights dense (default) passes GgufConfig(dequantize=True) for
a plain dense model in --dtype instead.

Offline throughput follows vLLM's HF backend: requests in workload order are packed into batches
of up to --batch-size while max prompt + max output <= 2048; each batch is left-padded and
generates the batch's largest output_len greedily with min_new_tokens = max_new_tokens (EOS cannot
end it); the figure counts only the requested output lengths. Runs in the repo venv:

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/peers/hf_bench.py --dtype bfloat16 \
        --batch-size 32 --workload /opt/peers/work/workload.json [--num-requests N]
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from common import base_parser, emit, load_workload, log, prefill_and_decode, reserve_stdout  # noqa: E402
from transformers import AutoModelForCausalLM, GgufConfig  # noqa: E402


def batches(requests: list[dict], batch_size: int, max_tokens: int = 2048) -> list[list[dict]]:
    out: list[list[dict]] = [[]]
    for req in requests:
        cur = out[-1] + [req]
        fits = max(len(r["prompt_token_ids"]) for r in cur) + max(r["output_len"] for r in cur)
        if out[-1] and (len(cur) > batch_size or fits > max_tokens):
            out.append([req])
        else:
            out[-1] = cur
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="GGUF file (default: pagedinfer's default model)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--gguf-weights", choices=["dense", "packed"], default="dense")
    args = parser.parse_args()
    reserve_stdout()
    if args.model is None:
        from pagedinfer.gguf_metadata import find_default_model

        args.model = find_default_model()
    torch.set_num_threads(args.threads)
    workload = load_workload(args.workload, args.num_requests)
    requests = workload["requests"]

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(args.model),
        gguf_file=os.path.basename(args.model),
        dtype=getattr(torch, args.dtype),
        quantization_config=GgufConfig(dequantize=args.gguf_weights == "dense"),
    ).eval()
    load_s = time.perf_counter() - start
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id
    proj = model.model.layers[0].mlp.down_proj
    log(
        f"loaded in {load_s:.1f}s, pad_token_id={pad_id}, {type(proj).__name__} {proj.weight.dtype}"
    )

    @torch.inference_mode()
    def generate_batch(prompts: list[list[int]], n: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad_id,
        )
        assert out.shape[1] == width + n, out.shape
        return out

    generate_batch([r["prompt_token_ids"] for r in requests[:2]], 8)  # warm-up
    groups = batches(requests, args.batch_size)
    generated = 0
    start = time.perf_counter()
    for i, group in enumerate(groups):
        n = max(r["output_len"] for r in group)
        generate_batch([r["prompt_token_ids"] for r in group], n)
        generated += n * len(group)
        elapsed = time.perf_counter() - start
        log(f"batch {i + 1}/{len(groups)}: {len(group)} x {n} tokens, {elapsed:.1f}s")
    offline_s = time.perf_counter() - start
    requested = sum(r["output_len"] for r in requests)

    result = {
        "engine": f"transformers {transformers.__version__}",
        "dtype": args.dtype,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "gguf_weights": args.gguf_weights,
        "load_s": round(load_s, 2),
        "offline_output_tok_s": round(requested / offline_s, 1),
        "offline_num_requests": len(requests),
        "offline_output_tokens": requested,
        "offline_generated_tokens": generated,
        "offline_s": round(offline_s, 2),
    }
    result.update(
        prefill_and_decode(
            lambda p, n: generate_batch([p], n), workload, args.decode_tokens, args.repeats
        )
    )
    emit(result)


if __name__ == "__main__":
    main()
