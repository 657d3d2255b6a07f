"""Speculative decoding benchmarks (issue #6): output tokens/s with each method vs without
speculation, measured in the same run, at batch 1 and batch 16.

Usage:

    .venv/bin/python benchmarks/bench_spec_decode.py                       # everything
    .venv/bin/python benchmarks/bench_spec_decode.py --tasks copy --methods ngram --batch-sizes 1
    ... --k 3 --repeats 2 --num-prompts 8 --max-tokens 128 --dtype bfloat16 --out results.json

Tasks (greedy, chat template, the prompts of a task are the same for every configuration):
  copy      edit a given piece of code or text (add a docstring, fix typos, rename): the
            model copies most of its input, which is where prompt lookup shines;
  sharegpt  held-out ShareGPT conversations (rows >= 800 of the sample, never used to train
            the heads), their first turn as the prompt.

Methods: ngram (prompt_lookup 2..5, or `--prompt-lookup MIN,MAX`), draft_layers (the
target's first N layers), eagle and medusa (the heads in `--heads-dir`); each with the
engine's default `disable_by_batch_size` unless `--disable-by-batch-size`. Each method runs
paired with the baseline (no speculation) on the same prompts: both engines are alive and
take turns request by request (batch 1, one prompt at a time) or batch by batch (two batches
of B, prompts repeated to fill them), who goes first alternating, so the machine's drift
(+-20% within a minute on these shared hosts) hits both alike. Reported: output tok/s, the
ratio to the paired baseline, and the acceptance figures from `LLM.get_stats()`; the
outputs are compared with the baseline's (greedy in float32 they are equal; bf16 verify
steps round differently).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_HEADS_DIR = os.path.join(ROOT, "pagedinfer", "spec_decode", "trained")
HOLDOUT_START = 800

SNIPPETS = [
    (
        "Add a docstring and type hints to this function:",
        "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
        "            result.append(a[i])\n            i += 1\n        else:\n"
        "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n"
        "    result.extend(b[j:])\n    return result\n",
    ),
    (
        "Rename the function to count_words and keep the rest:",
        "def wc(text):\n    counts = {}\n    for word in text.split():\n"
        "        word = word.lower().strip('.,!?')\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return sorted(counts.items(), key=lambda kv: -kv[1])\n",
    ),
    (
        "Add error handling to this function:",
        "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
        "    config = {}\n    for line in lines:\n        key, value = line.split('=')\n"
        "        config[key.strip()] = value.strip()\n    return config\n",
    ),
    (
        "Add comments to this class:",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
        "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
        "        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1]\n\n"
        "    def is_empty(self):\n        return not self.items\n",
    ),
    (
        "Fix the typos in this paragraph and return it:",
        "The engin schedules requests in a continous batch. Each step, it gives every "
        "running request one token of budget, then fills the rest of the budget with chunks "
        "of waiting prompts. Finished requests free their blocks at once, so new requests "
        "can start in the very next step.",
    ),
    (
        "Convert this function to use a list comprehension:",
        "def squares_of_evens(numbers):\n    out = []\n    for n in numbers:\n"
        "        if n % 2 == 0:\n            out.append(n * n)\n    return out\n",
    ),
    (
        "Add type hints to this function:",
        "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n"
        "            return user\n    return None\n",
    ),
    (
        "Rewrite this text in the past tense:",
        "The team reviews every change before it lands. A change that breaks a test does not "
        "land; its author fixes it and sends it again. The main branch stays green, and "
        "anyone can release from it at any time.",
    ),
]


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    out = []
    for ask, body in SNIPPETS:
        fence = "```python\n" if "def " in body or "class " in body else "```\n"
        msgs = [{"role": "user", "content": f"{ask}\n{fence}{body}```"}]
        out.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    return out


def sharegpt_prompts(tokenizer: Any, n: int, dataset_path: str | None = None) -> list[list[int]]:
    """Turn 0 of the held-out rows of `dataset_path` (None: the default ShareGPT file; a
    ValueError naming --dataset-path where it does not exist), 8-512 template tokens."""
    from pagedinfer.bench.datasets import resolve_dataset_path

    with open(resolve_dataset_path(dataset_path, "--dataset-path"), encoding="utf-8") as f:
        rows = json.load(f)
    out = []
    for row in rows[HOLDOUT_START:]:
        turns = row.get("conversations", [])
        if not turns:
            continue
        msgs = [{"role": "user", "content": turns[0]["value"]}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if 8 <= len(ids) <= 512:
            out.append(ids)
        if len(out) == n:
            break
    return out


def add_dataset_path_arg(parser: argparse.ArgumentParser) -> None:
    """--dataset-path, as `pagedinfer bench` names it (the benchmarks importing
    `sharegpt_prompts` share it)."""
    parser.add_argument(
        "--dataset-path", default=None,
        help="ShareGPT JSON of the sharegpt prompts (default, where it exists: "
        "sharegpt_v3_sample.json in $PAGEDINFER_DATA_DIR, else in ../shared/data)",
    )  # fmt: skip


def checked_dataset_path(parser: argparse.ArgumentParser, path: str | None) -> str:
    """`path` or the default ShareGPT file; a usage error naming --dataset-path (before
    any engine loads) when neither exists."""
    from pagedinfer.bench.datasets import resolve_dataset_path

    try:
        return resolve_dataset_path(path, "--dataset-path")
    except ValueError as exc:
        parser.error(str(exc))


def spec_config(method: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if method == "baseline":
        return None
    config = method_config(method, args)
    if args.disable_by_batch_size != "auto":
        limit = args.disable_by_batch_size
        config["disable_by_batch_size"] = None if limit == "none" else int(limit)
    return config


def method_config(method: str, args: argparse.Namespace) -> dict[str, Any]:
    k = args.k
    if method == "ngram":
        lo, hi = (int(x) for x in args.prompt_lookup.split(","))
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": lo, "prompt_lookup_max": hi}  # fmt: skip
    if method == "draft_layers":
        return {"method": "draft_model", "num_speculative_tokens": k,
                "draft_layers": args.draft_layers}  # fmt: skip
    path = os.path.join(args.heads_dir, f"smollm2-135m-instruct-{method}.safetensors")
    return {"method": method, "num_speculative_tokens": k, "model": path}


def make_llm(method: str, args: argparse.Namespace) -> Any:
    from pagedinfer import LLM, SamplingParams

    llm = LLM(
        dtype=args.dtype,
        max_model_len=2048,
        kv_cache_memory_bytes=512 * 2**20,
        log_stats_interval_s=0,
        speculative_config=spec_config(method, args),
        **({} if args.quant_max_tokens is None else {"quant_max_tokens": args.quant_max_tokens}),
    )
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
    return llm


def timed_generate(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from pagedinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def run_pair(
    method: str, prompts: list[list[int]], batch_size: int, args: argparse.Namespace, r: int
) -> dict[str, Any]:
    """The baseline and `method`, both engines alive, alternating request by request (batch
    1) or batch by batch, who goes first alternating too: the machine's drift (+-20% over a
    minute here) hits both alike."""
    llms = {"baseline": make_llm("baseline", args), method: make_llm(method, args)}
    if batch_size == 1:
        units = [[ids] for ids in prompts]
    else:
        units = [[prompts[i % len(prompts)] for i in range(batch_size)]] * 2
    wall = {"baseline": 0.0, method: 0.0}
    outputs: dict[str, list] = {"baseline": [], method: []}
    for u, batch in enumerate(units):
        order = ["baseline", method] if (u + r) % 2 == 0 else [method, "baseline"]
        for name in order:
            dt, outs = timed_generate(llms[name], batch, args.max_tokens)
            wall[name] += dt
            outputs[name].extend(outs)
    stats = llms[method].get_stats()
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    del llms
    gc.collect()
    tokens = {name: sum(len(o) for o in outs) for name, outs in outputs.items()}
    row = {
        "tok_s": tokens[method] / wall[method],
        "baseline_tok_s": tokens["baseline"] / wall["baseline"],
        "same_outputs": outputs[method] == outputs["baseline"],
    }
    for key in ("spec_acceptance_rate", "spec_mean_acceptance_length"):
        row[key] = stats.get(key)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="copy,sharegpt")
    parser.add_argument("--methods", default="ngram,draft_layers,eagle,medusa")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument(
        "--disable-by-batch-size", default="auto",
        help="speculative_config's disable_by_batch_size: auto (the method's default), none "
        "(always speculate) or a number",
    )  # fmt: skip
    parser.add_argument(
        "--quant-max-tokens", type=int, default=None,
        help="the engines' quant_max_tokens (default: the engine's default)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-lookup", default="2,5", help="ngram: prompt_lookup_min,prompt_lookup_max"
    )
    add_dataset_path_arg(parser)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads-dir", default=DEFAULT_HEADS_DIR)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "sharegpt" in args.tasks.split(","):
        args.dataset_path = checked_dataset_path(parser, args.dataset_path)

    from pagedinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    methods = [m for m in args.methods.split(",") if m]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    log(f"[{started}] {' '.join(sys.argv)}")
    results: list[dict[str, Any]] = []
    for task in args.tasks.split(","):
        if task == "copy":
            prompts = copy_prompts(tokenizer)[: args.num_prompts]
        else:
            prompts = sharegpt_prompts(tokenizer, args.num_prompts, args.dataset_path)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            for r in range(args.repeats):
                for m in methods:
                    run = run_pair(m, prompts, batch_size, args, r)
                    row = {
                        "task": task, "batch_size": batch_size, "round": r + 1,
                        "method": m, "tok_s": run["tok_s"],
                        "baseline_tok_s": run["baseline_tok_s"],
                        "ratio": run["tok_s"] / run["baseline_tok_s"],
                        "same_outputs": run["same_outputs"],
                        "acceptance_rate": run["spec_acceptance_rate"],
                        "mean_acceptance_length": run["spec_mean_acceptance_length"],
                    }  # fmt: skip
                    results.append(row)
                    log(
                        f"  {task} b={batch_size} r{r + 1} {m}: {run['tok_s']:.1f} tok/s vs "
                        f"{run['baseline_tok_s']:.1f} ({row['ratio']:.2f}x), accept len "
                        f"{row['mean_acceptance_length']}, same outputs {row['same_outputs']}"
                    )
    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}` ({started}, commit "
          f"{commit}, {args.dtype}, k={args.k}, ngram lookup {args.prompt_lookup}, "
          f"disable_by_batch_size {args.disable_by_batch_size}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n")  # fmt: skip
    print(
        "| task | batch | method | rounds: tok/s (baseline tok/s) | median ratio "
        "| mean acceptance length | acceptance rate | outputs equal baseline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["task"], r["batch_size"], r["method"]) for r in results},
                  key=lambda t: (t[0], t[1], methods.index(t[2])))  # fmt: skip
    for task, bs, m in keys:
        rows = [r for r in results if (r["task"], r["batch_size"], r["method"]) == (task, bs, m)]
        runs = ", ".join(f"{r['tok_s']:.1f} ({r['baseline_tok_s']:.1f})" for r in rows)
        ratio = statistics.median(r["ratio"] for r in rows)
        mal = rows[-1]["mean_acceptance_length"]
        rate = rows[-1]["acceptance_rate"]
        same = all(r["same_outputs"] for r in rows)
        print(f"| {task} | {bs} | {m} | {runs} | {ratio:.2f}x | "
              f"{mal if mal is None else f'{mal:.2f}'} | "
              f"{rate if rate is None else f'{rate:.2f}'} | {same} |")  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
