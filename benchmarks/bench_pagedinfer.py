"""pagedinfer on the shared benchmark workload; prints one JSON line like the peer scripts.

    .venv/bin/python benchmarks/bench_pagedinfer.py --workload /opt/peers/work/workload.json \
        [--dtype bfloat16] [--num-requests 200] [--max-num-seqs 256]

Measures (see benchmarks/peers/common.py for the definitions shared with the peers):
load time, offline throughput of `LLM.generate` on the ShareGPT requests (ignore_eos, each
request generating its reference output length), 512-token prefill, batch-1 decode, peak RSS
and the resident memory beyond weights + KV cache.
"""

from __future__ import annotations

import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from common import (  # noqa: E402
    base_parser,
    emit,
    load_workload,
    log,
    long_context,
    parse_long_context,
    prefill_and_decode,
)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _max_model_len(args) -> int:
    """4,096, or room for the longest --long-context run."""
    if not args.long_context:
        return 4096
    contexts, prefill = parse_long_context(args.long_context)
    return max([*contexts, prefill]) + args.decode_tokens + 16


def main() -> None:
    parser = base_parser("pagedinfer offline benchmark")
    parser.add_argument("--model", default=None, help="model path or name (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--quant-max-tokens", type=int, default=None, help="engine default")
    parser.add_argument("--quant-activations", default="auto", choices=["auto", "float32", "int8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--block-size", type=int, default=None, help="engine default")
    args = parser.parse_args()
    workload = load_workload(args.workload, args.num_requests)

    import torch

    torch.set_num_threads(args.threads)
    from pagedinfer import LLM, SamplingParams
    from pagedinfer.kernels.cpu import kernel_isa

    rss_before = _rss_mb()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        log_stats_interval_s=0,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=_max_model_len(args),
        kv_cache_dtype=args.kv_cache_dtype,
        **({} if args.quant_max_tokens is None else {"quant_max_tokens": args.quant_max_tokens}),
        **({} if args.block_size is None else {"block_size": args.block_size}),
        quant_activations=args.quant_activations,
    )
    load_s = time.perf_counter() - start
    worker = llm.llm_engine.engine_core.executor.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    # The quantised copies for small steps (model/quant.py) count as weights too.
    quantized = [getattr(m, "quant", None) for m in worker.model.modules()]
    quantized.append(worker.model.lm_head_quant)
    weight_bytes += sum(q.nbytes for q in quantized if q is not None)
    kv_bytes = sum(t.numel() * t.element_size() for t in worker.runner.kv_caches)
    mib = 2**20
    log(f"loaded in {load_s:.2f} s; weights {weight_bytes / mib:.0f} MiB")
    log(f"KV cache {kv_bytes / mib:.0f} MiB")

    def generate(prompt_ids: list[int], n: int) -> object:
        # As the vLLM peer: a cold prefix cache, so repeated prompts never hit it.
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)

    def timed(prompt_ids: list[int], n: int) -> tuple[float, float]:
        """Seconds to the first and to the last of n greedy tokens (engine steps)."""
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine = llm.llm_engine
        start = time.perf_counter()
        engine.add_request("timed", {"prompt_token_ids": prompt_ids}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
        assert first is not None
        return first, time.perf_counter() - start

    header = {
        "engine": "pagedinfer",
        "model": os.path.basename(worker.config.model_config.model or "default"),
        "dtype": str(worker.dtype).removeprefix("torch."),
        "quant_activations": args.quant_activations,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": worker.config.cache_config.block_size,
        "kernel_tier": kernel_isa(),
        "threads": args.threads,
        "load_s": round(load_s, 2),
    }
    if args.long_context:
        result = dict(header)
        result.update(long_context(timed, workload, args.long_context, args.decode_tokens))
        emit(result)
        return

    reqs = workload["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs
    ]
    # Warm-up on a few requests (first-call allocations), then the timed run.
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts must not hit in the timed run
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(r["output_len"] for r in reqs), "ignore_eos: every length must be met"

    result = {
        **header,
        "offline_output_tok_s": round(num_out / elapsed, 1),
        "offline_total_tok_s": round(
            (num_out + sum(len(r["prompt_token_ids"]) for r in reqs)) / elapsed, 1
        ),
        "offline_num_requests": len(reqs),
        "offline_s": round(elapsed, 1),
    }
    result.update(prefill_and_decode(generate, workload, args.decode_tokens, args.repeats))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["peak_rss_mb"] = round(peak, 1)
    result["weights_mb"] = round(weight_bytes / 2**20, 1)
    result["kv_cache_mb"] = round(kv_bytes / 2**20, 1)
    result["rss_beyond_weights_kv_mb"] = round(peak - (weight_bytes + kv_bytes) / 2**20, 1)
    result["rss_before_load_mb"] = round(rss_before, 1)
    emit(result)


if __name__ == "__main__":
    main()
