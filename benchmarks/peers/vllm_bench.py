"""vLLM CPU peer (the system pagedinfer follows): offline LLM.generate on the shared token ids.

vLLM cannot read GGUF, so --model is the bf16 Hugging Face directory exported by
pagedinfer.model.loader.export_hf_dir (run_vllm.sh makes it). Every request is a
{"prompt_token_ids": ...} prompt with SamplingParams(temperature=0, max_tokens=output_len,
ignore_eos=True). One warm-up generate on a few requests, then the timed run. The prefix cache is
reset before every timed generate so repeated prompts (prefill/decode, warm-up) never hit it.
Needs the env run_vllm.sh sets (tcmalloc + libiomp5 preload, VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND):

    benchmarks/peers/run_vllm.sh [--num-requests N] [--enforce-eager]
"""

from __future__ import annotations

import os
import time

from common import base_parser, emit, load_workload, log, prefill_and_decode, reserve_stdout


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="/opt/peers/models/smollm2-135m-bf16", help="HF dir (bf16)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (starts faster)"
    )
    parser.add_argument("--warmup-requests", type=int, default=4)
    args = parser.parse_args()
    reserve_stdout()
    workload = load_workload(args.workload, args.num_requests)
    requests = workload["requests"]

    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        seed=0,
    )
    load_s = time.perf_counter() - start
    log(f"loaded in {load_s:.1f}s")

    def run(prompts: list[list[int]], lens: list[int]) -> list:
        llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [len(o.outputs[0].token_ids) for o in outs]
        assert got == lens, (got, lens)
        return outs

    prompts = [r["prompt_token_ids"] for r in requests]
    lens = [r["output_len"] for r in requests]
    run(prompts[: args.warmup_requests], lens[: args.warmup_requests])  # warm-up
    start = time.perf_counter()
    run(prompts, lens)
    offline_s = time.perf_counter() - start

    result = {
        "engine": f"vllm-cpu {vllm.__version__}",
        "dtype": args.dtype,
        "threads": args.threads,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "enforce_eager": args.enforce_eager,
        "load_s": round(load_s, 2),
        "offline_output_tok_s": round(sum(lens) / offline_s, 1),
        "offline_num_requests": len(requests),
        "offline_output_tokens": sum(lens),
        "offline_s": round(offline_s, 2),
    }
    result.update(
        prefill_and_decode(lambda p, n: run([p], [n]), workload, args.decode_tokens, args.repeats)
    )
    emit(result)


if __name__ == "__main__":
    main()
