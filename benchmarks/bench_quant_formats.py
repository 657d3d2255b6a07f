"""Every quantised format's product against the dense one, by rows and activation mode.

One [out, in] matrix per GGUF format (random codes and model-sized scales: the kernels' speed
does not depend on the values) through `QuantizedWeight` with float32 and with int8
activations, and the same matrix dequantised through the engine's dense `Linear` (with
`--dtype bfloat16`: bf16 activations and weights, prepacked for oneDNN as the engine does).
Prints GFLOP/s (2 * rows * out * in per call) and each path's ratio to dense: where the
quantised path stops winning is the tier's `quant_max_tokens` crossover.

Usage: .venv/bin/python benchmarks/bench_quant_formats.py [--shape 8192x2048]
    [--rows 1,8,64,512] [--formats Q4_1,Q8_0,Q5_0,Q4_K,Q5_K,Q6_K] [--seconds 1]
    [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedinfer.kernels.cpu import kernel_isa, load_cpu_kernels  # noqa: E402
from pagedinfer.model.linear import Linear  # noqa: E402
from pagedinfer.model.quant import RAW_FORMATS, QuantBlocks, QuantizedWeight, RawBlocks  # noqa: E402

# Byte offsets of each raw format's float16 d (and dmin): random bytes there could be NaN.
_HALVES = {"Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_matrix(kind: str, rows: int, cols: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    if kind in ("Q4_1", "Q8_0"):
        scale = rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16).astype(np.float32)
        if kind == "Q8_0":
            codes = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
            return QuantBlocks("Q8", codes, scale, None)
        codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        return QuantBlocks("Q4", codes, scale, -8 * scale)
    fmt = RAW_FORMATS[kind]
    nb = cols // fmt.block_size
    data = rng.integers(0, 256, (rows, nb, fmt.type_size), dtype=np.uint8)
    for at in _HALVES[kind]:
        half = rng.uniform(2e-4, 2e-3, (rows, nb)).astype(np.float16)
        data[..., at : at + 2] = half[..., None].view(np.uint8).reshape(rows, nb, 2)
    return RawBlocks(kind, data)


def seconds_per_call(fn: Callable[[], object], budget: float) -> float:
    fn()
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x2048", help="out x in features")
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--formats", default="Q4_1,Q8_0,Q5_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per figure")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels do not build here")
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    print(f"kernel tier {kernel_isa()}, {torch.get_num_threads()} threads, {out_f}x{in_f}, "
          f"{args.dtype} activations")  # fmt: skip
    print(f"| format | rows | float32 GFLOP/s | int8 GFLOP/s | dense {args.dtype} GFLOP/s | "
          "float32 / dense | int8 / dense |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for kind in args.formats.split(","):
        blocks = random_matrix(kind, out_f, in_f, rng)
        dense = Linear(in_f, out_f)
        dense.weight.data = torch.from_numpy(blocks.dequantize()).to(dtype)
        if dtype == torch.bfloat16:
            dense.prepack(int(args.rows.split(",")[-1]))
        exact = QuantizedWeight(blocks, kernels, "float32")
        int8 = QuantizedWeight(blocks, kernels, "int8")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f).to(dtype)
            flops = 2 * rows * out_f * in_f
            t_exact = seconds_per_call(lambda: exact(x), args.seconds)  # noqa: B023
            t_int8 = seconds_per_call(lambda: int8(x), args.seconds)  # noqa: B023
            t_dense = seconds_per_call(lambda: dense(x), args.seconds)  # noqa: B023
            rates = " | ".join(f"{flops / t / 1e9:.1f}" for t in (t_exact, t_int8, t_dense))
            ratios = f"{t_dense / t_exact:.2f}x | {t_dense / t_int8:.2f}x"
            print(f"| {kind} | {rows} | {rates} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
