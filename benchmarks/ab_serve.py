"""Two checkouts' `pagedinfer serve`, alternated on the same requests: the A/B for a change
to the server or the scheduler on a noisy machine.

Each checkout (a directory: this repository, or a `git worktree` of another commit) runs
its own server (`python -m pagedinfer serve` with the checkout as the working directory, so
its own package is imported), with its own defaults. For each of `--rounds` rounds, A then
B (B then A on odd rounds), each server takes:
- `--num-prompts` ShareGPT requests at once (`pagedinfer bench serve`, rate inf,
  `--ignore-eos`): output tok/s, mean TTFT and ITL;
- 16 requests one at a time (`--max-concurrency 1`): mean TTFT and ITL.
Medians over rounds and B / A are printed.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_serve.py /tmp/base . [--rounds 2] [--num-prompts 200]

One checkout under two settings: `ab_serve.py . . --a-flags '--step-latency-target-ms 0'`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_disagg import Proc  # noqa: E402
from bench_serving import _bench_serve  # noqa: E402
from bench_spec_decode import add_dataset_path_arg, checked_dataset_path  # noqa: E402

METRICS = ("sat_out_tok_s", "sat_ttft_ms", "sat_itl_ms", "one_ttft_ms", "one_itl_ms")


def measure(
    checkout: str, flags: list[str], sharegpt: list[str], num_prompts: int
) -> dict[str, float]:
    here = os.getcwd()
    os.chdir(checkout)  # `python -m pagedinfer` imports the checkout's own package
    try:
        proc = Proc("serve", "--log-stats-interval-s", "0", *flags)
    finally:
        os.chdir(here)
    try:
        _bench_serve(proc.base, [*sharegpt, "--num-prompts", "4"], [])  # warm-up
        sat = _bench_serve(proc.base, [*sharegpt, "--num-prompts", str(num_prompts)], [])
        one = _bench_serve(proc.base, [*sharegpt, "--num-prompts", "16", "--seed", "1"],
                           ["--max-concurrency", "1"])  # fmt: skip
    finally:
        proc.stop()
    return {
        "sat_out_tok_s": sat["output_throughput"],
        "sat_ttft_ms": sat["mean_ttft_ms"],
        "sat_itl_ms": sat["mean_itl_ms"],
        "one_ttft_ms": one["mean_ttft_ms"],
        "one_itl_ms": one["mean_itl_ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="checkout A (the baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument(
        "--a-flags", default="", help="server flags for A, e.g. '--step-latency-target-ms 0'"
    )
    ap.add_argument("--b-flags", default="", help="server flags for B")
    add_dataset_path_arg(ap)
    args = ap.parse_args()
    sharegpt = ["--dataset-name", "sharegpt",
                "--dataset-path", checked_dataset_path(ap, args.dataset_path)]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = [("A", args.a, args.a_flags), ("B", args.b, args.b_flags)]
        for name, checkout, flags in order if r % 2 == 0 else order[::-1]:
            runs[name].append(measure(os.path.abspath(checkout), shlex.split(flags), sharegpt,
                                      args.num_prompts))  # fmt: skip
            print(name, r, {k: round(v, 1) for k, v in runs[name][-1].items()}, flush=True)
    print("\n| metric | A | B | B / A |\n|---|---|---|---|")
    for metric in METRICS:
        a = statistics.median(x[metric] for x in runs["A"])
        b = statistics.median(x[metric] for x in runs["B"])
        print(f"| {metric} | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
