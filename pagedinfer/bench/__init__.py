"""`pagedinfer bench`: benchmarks as a command, like `vllm bench`.

- `serve`: a load-testing client of a running `pagedinfer serve` (TTFT, TPOT, ITL, E2EL,
  throughput, goodput);
- `throughput`: the whole dataset through the engine in this process (offline throughput);
- `latency`: end-to-end latency of one fixed-size batch, repeated.

Wired into the CLI by `add_bench_parser(subparsers)` and `run_bench(ns)`.
"""

from __future__ import annotations

import argparse

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench {serve,throughput,latency}` to the `pagedinfer` sub-commands."""
    from pagedinfer.bench.offline import add_latency_args, add_throughput_args
    from pagedinfer.bench.serve import add_serve_args

    bench = subparsers.add_parser(
        "bench", help="Benchmarks: serve (online, against a server), throughput, latency."
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="Load-test a running OpenAI-compatible server (pagedinfer serve).",
        description="Streams requests to a running server and reports TTFT, TPOT, ITL, E2EL, "
        "throughput and goodput. Exit status: 0 if any request succeeded, 1 if all failed, "
        "2 if the run could not start.",
    )
    add_serve_args(serve)
    throughput = kinds.add_parser(
        "throughput",
        help="Offline throughput: the whole dataset through the engine at once.",
        description="Submits every request at once to LLM.generate (or AsyncLLM with "
        "--async-engine) and reports requests/s, total tokens/s and output tokens/s.",
    )
    add_throughput_args(throughput)
    latency = kinds.add_parser(
        "latency",
        help="End-to-end latency of one batch of random prompts, repeated.",
        description="Times one batch of random-token prompts generated to a fixed length "
        "(ignore_eos), per iteration, after warm-up iterations.",
    )
    add_latency_args(latency)
    return bench


def run_bench(ns: argparse.Namespace) -> int:
    if ns.bench_command == "serve":
        from pagedinfer.bench.serve import run_serve

        return run_serve(ns)
    if ns.bench_command == "throughput":
        from pagedinfer.bench.offline import run_throughput

        return run_throughput(ns)
    if ns.bench_command == "latency":
        from pagedinfer.bench.offline import run_latency

        return run_latency(ns)
    raise ValueError(f"unknown bench command {ns.bench_command!r}")
