"""Paged decode attention alone (`paged_decode_attention`, kernels/csrc/paged_attention_cpu.cpp):
achieved GB/s of K/V read per call, to set against the machine's DRAM read bandwidth
(benchmarks/ceilings.py).

Cases (SmolLM2's attention: 9 query heads, 3 KV heads, head_dim 64; or --heads/--kv-heads/
--head-dim): a batch of running requests with the given context lengths, their blocks
scattered over a cache larger than the last-level cache, as the engine's are. Bytes counted:
every K and V row each request attends to, once (the kernel's minimum); block tables are
redrawn between calls so each call reads from DRAM.

Where the blocks lie (--placement): "random" (any block anywhere: the worst case, the
default), "sequential" (each request's blocks consecutive, as a fresh prefill gets them
from an empty pool) or "interleaved" (block i of every request, then block i + 1: what
decoding many requests at once appends). --huge-pages asks Linux for 2 MiB pages for the
cache (madvise MADV_HUGEPAGE; the engine's cache takes what torch gives: 4 KiB pages where
transparent huge pages are "madvise", see docs/benchmarks.md for why it stays so).

--read-ceiling also times a plain read of the same blocks with the same threads (every
8-byte word of each K and V block summed, no arithmetic of attention: `paged_read` below),
alternated with the kernel: the ceiling of this access pattern, beside benchmarks/
ceilings.py's read of one contiguous buffer.

    .venv/bin/python benchmarks/bench_decode_attention.py [--dtype float32] \
        [--kv-cache-dtype int8] [--cases 1x1000,1x4000,1x16000,8x1000,200x300] \
        [--placement random] [--huge-pages] [--cache-mb 1024] [--read-ceiling] [--out a.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros, the 2 MiB-aligned part of its memory advised MADV_HUGEPAGE (Linux)
    before the zeros first touch it."""
    tensor = torch.empty(*shape, dtype=dtype)
    huge, nbytes = 2 << 20, tensor.numel() * tensor.element_size()
    start = -(-tensor.data_ptr() // huge) * huge
    end = (tensor.data_ptr() + nbytes) // huge * huge
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, end - start, 14) != 0:  # MADV_HUGEPAGE
            sys.exit(f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}")
    return tensor.zero_()


_READ_SOURCE = r"""
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

// Sums every 8-byte word of the first ctx positions of each request's K and V blocks
// (block ids from table [reqs, blocks]), the blocks shared out over the threads.
int64_t paged_read(torch::Tensor kc, torch::Tensor vc, torch::Tensor table, int64_t ctx) {
  const int64_t block_size = kc.size(1), nb = table.size(1), items = table.numel();
  const int64_t block_bytes = kc.stride(0) * kc.element_size();
  const int64_t row_bytes = kc.stride(1) * kc.element_size();
  const int32_t* ids = table.data_ptr<int32_t>();
  const char* k = static_cast<const char*>(kc.data_ptr());
  const char* v = static_cast<const char*>(vc.data_ptr());
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rows = std::min(block_size, ctx - i % nb * block_size);
      const int64_t words = rows * row_bytes / 8;
      const auto* pk = reinterpret_cast<const uint64_t*>(k + ids[i] * block_bytes);
      const auto* pv = reinterpret_cast<const uint64_t*>(v + ids[i] * block_bytes);
      for (int64_t w = 0; w + 8 <= words; w += 8)
        for (int l = 0; l < 8; ++l) acc[l] += pk[w + l] + pv[w + l];
    }
    uint64_t sum = 0;
    for (uint64_t a : acc) sum += a;
    total += sum;
  });
  return static_cast<int64_t>(total.load());
}
"""


def read_probe():
    """The compiled `paged_read` (torch's inline extension build, once per machine)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="bench_paged_read",
        cpp_sources=_READ_SOURCE,
        functions=["paged_read"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


@dataclass
class Case:
    """One case's inputs: the caches, the block tables to cycle through, the query."""

    kc: torch.Tensor
    vc: torch.Tensor
    tables: list[torch.Tensor]
    q: torch.Tensor
    lens: torch.Tensor
    moved: int  # bytes of K and V a call reads

    def attend(self, kernels, table: torch.Tensor) -> torch.Tensor:
        scale = self.q.shape[-1] ** -0.5
        q, kc, vc = self.q, self.kc, self.vc
        return kernels.paged_decode_attention(q, kc, vc, table, self.lens, scale, 0, 0.0)


def make_case(reqs: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, block_size: int = 16, kv_int8: bool = False,
              placement: str = "random", huge_pages: bool = False,
              cache_mb: int = 1024) -> Case:  # fmt: skip
    blocks_per_req = -(-ctx // block_size)
    fp32_block = block_size * kv_heads * head_dim * 4
    num_blocks = max(reqs * blocks_per_req, (cache_mb << 20) // fp32_block)
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def cache() -> torch.Tensor:
        values = torch.randn(*shape, generator=g).to(dtype)
        if kv_int8:  # rows of int8 codes and their scale (attention/kv_quant.py)
            from pagedinfer.attention.kv_quant import quantize_rows

            values = quantize_rows(values)
        if not huge_pages:
            return values
        return zeros_on_huge_pages(tuple(values.shape), values.dtype).copy_(values)

    kc, vc = cache(), cache()
    moved = 2 * reqs * ctx * kv_heads * kc.shape[-1] * kc.element_size()
    # Block tables drawn afresh, enough of them that the calls read ~512 MB between two
    # uses of one table: every call reads from DRAM, not from a cache the last call filled.
    used = reqs * blocks_per_req

    def table() -> torch.Tensor:
        if placement == "random":
            return torch.randperm(num_blocks, generator=g)[:used].view(reqs, -1).int()
        first = int(torch.randint(0, num_blocks - used + 1, (1,), generator=g))
        ids = torch.arange(first, first + used)
        if placement == "sequential":
            return ids.view(reqs, -1).int()
        return ids.view(blocks_per_req, reqs).t().contiguous().int()  # interleaved

    tables = [table() for _ in range(min(64, max(1, -(-(512 << 20) // moved))))]
    q = torch.randn(reqs, heads, head_dim, generator=g).to(dtype)
    lens = torch.full((reqs,), ctx, dtype=torch.int32)
    return Case(kc, vc, tables, q, lens, moved)


def measure(kernels, reqs: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype, block_size: int = 16, min_s: float = 1.0,
            kv_int8: bool = False, placement: str = "random",
            huge_pages: bool = False, cache_mb: int = 1024, probe=None) -> dict:  # fmt: skip
    case = make_case(reqs, ctx, heads, kv_heads, head_dim, dtype, block_size, kv_int8,
                     placement, huge_pages, cache_mb)  # fmt: skip
    tables, moved = case.tables, case.moved

    def attend(table: torch.Tensor) -> None:
        case.attend(kernels, table)

    def timed(fn, budget: float) -> float:  # seconds per call over >= budget and every table
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < budget or calls < len(tables):
            fn(tables[calls % len(tables)])
            calls += 1
        return (time.perf_counter() - start) / calls

    for table in tables:
        attend(table)
    row: dict = {"reqs": reqs, "ctx": ctx}
    if probe is None:
        seconds = timed(attend, min_s)
    else:  # alternated, three rounds each: the medians

        def read(table: torch.Tensor) -> None:
            probe.paged_read(case.kc, case.vc, table, ctx)

        pairs = [(timed(attend, min_s / 3), timed(read, min_s / 3)) for _ in range(3)]
        seconds = sorted(p[0] for p in pairs)[1]
        row["read_gb_s"] = round(moved / sorted(p[1] for p in pairs)[1] / 1e9, 2)
    row.update(ms=round(seconds * 1e3, 3), gb_s=round(moved / seconds / 1e9, 2))
    row["mb_read"] = round(moved / 1e6, 1)
    if "read_gb_s" in row:
        row["of_read"] = round(row["gb_s"] / row["read_gb_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cases", default="1x1000,1x4000,1x16000,8x1000,200x300")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="positions per cache block")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="auto: the cache in --dtype; int8: int8 rows (bytes counted as such)",
    )
    parser.add_argument(
        "--placement", default="random", choices=["random", "sequential", "interleaved"]
    )
    parser.add_argument("--huge-pages", action="store_true")
    parser.add_argument(
        "--read-ceiling", action="store_true",
        help="also time a plain read of the same blocks (alternated with the kernel)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-mb", type=int, default=1024,
        help="float32-equivalent MiB the cache spans (0: just the blocks the case reads, "
        "which then stay in the last-level cache when they fit)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.ceilings import cpu_facts
    from pagedinfer.kernels.cpu import kernel_isa, load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels cannot be built here")
    facts = {**cpu_facts(), "kernel_tier": kernel_isa(), "dtype": args.dtype,
             "kv_cache_dtype": args.kv_cache_dtype, "placement": args.placement,
             "block_size": args.block_size,
             "huge_pages": args.huge_pages, "cache_mb": args.cache_mb}  # fmt: skip
    print(json.dumps(facts))
    probe = read_probe() if args.read_ceiling else None
    rows = []
    for case in args.cases.split(","):
        reqs, ctx = (int(x) for x in case.split("x"))
        int8 = args.kv_cache_dtype == "int8"
        row = measure(kernels, reqs, ctx, args.heads, args.kv_heads, args.head_dim,
                      getattr(torch, args.dtype), block_size=args.block_size, kv_int8=int8,
                      placement=args.placement,
                      huge_pages=args.huge_pages, cache_mb=args.cache_mb,
                      probe=probe)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": facts, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
