"""Turn results.jsonl (from benchmarks/run_all.sh) into the ratios table of docs/benchmarks.md.

.venv/bin/python benchmarks/report.py /opt/peers/work/results.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]

    def pick(engine: str, dtype: str | None = None, n: int | None = None) -> dict | None:
        for r in rows:
            if not r["engine"].startswith(engine):
                continue
            if dtype is not None and r.get("dtype") != dtype:
                continue
            if n is not None and r.get("offline_num_requests") != n:
                continue
            return r
        return None

    print(
        "| engine | dtype | requests | offline out tok/s | prefill 512 tok/s | "
        "batch-1 decode tok/s | load s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r.get('dtype')} | {r.get('offline_num_requests')} | "
            f"{r.get('offline_output_tok_s')} | {r.get('prefill_512_tok_s')} | "
            f"{r.get('decode_b1_tok_s')} | {r.get('load_s')} | {r.get('peak_rss_mb')} |"
        )
    print()

    def ratio(a: dict | None, b: dict | None, key: str) -> str:
        if not a or not b or not a.get(key) or not b.get(key):
            return "n/a"
        return f"{a[key] / b[key]:.2f}x ({a[key]} vs {b[key]})"

    ours_bf16 = pick("pagedinfer", "bfloat16", 200)
    ours_fp32 = pick("pagedinfer", "float32", 200)
    hf_n = next(
        (r["offline_num_requests"] for r in rows if r["engine"].startswith("transformers")), None
    )
    ours_bf16_hf = pick("pagedinfer", "bfloat16", hf_n)
    ours_fp32_hf = pick("pagedinfer", "float32", hf_n)
    hf_bf16, hf_fp32 = pick("transformers", "bfloat16"), pick("transformers", "float32")
    vllm, llama = pick("vllm"), pick("llama")
    hf_best = max(
        (r for r in (hf_bf16, hf_fp32) if r), key=lambda r: r["offline_output_tok_s"], default=None
    )
    ours_best_hf = max(
        (r for r in (ours_bf16_hf, ours_fp32_hf) if r),
        key=lambda r: r["offline_output_tok_s"],
        default=None,
    )
    print("| goal | measured |")
    print("|---|---|")
    print(
        f"| offline vs HF (best dtype, same {hf_n} requests) >= 2x | "
        f"{ratio(ours_best_hf, hf_best, 'offline_output_tok_s')} |"
    )
    print(
        f"| offline vs vLLM CPU (200 requests) >= 0.8x | "
        f"{ratio(ours_bf16, vllm, 'offline_output_tok_s')} |"
    )
    print(f"| prefill 512 vs llama.cpp >= 2.5x | {ratio(ours_bf16, llama, 'prefill_512_tok_s')} |")
    print(f"| batch-1 decode vs HF, bf16 >= 3x | {ratio(ours_bf16, hf_bf16, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs HF, fp32 >= 3x | {ratio(ours_fp32, hf_fp32, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs llama.cpp | {ratio(ours_bf16, llama, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs vLLM CPU | {ratio(ours_bf16, vllm, 'decode_b1_tok_s')} |")


if __name__ == "__main__":
    main(sys.argv[1])
