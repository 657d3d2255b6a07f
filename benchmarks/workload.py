"""Build the shared benchmark workload: the same token ids for every engine.

ShareGPT the vLLM way (`benchmarks/benchmark_dataset.py --dataset-name sharegpt` convention):
keep conversations with at least two turns, shuffle them with random.Random(seed), then walk
them in order: turn 0 is the prompt, the token count of turn 1 is the output length; drop rows
whose prompt or output is under 4 tokens, whose prompt is over 1,024 tokens or whose
prompt + output is over 2,048 tokens; keep the first N (default 200) rows that remain.

Also writes a 512-token prefill prompt (the first 512 tokens of real ShareGPT text) and a
short batch-1 decode prompt (the first line of example_prompts.txt beside the dataset, else
the dataset's first prompt).

Runs under any of the benchmark venvs: stdlib plus either `tokenizers` (--tokenizer
<hf_dir>/tokenizer.json) or pagedinfer (--tokenizer model.gguf, the default when pagedinfer is
importable). Both spell the same byte-level BPE, so the ids are the same either way.

    python benchmarks/workload.py --out /opt/peers/work/workload.json [--num-requests 200] \
        [--dataset-path sharegpt.json]

Output: {"requests": [{"prompt_token_ids": [...], "output_len": int}, ...],
         "prefill_prompt_token_ids": [...512 ids], "decode_prompt_token_ids": [...], "meta": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections.abc import Callable

# The convenience default of --dataset-path (pagedinfer.bench.datasets' rule, restated: this
# script may run where pagedinfer is not importable).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get("PAGEDINFER_DATA_DIR") or os.path.join(ROOT, "..", "shared", "data")
DEFAULT_DATASET = os.path.normpath(os.path.join(DATA_DIR, "sharegpt_v3_sample.json"))
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
PREFILL_LEN = 512


def load_encoder(spec: str | None) -> Callable[[str], list[int]]:
    """Return text -> token ids (special tokens added as the tokenizer's post-processor says)."""
    if spec and spec.endswith(".json"):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(spec)
        return lambda text: backend.encode(text).ids
    from pagedinfer.tokenizer import Tokenizer as PagedTokenizer

    if spec is None:
        from pagedinfer.gguf_metadata import find_default_model

        spec = find_default_model()
    tok = (
        PagedTokenizer.from_gguf(spec)
        if spec.endswith(".gguf")
        else PagedTokenizer.from_hf_dir(spec)
    )
    return tok.encode


def is_valid(prompt_len: int, output_len: int) -> bool:
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def build(encode: Callable[[str], list[int]], num_requests: int, seed: int, dataset: str) -> dict:
    with open(dataset, encoding="utf-8") as f:
        rows = [r for r in json.load(f) if len(r.get("conversations", [])) >= 2]
    original = list(rows)
    random.Random(seed).shuffle(rows)

    valid = []  # all valid rows, in shuffled order (to report the pool size)
    for row in rows:
        prompt, completion = row["conversations"][0]["value"], row["conversations"][1]["value"]
        prompt_ids, output_len = encode(prompt), len(encode(completion))
        if is_valid(len(prompt_ids), output_len):
            valid.append({"prompt_token_ids": prompt_ids, "output_len": output_len})
    if len(valid) < num_requests:
        raise SystemExit(f"only {len(valid)} valid rows, asked for {num_requests}")
    requests = valid[:num_requests]

    # Prefill prompt: real text (the dataset's conversations in file order) cut at 512 tokens.
    prefill: list[int] = []
    for row in original:
        for turn in row["conversations"]:
            prefill += encode(turn["value"] + "\n")
        if len(prefill) >= PREFILL_LEN:
            break
    examples = os.path.join(os.path.dirname(dataset), "example_prompts.txt")
    if os.path.isfile(examples):
        with open(examples, encoding="utf-8") as f:
            decode_prompt = encode(f.readline().strip())
    else:
        decode_prompt = encode(original[0]["conversations"][0]["value"])

    p_lens = [len(r["prompt_token_ids"]) for r in requests]
    o_lens = [r["output_len"] for r in requests]
    meta = {
        "dataset": os.path.basename(dataset),
        "seed": seed,
        "num_requests": num_requests,
        "valid_rows": len(valid),
        "prompt_tokens": sum(p_lens),
        "output_tokens": sum(o_lens),
        "prompt_len_median": statistics.median(p_lens),
        "output_len_median": statistics.median(o_lens),
    }
    return {
        "meta": meta,
        "requests": requests,
        "prefill_prompt_token_ids": prefill[:PREFILL_LEN],
        "decode_prompt_token_ids": decode_prompt,
    }


def load(path: str, num_requests: int | None = None) -> dict:
    """Read a workload file (optionally keeping only the first `num_requests` requests)."""
    with open(path, encoding="utf-8") as f:
        workload = json.load(f)
    if num_requests is not None:
        workload["requests"] = workload["requests"][:num_requests]
    return workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dataset-path",
        default=None,
        help=f"ShareGPT JSON (default, where it exists: {DEFAULT_DATASET})",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json (needs `tokenizers`), a .gguf or HF dir (needs pagedinfer); "
        "default: pagedinfer's default GGUF model",
    )
    args = parser.parse_args()
    dataset = args.dataset_path or DEFAULT_DATASET
    if not args.dataset_path and not os.path.isfile(dataset):
        parser.error(f"no dataset given: pass --dataset-path (the default, {dataset}, is absent)")
    workload = build(load_encoder(args.tokenizer), args.num_requests, args.seed, dataset)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(workload, f)
    print(json.dumps(workload["meta"]), file=sys.stderr)


if __name__ == "__main__":
    main()
