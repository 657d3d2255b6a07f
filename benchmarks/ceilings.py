"""What this machine allows: memory bandwidth and GEMM peaks, so that every speed figure can be
stated as a fraction of its ceiling (#23).

- DRAM bandwidth: read (sum of a buffer far larger than the caches) and copy (read + write,
  counted as 2 bytes moved per byte copied), with torch's threads and with one thread.
- GEMM peaks through torch: fp32 and bf16 `torch.mm`, int8 `torch._int_mm` (int32 out),
  at a large square shape (compute bound) and one-row products against a 4096x4096 weight
  (memory bound: reported as GB/s of weight read).
- pagedinfer's own quantised matmul (`QuantizedWeight`, Q4_1 and Q8_0 codes, the C++
  kernel) at 1 and 8 rows against a weight larger than the last-level cache: GB/s of
  weight read, the ceiling for batch-1 decode.

Prints the CPU model, its vector extensions, and a table; `--out` writes it as JSON.

    .venv/bin/python benchmarks/ceilings.py [--size 2048] [--buffer-mb 1024] [--out c.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
         "amx_bf16", "amx_int8", "asimd", "sve")  # fmt: skip


def cpu_facts() -> dict[str, object]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "flags": [f for f in FLAGS if f in flags],
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__}  # fmt: skip


def best_seconds(fn: Callable[[], object], repeats: int, min_s: float = 0.2) -> float:
    """The fastest of `repeats` timed calls (after one warm-up), each call repeated until
    it has run `min_s` in all (for tiny shapes)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_s / once / repeats))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def bandwidth(buffer_mb: int, repeats: int) -> list[tuple[str, float, str]]:
    n = buffer_mb * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    rows = []
    all_threads = torch.get_num_threads()
    for threads in dict.fromkeys((all_threads, 1)):
        torch.set_num_threads(threads)
        read = best_seconds(lambda: src.sum(), repeats)
        copy = best_seconds(lambda: dst.copy_(src), repeats)
        rows.append((f"DRAM read, {threads} thread(s)", src.nbytes / read / 1e9, "GB/s"))
        rows.append((f"DRAM copy, {threads} thread(s)", 2 * src.nbytes / copy / 1e9, "GB/s"))
    torch.set_num_threads(all_threads)
    return rows


def gemms(size: int, repeats: int) -> list[tuple[str, float, str]]:
    rows = []
    flops = 2 * size**3
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        t = best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats)
        rows.append((f"torch.mm {str(dtype)[6:]} {size}^3", flops / t / 1e9, "GFLOP/s"))
    a8 = torch.randint(-128, 127, (size, size), dtype=torch.int8)
    b8 = torch.randint(-128, 127, (size, size), dtype=torch.int8)
    try:
        t = best_seconds(lambda: torch._int_mm(a8, b8), repeats)
        rows.append((f"torch._int_mm int8 {size}^3", flops / t / 1e9, "GOP/s"))
    except RuntimeError as exc:
        rows.append((f"torch._int_mm int8: {str(exc).splitlines()[0][:60]}", float("nan"), ""))
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(4096, 4096, dtype=dtype)
        x = torch.randn(1, 4096, dtype=dtype)
        t = best_seconds(lambda w=w, x=x: torch.mm(x, w.t()), repeats)
        rows.append((f"torch.mm {str(dtype)[6:]} 1x4096 @ 4096x4096", w.nbytes / t / 1e9,
                     "GB/s of weight"))  # fmt: skip
    return rows


def quantised(repeats: int) -> list[tuple[str, float, str]]:
    from pagedinfer.kernels.cpu import load_cpu_kernels
    from pagedinfer.model.quant import QuantBlocks, QuantizedWeight, quantize_q8_0

    kernels = load_cpu_kernels()
    if kernels is None:
        return [("pagedinfer quantised matmul: the C++ kernels do not build here", float("nan"),
                 "")]  # fmt: skip
    rng = np.random.default_rng(0)
    out_f, in_f = 16384, 4096  # Q4_1: 36 MB, Q8_0: 71 MB, past the last-level cache
    codes = rng.integers(0, 256, (out_f, in_f // 2), dtype=np.uint8)
    scale = rng.random((out_f, in_f // 32), dtype=np.float32) * 0.01
    weights = {
        "Q4_1": QuantizedWeight(QuantBlocks("Q4", codes, scale, -8 * scale), kernels),
        "Q8_0": QuantizedWeight(quantize_q8_0(torch.randn(out_f, in_f) * 0.02), kernels),
    }
    rows = []
    for name, w in weights.items():
        for n in (1, 8):
            x = torch.randn(n, in_f, dtype=torch.bfloat16)
            t = best_seconds(lambda w=w, x=x: w(x), repeats)
            rows.append((f"pagedinfer {name} matmul, {n} row(s), {w.nbytes / 2**20:.0f} MB",
                         w.nbytes / t / 1e9, "GB/s of weight"))  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=2048, help="square GEMM size")
    ap.add_argument("--buffer-mb", type=int, default=1024, help="bandwidth buffer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    facts = cpu_facts()
    print(f"cpu: {facts['cpu']}; {facts['cores']} cores; flags: {' '.join(facts['flags'])}; "
          f"torch {facts['torch']}, {facts['torch_threads']} threads")  # fmt: skip
    rows = bandwidth(args.buffer_mb, args.repeats) + gemms(args.size, args.repeats)
    rows += quantised(args.repeats)
    print("| what | figure | unit |\n|---|---|---|")
    for what, value, unit in rows:
        print(f"| {what} | {value:.1f} | {unit} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**facts, "rows": [list(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
