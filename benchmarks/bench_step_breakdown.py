"""Where a batch-1 decode token's time goes: per-token milliseconds of the engine step, the
model's forward, its layers and their parts, and of each C++ kernel entry point. With
`--prefill N`: the same for a prefill of N tokens (to the first token; the prefix cache
reset before each of `--repeats`), per prefill.

Wraps (in this process only) the C++ kernel calls of the loaded model and the forward of
its modules with timers, decodes one request greedily, and prints the totals per generated
token. The timers add ~1 us per wrapped call, so the parts sum to a little more than an
unwrapped run; run without `--breakdown` for the plain tok/s.

    .venv/bin/python benchmarks/bench_step_breakdown.py [--model GGUF] [--tokens 256] \
        [--quant-activations int8] [--breakdown | --no-breakdown] [--prefill 512 --repeats 10]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_totals: collections.Counter[str] = collections.Counter()
_calls: collections.Counter[str] = collections.Counter()


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[label] += time.perf_counter() - start
            _calls[label] += 1

    return run


class _TimedKernels:
    """A kernel module whose every function is timed under its own name."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return _timed(name, getattr(self._module, name))


def _instrument(llm: Any) -> None:
    from pagedinfer.attention.cpu_sdpa import CpuPagedBackend
    from pagedinfer.engine.core import EngineCore
    from pagedinfer.model import linear, llama
    from pagedinfer.worker.model_runner import ModelRunner

    for cls, name, label in (
        (EngineCore, "step", "engine step"),
        (ModelRunner, "execute_model", "runner.execute_model"),
        (ModelRunner, "sample_tokens", "runner.sample_tokens"),
        (llama.LlamaForCausalLM, "forward", "model forward"),
        (llama.LlamaForCausalLM, "compute_logits", "compute_logits (LM head)"),
        (llama.LlamaDecoderLayer, "forward", "decoder layer"),
        (llama.LlamaAttention, "forward", "attention block"),
        (llama.LlamaMLP, "forward", "MLP block"),
        (llama.RMSNorm, "forward", "RMSNorm module"),
        (linear.Linear, "forward", "Linear module"),
        (CpuPagedBackend, "forward", "attention backend"),
    ):
        setattr(cls, name, _timed(label, getattr(cls, name)))
    model = llm.llm_engine.engine_core.executor.worker.model
    for module in model.modules():
        if getattr(module, "ops", None) is not None:
            module.ops = _TimedKernels(module.ops)
        quant = getattr(module, "quant", None)
        parts = getattr(quant, "parts", None) or ([quant] if quant is not None else [])
        for part in parts:
            part._fn = _timed(part._fn.__name__, part._fn)
    if model.lm_head_quant is not None:
        head = model.lm_head_quant
        head._fn = _timed(head._fn.__name__ + " (LM head)", head._fn)
    for obj in gc.get_objects():
        if isinstance(obj, CpuPagedBackend):
            obj.kernel = _TimedKernels(obj.kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quant-activations", default="auto")
    parser.add_argument(
        "--quant-max-tokens", type=int, default=None, help="default: the tier's choice"
    )
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefill", type=int, default=0, help="time prefills of this length")
    parser.add_argument("--repeats", type=int, default=10, help="prefills timed (--prefill)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from pagedinfer import LLM, SamplingParams

    llm = LLM(
        args.model,
        log_stats_interval_s=0,
        quant_activations=args.quant_activations,
        quant_max_tokens=args.quant_max_tokens,
    )
    if args.prefill:
        unit, n = "prefill", args.repeats
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompt = {"prompt_token_ids": [100 + (i * 7919) % 30000 for i in range(args.prefill)]}
    else:
        unit, n = "token", args.tokens
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(100, 120))}

    def run() -> None:
        for _ in range(args.repeats if args.prefill else 1):
            llm.reset_prefix_cache()  # every prefill computes all its tokens
            llm.generate(prompt, params, use_tqdm=False)

    run()  # warm-up
    if args.breakdown:
        _instrument(llm)
    _totals.clear()
    _calls.clear()
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    if args.prefill:
        rate = args.prefill * n / elapsed
        print(f"{rate:.1f} prompt tok/s, {elapsed / n * 1e3:.2f} ms per prefill")
    else:
        print(f"{n / elapsed:.1f} tok/s, {elapsed / n * 1e3:.2f} ms per token")
    if args.breakdown:
        print(f"| part | ms per {unit} | calls per {unit} | us per call |")
        print("|---|---|---|---|")
        for label, total in _totals.most_common():
            calls = _calls[label]
            print(
                f"| {label} | {total / n * 1e3:.3f} | {calls / n:.1f} | {total / calls * 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
