"""Two builds of the paged decode kernel in one process, on the same data, alternated: the
A/B for a change to kernels/csrc/paged_attention_cpu.cpp on a noisy machine.

Each checkout (a directory: this repository, or a `git worktree` of another commit) builds
its own kernel module (the module's name is a digest of its sources, so both load side by
side). For each case both modules attend over the same cache and the same block tables
(bench_decode_attention.py's `make_case`: blocks at random in a cache far larger than the
last-level cache, tables redrawn between calls), `--rounds` times each, A then B then B
then A...; the medians and the range are printed with B / A, and the largest difference
between the two outputs.

    git worktree add /tmp/base HEAD
    .venv/bin/python benchmarks/ab_decode_attention.py /tmp/base . \\
        [--cases 200x300,1x4000] [--heads 32 --kv-heads 8] [--dtype bfloat16] [--cache-mb 0]

Threads: torch's (OMP_NUM_THREADS=1 for one core). --cache-mb 0 keeps the blocks of a small
case in the last-level cache (the kernel's arithmetic alone).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from types import ModuleType

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_decode_attention import make_case  # noqa: E402

_LOAD = "from pagedinfer.kernels import cpu; print(cpu.load_cpu_kernels().__file__)"


def load_build(checkout: str) -> ModuleType:
    """The kernel module of `checkout`, built there (in a subprocess, with its sources) and
    loaded here under its own name."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], cwd=checkout, capture_output=True, text=True, check=True
    )
    path = out.stdout.strip().splitlines()[-1]
    name = os.path.basename(path).split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def compare(builds: list[ModuleType], reqs: int, ctx: int, args: argparse.Namespace) -> str:
    case = make_case(reqs, ctx, args.heads, args.kv_heads, args.head_dim,
                     getattr(torch, args.dtype), args.block_size,
                     cache_mb=args.cache_mb)  # fmt: skip
    a, b = (case.attend(m, case.tables[0]).float() for m in builds)
    diff = (a - b).abs().max().item()
    rates: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.seconds or calls < len(case.tables):
                case.attend(builds[i], case.tables[calls % len(case.tables)])
                calls += 1
            rates[i].append(case.moved * calls / (time.perf_counter() - start) / 1e9)
    ma, mb = (statistics.median(x) for x in rates)
    ranges = [f"{min(x):.1f}-{max(x):.1f}" for x in rates]
    return (
        f"{reqs}x{ctx}: A {ma:.1f} GB/s [{ranges[0]}]  B {mb:.1f} [{ranges[1]}]  "
        f"B/A {mb / ma:.2f}  max |A - B| {diff:.3g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="checkout A (the baseline)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("--cases", default="200x300,1x4000")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--cache-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.3, help="per build and round")
    args = parser.parse_args()
    builds = [load_build(args.a), load_build(args.b)]
    for case in args.cases.split(","):
        reqs, ctx = (int(x) for x in case.split("x"))
        print(compare(builds, reqs, ctx, args), flush=True)


if __name__ == "__main__":
    main()
