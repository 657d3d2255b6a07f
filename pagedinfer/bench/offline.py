"""`pagedinfer bench throughput` and `pagedinfer bench latency`: the engine in this process.

- throughput: the whole dataset submitted at once to `LLM.generate` (or, with
  `--async-engine`, to an `AsyncLLM` whose core runs in its own process); reports requests/s,
  total tokens/s and output tokens/s over the generation time (engine start-up excluded), with
  the generated tokens counted from the outputs.
- latency: one batch of random-token prompts generated with ignore_eos to a fixed length, timed
  end to end per iteration after warm-up iterations. Each iteration draws fresh prompts, so the
  prefix cache never turns a prefill into a cache hit.

`--seed` is the engine's seed option and seeds the dataset as well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

from pagedinfer.bench.datasets import (
    SampleRequest,
    add_dataset_args,
    allowed_token_ids,
    dataset_config,
)
from pagedinfer.bench.stats import LATENCY_PERCENTILES, latency_summary
from pagedinfer.engine.arg_utils import add_engine_args, engine_kwargs

__all__ = [
    "add_latency_args",
    "add_throughput_args",
    "run_latency",
    "run_throughput",
]


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="GGUF file or HF directory (default: SmolLM2-135M-Instruct).",
    )


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    _add_model_arg(parser)
    add_dataset_args(parser, with_seed=False)  # --seed is an engine option
    group = parser.add_argument_group("run options")
    group.add_argument(
        "--ignore-eos", action="store_true", help="Generate every request's full output length."
    )
    group.add_argument("--temperature", type=float, default=0.0, help="(default: 0.0, greedy)")
    group.add_argument(
        "--async-engine",
        action="store_true",
        help="Run through AsyncLLM (engine core in its own process) instead of LLM.",
    )
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_engine_args(parser)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    _add_model_arg(parser)
    group = parser.add_argument_group("run options")
    group.add_argument("--input-len", type=int, default=32, help="Prompt tokens (default: 32).")
    group.add_argument(
        "--output-len", type=int, default=128, help="Generated tokens (default: 128)."
    )
    group.add_argument("--batch-size", type=int, default=8, help="Prompts per batch (default: 8).")
    group.add_argument(
        "--num-iters-warmup", type=int, default=10, help="Untimed iterations (default: 10)."
    )
    group.add_argument("--num-iters", type=int, default=30, help="Timed iterations (default: 30).")
    group.add_argument("--output-json", default=None, help="Write the results to this file.")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Also run one iteration under torch.profiler and write a Chrome trace.",
    )
    group.add_argument(
        "--profile-result-dir",
        default="./pagedinfer_profile",
        help="Folder of the profiler trace (default: ./pagedinfer_profile).",
    )
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_engine_args(parser)


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    print(f"Results saved to {path}", file=sys.stderr)


def _engine_prompt(s: SampleRequest) -> Any:
    return s.prompt if isinstance(s.prompt, str) else {"prompt_token_ids": list(s.prompt)}


# ---------------------------------------------------------------------------------- throughput


async def _generate_async(engine: Any, prompts: list[Any], params: list[Any], bar: Any) -> list:
    async def one(i: int) -> Any:
        final = None
        async for out in engine.generate(prompts[i], params[i], f"bench-{i}"):
            final = out
        bar.update(1)
        return final

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def run_throughput(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagedinfer.bench.datasets import sample_from_args
    from pagedinfer.sampling_params import RequestOutputKind, SamplingParams

    if ns.num_prompts <= 0:
        print("error: --num-prompts must be > 0", file=sys.stderr)
        return 2
    kwargs = engine_kwargs(ns)
    engine: Any
    if ns.async_engine:
        from pagedinfer.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_options(**kwargs)
        tokenizer, vocab_size = engine.tokenizer, engine.input_processor.vocab_size
    else:
        from pagedinfer.entrypoints.llm import LLM

        engine = LLM(**kwargs)
        tokenizer = engine.get_tokenizer()
        vocab_size = engine.llm_engine.input_processor.vocab_size
    try:
        try:
            samples = sample_from_args(ns, tokenizer, vocab_size)
        except (OSError, ValueError) as exc:
            print(f"error: dataset: {exc}", file=sys.stderr)
            return 2
        prompts = [_engine_prompt(s) for s in samples]
        params = [
            SamplingParams(
                max_tokens=s.expected_output_len,
                temperature=ns.temperature,
                ignore_eos=ns.ignore_eos,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            for s in samples
        ]
        try:
            start = time.perf_counter()
            if ns.async_engine:
                bar = tqdm(total=len(prompts), desc="Requests", disable=ns.disable_tqdm)
                outputs = asyncio.run(_generate_async(engine, prompts, params, bar))
                bar.close()
            else:
                outputs = engine.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
            elapsed = time.perf_counter() - start
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    finally:
        if ns.async_engine:
            engine.shutdown()

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "expected_output_tokens": sum(s.expected_output_len for s in samples),
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s\n"
        f"Elapsed: {elapsed:.2f} s for {len(outputs)} requests "
        f"({prompt_tokens} prompt + {output_tokens} output tokens)",
        flush=True,
    )
    if ns.output_json:
        config = {
            "model": ns.model,
            "engine": "AsyncLLM" if ns.async_engine else "LLM",
            **dataset_config(ns),
            "ignore_eos": ns.ignore_eos,
            "temperature": ns.temperature,
            "engine_options": {k: v for k, v in kwargs.items() if k != "model"},
        }
        _write_json(ns.output_json, {**result, "config": config})
    return 0


# ------------------------------------------------------------------------------------ latency


def run_latency(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagedinfer.entrypoints.llm import LLM
    from pagedinfer.sampling_params import SamplingParams

    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    if ns.num_iters_warmup < 0:
        print("error: --num-iters-warmup must be >= 0", file=sys.stderr)
        return 2
    kwargs = engine_kwargs(ns)
    llm = LLM(**kwargs)
    allowed = allowed_token_ids(llm.get_tokenizer(), llm.llm_engine.input_processor.vocab_size)
    rng = np.random.default_rng(ns.seed)
    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)

    def batch() -> list[Any]:
        ids = rng.choice(allowed, size=(ns.batch_size, ns.input_len))
        return [{"prompt_token_ids": row.tolist()} for row in ids]

    def run_once() -> float:
        prompts = batch()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        got = [len(o.outputs[0].token_ids) for o in outs]
        if any(n != ns.output_len for n in got):
            raise RuntimeError(f"expected {ns.output_len} tokens per prompt, got {got}")
        return elapsed

    try:
        for _ in tqdm(
            range(ns.num_iters_warmup), desc="Warm-up iterations", disable=ns.disable_tqdm
        ):
            run_once()
        if ns.profile:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(ns.profile_result_dir, exist_ok=True)
            trace = os.path.join(
                ns.profile_result_dir, f"latency-{time.strftime('%Y%m%d-%H%M%S')}.trace.json"
            )
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                run_once()
            prof.export_chrome_trace(trace)
            print(f"Profiler trace (one iteration) written to {trace}", file=sys.stderr)
        latencies = [
            run_once()
            for _ in tqdm(range(ns.num_iters), desc="Timed iterations", disable=ns.disable_tqdm)
        ]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    summary = latency_summary(latencies)
    lines = [f"Avg latency: {summary['avg_latency']:.4f} seconds"]
    lines += [
        f"{p}% percentile latency: {summary['percentiles'][str(p)]:.4f} seconds"
        for p in LATENCY_PERCENTILES
    ]
    print("\n".join(lines), flush=True)
    if ns.output_json:
        config = {
            "model": ns.model,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "batch_size": ns.batch_size,
            "num_iters_warmup": ns.num_iters_warmup,
            "num_iters": ns.num_iters,
            "engine_options": {k: v for k, v in kwargs.items() if k != "model"},
        }
        _write_json(ns.output_json, {**summary, "config": config})
    return 0
