"""Executors on this machine: the per-step cost of `MultiProcExecutor` against
`UniProcExecutor` at one rank, and the throughput of tensor, pipeline and data parallelism
against a single rank.

Part "overhead": two engines alive side by side, the same model in process ("uni") and in
one worker process behind the shared-memory queues ("mp", tensor_parallel_size 1); batch-1
greedy decode, the two alternating every round. Reported: median time per decode step
and the difference, i.e. what a step pays for crossing the queues (encode, shared-memory
copy, wake-up, decode, both ways).

Part "scaling": the serving stack (`AsyncLLM`: engine core process, executor, workers) for
each configuration, all alive, taking turns on the same workload (ShareGPT held-out
prompts, all submitted at once, `--max-tokens` greedy tokens each, ignore_eos). Reported:
median output tok/s and the ratio to TP=1.

Usage: .venv/bin/python benchmarks/bench_executor.py [--part overhead|scaling|both]
           [--configs tp1,tp3,pp2,dp2] [--num-prompts 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp3": {"tensor_parallel_size": 3},
    "pp2": {"pipeline_parallel_size": 2},
    "dp2": {"data_parallel_size": 2},
    "tp1-mp": {"distributed_executor_backend": "mp"},
}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 256 * 2**20,
        "log_stats_interval_s": 0,
    }


def overhead(args: argparse.Namespace) -> None:
    from pagedinfer import LLM, SamplingParams

    llms = {
        "uni": LLM(**engine_options(args)),
        "mp": LLM(distributed_executor_backend="mp", **engine_options(args)),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}]
    per_step: dict[str, list[float]] = {k: [] for k in llms}
    for llm in llms.values():  # warm-up
        llm.generate(prompt, params, use_tqdm=False)
    for r in range(args.rounds * 2):
        for name in llms if r % 2 == 0 else list(llms)[::-1]:
            start = time.perf_counter()
            llms[name].generate(prompt, params, use_tqdm=False)
            # One prefill step plus max_tokens - 1 decode steps; the prefill is the same in
            # both, so the difference per step is the executor's.
            per_step[name].append((time.perf_counter() - start) / args.max_tokens * 1e6)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    print(f"Command: `.venv/bin/python {' '.join(sys.argv)}` ({args.dtype}, "
          f"{os.cpu_count()} cores); batch 1, {args.max_tokens} tokens, "
          f"{args.rounds * 2} runs each\n")  # fmt: skip
    print("| executor | median µs per step |")
    print("|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.0f} |")
    print(f"\nMultiProcExecutor overhead per step: {med['mp'] - med['uni']:.0f} µs "
          f"({med['mp'] / med['uni']:.3f}x)\n")  # fmt: skip
    for llm in llms.values():
        llm.shutdown()


async def _run_batch(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> int:
    async def one(i: int, ids: list[int]) -> int:
        n = 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"{tag}-{i}"):
            n = len(out.outputs[0].token_ids)
        return n

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts)


async def scaling(args: argparse.Namespace) -> None:
    from bench_spec_decode import sharegpt_prompts

    from pagedinfer import SamplingParams
    from pagedinfer.engine.async_llm import AsyncLLM

    names = args.configs.split(",")
    engines = {n: AsyncLLM.from_options(**CONFIGS[n], **engine_options(args)) for n in names}
    prompts = sharegpt_prompts(engines[names[0]].tokenizer, args.num_prompts, args.dataset_path)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up (also fills each engine's prefix cache alike)
        await _run_batch(engines[n], prompts[:4], params, f"warm-{n}")
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            tokens = await _run_batch(engines[n], prompts, params, f"r{r}-{n}")
            rates[n].append(tokens / (time.perf_counter() - start))
    med = {n: statistics.median(v) for n, v in rates.items()}
    base = med[names[0]]
    print(f"Command: `.venv/bin/python {' '.join(sys.argv)}` ({args.dtype}, "
          f"{os.cpu_count()} cores); {args.num_prompts} ShareGPT prompts at once, "
          f"{args.max_tokens} tokens each, median of {args.rounds}\n")  # fmt: skip
    print(f"| config | output tok/s | ratio to {names[0]} |")
    print("|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.1f} | {med[n] / base:.2f}x |")
    for engine in engines.values():
        engine.shutdown()


def main() -> None:
    from bench_spec_decode import add_dataset_path_arg, checked_dataset_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["overhead", "scaling", "both"], default="both")
    parser.add_argument("--configs", default="tp1,tp3,pp2,dp2")
    add_dataset_path_arg(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.part in ("scaling", "both"):
        args.dataset_path = checked_dataset_path(parser, args.dataset_path)
    if args.part in ("overhead", "both"):
        overhead(args)
    if args.part in ("scaling", "both"):
        asyncio.run(scaling(args))


if __name__ == "__main__":
    main()
