"""Prefill attention over a paged cache, one layer: the paged kernel (`paged_attention`,
kernels/csrc/paged_attention_cpu.cpp: query tiles reading K/V in place) against the gather +
masked SDPA of `CpuSdpaBackend`, on the shapes of docs/benchmarks.md's AMX table (block 16,
SmolLM2's 9 query / 3 KV heads, head_dim 64, or --heads/--kv-heads/--head-dim).

Fresh prefills (nothing cached) are timed too, the kernel against SDPA over the step's own
K/V: these figures set `KERNEL_MAX_CONTEXT` (attention/cpu_sdpa.py), the context length up
to which `CpuPagedBackend` sends multi-row requests to the kernel. The cache is float32 (or
--dtype), or int8 rows (--kv-cache-dtype int8: the SDPA side then dequantises what it
gathers). Each case alternates the two paths, --rounds times; medians.

    .venv/bin/python benchmarks/bench_prefill_attention.py [--rounds 5] [--kv-cache-dtype int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, query lengths, context lengths): chunks over cached prefixes, then fresh prefills.
CASES = [
    ("31 chunks of 30 over a shared 1,024 prefix", [30] * 31, [1054] * 31),
    ("one 248-token chunk over 2,048 positions", [248], [2048]),
    ("one 512-token chunk over 1,536 cached (2,048)", [512], [2048]),
    ("8 decodes over 1,000 + a 64-token chunk over 2,000", [1] * 8 + [64], [1000] * 8 + [2000]),
    ("fresh 128-token prefill", [128], [128]),
    ("fresh 512-token prefill", [512], [512]),
    ("fresh 1,024-token prefill", [1024], [1024]),
    ("fresh 2,048-token prefill", [2048], [2048]),
    ("8 fresh 256-token prefills", [256] * 8, [256] * 8),
]


def _common(query_lens, seq_lens, block_size):
    from pagedinfer.attention.backend import CommonAttentionMetadata

    g = torch.Generator().manual_seed(0)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
    common = CommonAttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu=list(seq_lens),
        num_computed_tokens_cpu=[s - q for q, s in zip(query_lens, seq_lens)],
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table=table,
        slot_mapping=torch.cat(slots), block_size=block_size,
    )  # fmt: skip
    return common, num_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    from benchmarks.ceilings import cpu_facts
    from pagedinfer.attention.cpu_sdpa import CpuPagedBackend, CpuSdpaBackend
    from pagedinfer.attention.kv_quant import quantize_rows
    from pagedinfer.kernels.cpu import kernel_isa

    dtype = getattr(torch, args.dtype)
    facts = {**cpu_facts(), "kernel_tier": kernel_isa(), "dtype": args.dtype,
             "kv_cache_dtype": args.kv_cache_dtype, "threads": torch.get_num_threads()}  # fmt: skip
    print(json.dumps(facts))
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    paged = CpuPagedBackend(h, kvh, d, d**-0.5)
    sdpa = CpuSdpaBackend(h, kvh, d, d**-0.5)
    for name, query_lens, seq_lens in CASES:
        common, num_blocks = _common(query_lens, seq_lens, args.block_size)
        n = common.num_actual_tokens
        q = torch.randn(n, h, d).to(dtype)
        k, v = torch.randn(n, kvh, d).to(dtype), torch.randn(n, kvh, d).to(dtype)
        cache = torch.randn(2, num_blocks, args.block_size, kvh, d).to(dtype)
        if args.kv_cache_dtype == "int8":
            cache = quantize_rows(cache)
        bf16_kernel = (
            paged.prefill_kernel and dtype == torch.bfloat16 and args.kv_cache_dtype == "auto"
        )
        times = _time_case(paged, sdpa, common, q, k, v, cache, args.rounds, bf16_kernel)
        kern, ref = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        row = {
            "case": name,
            "kernel_ms": round(kern, 3),
            "gather_sdpa_ms": round(ref, 3),
            "speedup": round(ref / kern, 2),
            "kernel_range": [round(min(times["kernel"]), 3), round(max(times["kernel"]), 3)],
            "sdpa_range": [round(min(times["sdpa"]), 3), round(max(times["sdpa"]), 3)],
        }
        if "prefill_kernel" in times:
            pk = statistics.median(times["prefill_kernel"])
            row["prefill_kernel_ms"] = round(pk, 3)
            row["prefill_kernel_vs_kernel"] = round(kern / pk, 2)
        print(json.dumps(row), flush=True)


def _time_case(
    paged, sdpa, common, q, k, v, cache, rounds: int, with_prefill_kernel: bool
) -> dict[str, list[float]]:
    """ms per call of each path, `rounds` alternations of >= 0.3 s each."""
    fresh = common.seq_lens_cpu == [
        b - a for a, b in zip(common.query_start_loc_cpu, common.query_start_loc_cpu[1:])
    ]
    meta_paged, meta_sdpa = paged.build(common), sdpa.build(common)
    reqs = paged._requests(common, list(range(common.num_reqs)))
    out = torch.empty_like(q)
    kernel = paged.kernel

    def run_kernel() -> None:
        if fresh:  # the kernel on a fresh prefill (the backend would use SDPA)
            kernel.write_kv(cache, k, v, common.slot_mapping)
            kernel.paged_attention(
                out, q, cache[0], cache[1], reqs.block_table, reqs.q_start, reqs.q_end,
                reqs.seq_lens, paged.scale, 0, 0.0,
            )  # fmt: skip
        else:
            paged.forward(q, k, v, cache, meta_paged)

    def run_prefill_kernel() -> None:
        kernel.write_kv(cache, k, v, common.slot_mapping)
        kernel.paged_prefill_attention(
            out, q, cache[0], cache[1], reqs.block_table, reqs.q_start, reqs.q_end,
            reqs.seq_lens, paged.scale,
        )  # fmt: skip

    def run_sdpa() -> None:
        sdpa.forward(q, k, v, cache, meta_sdpa)

    paths = [("kernel", run_kernel), ("sdpa", run_sdpa)]
    # The bfloat16 prefill kernel (AVX-512-BF16 or AMX), on the multi-row requests only.
    if with_prefill_kernel and all(q1 - q0 > 1 for q0, q1 in zip(
        common.query_start_loc_cpu, common.query_start_loc_cpu[1:]
    )):  # fmt: skip
        paths.append(("prefill_kernel", run_prefill_kernel))
    times: dict[str, list[float]] = {label: [] for label, _ in paths}
    for _, fn in paths:
        fn()  # warm up
    for _ in range(rounds):
        for label, fn in paths:
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.3 or reps < 3:
                fn()
                reps += 1
            times[label].append((time.perf_counter() - start) / reps * 1e3)
    return times


if __name__ == "__main__":
    main()
