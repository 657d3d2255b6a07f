"""The int8 KV cache against the model-dtype cache: greedy agreement and logit drift.

Same engine, same prompts, `kv_cache_dtype="auto"` then `"int8"`:
- free-running greedy: each request's output with the int8 cache against the float one's:
  identical outputs, the share of tokens before the first difference, and where the first
  difference falls (a difference once made changes everything after it, so these are
  lower bounds on the per-token agreement);
- teacher-forced drift: each prompt + the float run's greedy output scored as a prompt
  (`prompt_logprobs`) with chunked prefill of --chunk tokens, prefix caching off, so every
  chunk after the first reads the context from the cache (int8 or float): over the output
  positions, how often the most likely token agrees, and |delta log p| of the float run's
  most likely token.

ShareGPT prompts from the benchmark workload (benchmarks/workload.py; --dataset-path to
override the ../shared/data sample), or --prompts FILE (one per line).

    .venv/bin/python benchmarks/bench_kv_cache_dtype.py [--model M.gguf] [--dtype float32] \
        [--num-prompts 64] [--max-tokens 128] [--chunk 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prompts(args) -> list[list[int]]:
    from benchmarks import workload

    encode = workload.load_encoder(args.model)
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            return [encode(line.strip()) for line in f if line.strip()][: args.num_prompts]
    dataset = args.dataset_path or workload.DEFAULT_DATASET
    data = workload.build(encode, args.num_prompts, 0, dataset)
    # Long prompts cost the teacher-forced pass most and add little: cut at 512 tokens.
    return [r["prompt_token_ids"][:512] for r in data["requests"]]


def _engine(args, kv_cache_dtype: str, **extra):
    from pagedinfer import LLM

    return LLM(
        model=args.model, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
        max_model_len=2048, **extra,
    )  # fmt: skip


def _greedy(args, kv_cache_dtype: str, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    from pagedinfer import SamplingParams

    llm = _engine(args, kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def _scored(args, kv_cache_dtype: str, sequences: list[list[int]]) -> list[list[dict]]:
    """prompt_logprobs (top 5 + the actual token) of each whole sequence."""
    from pagedinfer import SamplingParams

    llm = _engine(
        args, kv_cache_dtype, enable_prefix_caching=False, max_num_batched_tokens=args.chunk,
        long_prefill_token_threshold=args.chunk,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    del llm
    return [
        [{t: lp.logprob for t, lp in (pos or {}).items()} for pos in o.prompt_logprobs]
        for o in outs
    ]


def logprob_agreement(pairs: Iterable[tuple[dict[int, float], dict[int, float]]]) -> dict:
    """Over (reference, other) top-k logprobs per position (positions either side left
    empty are skipped): how often the most likely token agrees, and |delta log p| of the
    reference's most likely token (mean, p99, max)."""
    agree = positions = 0
    drift: list[float] = []
    for a, b in pairs:
        if not a or not b:
            continue
        top_a = max(a, key=a.__getitem__)
        positions += 1
        agree += top_a == max(b, key=b.__getitem__)
        if top_a in b:
            drift.append(abs(a[top_a] - b[top_a]))
    drift.sort()
    return {
        "positions": positions,
        "top1_agreement": round(agree / max(positions, 1), 4),
        "drift_logp_mean": round(statistics.fmean(drift), 5) if drift else None,
        "drift_logp_p99": round(drift[int(0.99 * (len(drift) - 1))], 5) if drift else None,
        "drift_logp_max": round(drift[-1], 5) if drift else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk (teacher-forced)")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--prompts", default=None, help="a file of prompts, one per line")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    prompts = _prompts(args)
    ref, ref_s = _greedy(args, "auto", prompts)
    q8, q8_s = _greedy(args, "int8", prompts)
    firsts = []
    for a, b in zip(ref, q8, strict=True):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    total = sum(len(a) for a in ref)

    # Teacher-forced: score prompt + the float run's output with each cache.
    sequences = [p + o for p, o in zip(prompts, ref)]
    float_lp = _scored(args, "auto", sequences)
    int8_lp = _scored(args, "int8", sequences)
    scores = logprob_agreement(
        (a[pos], b[pos])
        for p, a, b in zip(prompts, float_lp, int8_lp)
        for pos in range(len(p), len(a))  # the output positions
    )
    result = {
        "prompts": len(prompts),
        "output_tokens": total,
        "identical_outputs": sum(f == len(a) for f, a in zip(firsts, ref)),
        "tokens_before_first_difference": round(sum(firsts) / total, 4),
        "first_difference_median": statistics.median(firsts),
        "teacher_forced_positions": scores["positions"],
        "teacher_forced_top1_agreement": scores["top1_agreement"],
        "drift_logp_mean": scores["drift_logp_mean"],
        "drift_logp_p99": scores["drift_logp_p99"],
        "drift_logp_max": scores["drift_logp_max"],
        "greedy_seconds": {"auto": round(ref_s, 2), "int8": round(q8_s, 2)},
        "dtype": args.dtype,
        "model": args.model or "SmolLM2-135M-Instruct (default)",
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
