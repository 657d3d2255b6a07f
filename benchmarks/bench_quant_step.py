"""The quantised matmuls of one decode step, in isolation: time vs rows, with the weights
hot in the cache and after evicting them (what a real step sees in between).

The default model's shapes: 30 layers of Q4_1 matrices (fused q/k/v 960x576, o 576x576,
fused gate/up 3072x576, down 576x1536) and the Q8_0 LM head (49152x576), 94 MB in all,
called back to back through `QuantizedWeight` as the model calls them. The codes are
random (the kernel's speed does not depend on the values).

Usage: .venv/bin/python benchmarks/bench_quant_step.py [--rows 1,2,4,8] [--evict-mb 600]
    [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedinfer.kernels.cpu import load_cpu_kernels  # noqa: E402
from pagedinfer.model.quant import QuantBlocks, QuantizedWeight, quantize_q8_0  # noqa: E402


def q4_blocks(rng: np.random.Generator, rows: int, cols: int) -> QuantBlocks:
    groups = cols // 32
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = rng.random((rows, groups), dtype=np.float32) * 0.01
    return QuantBlocks("Q4", codes, scale, -8 * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--evict-mb", type=int, default=600)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels do not build here")
    rng = np.random.default_rng(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    mats = [QuantizedWeight(q4_blocks(rng, o, i), kernels) for o, i in shapes]
    mats.append(QuantizedWeight(quantize_q8_0(torch.randn(49152, 576) * 0.02), kernels))
    total_mb = sum(m.nbytes for m in mats) / 2**20
    evict = torch.zeros(args.evict_mb * 2**20 // 4)
    dtype = getattr(torch, args.dtype)
    print(f"{len(mats)} matrices, {total_mb:.0f} MB; {args.dtype} activations; ms/step (median)")
    print("| rows | weights hot | after evicting the cache |")
    print("|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}

        def step(xs: dict[int, torch.Tensor] = xs) -> float:
            start = time.perf_counter()
            for m in mats:
                m(xs[m.in_features])
            return time.perf_counter() - start

        step()
        hot = [step() for _ in range(args.passes)]
        cold = []
        for _ in range(args.passes):
            evict += 1.0  # streams the buffer through the caches
            cold.append(step())
        print(f"| {rows} | {statistics.median(hot) * 1e3:.2f} | "
              f"{statistics.median(cold) * 1e3:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
