"""Does a long prompt stall the streams? One `pagedinfer serve`, `--streams` streams of
`--stream-tokens` tokens, and `--long` prompts of `--long-tokens` tokens arriving one every
`--long-interval-s` seconds (the workload of `bench_disagg.py`); measured on the client: the
streams' worst gap between tokens, their p99 and p50, and the long prompts' time to first
token. Each `--targets` value of `--step-latency-target-ms` (0: a fixed budget of
`--max-num-batched-tokens`, vLLM's behaviour) is its own server; they alternate for
`--rounds` rounds and the table gives medians over rounds. With `--saturation N`, each
server then also takes N ShareGPT requests at once (`pagedinfer bench serve`, rate inf):
what the target costs in throughput and ITL when every step has decodes.

Usage: .venv/bin/python benchmarks/bench_long_prompt_stall.py [--rounds 2] [--targets 0,250]
           [--streams 1] [--stream-tokens 300] [--long 1] [--long-tokens 8000]
           [--saturation 200] [--dataset-path sharegpt.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_disagg import Proc, workload  # noqa: E402  (the same client and workload)
from bench_serving import _bench_serve  # noqa: E402
from bench_spec_decode import add_dataset_path_arg, checked_dataset_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--targets", default="0,250", help="step latency targets (ms) to compare")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--long", type=int, default=1)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--long-max-tokens", type=int, default=1)
    ap.add_argument("--long-interval-s", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--saturation", type=int, default=0, help="ShareGPT requests at once")
    add_dataset_path_arg(ap)
    args = ap.parse_args()
    sharegpt = []
    if args.saturation:
        sharegpt = ["--dataset-name", "sharegpt", "--num-prompts", str(args.saturation),
                    "--dataset-path", checked_dataset_path(ap, args.dataset_path)]  # fmt: skip
    engine = [
        "--dtype", args.dtype, "--max-model-len", str(args.long_tokens + 192),
        "--kv-cache-memory-bytes", str(512 << 20), "--log-stats-interval-s", "0",
        "--num-threads", str(args.threads),
    ]  # fmt: skip
    targets = [float(t) for t in args.targets.split(",")]
    results: dict[float, list[dict[str, float]]] = {t: [] for t in targets}
    for r in range(args.rounds):
        for target in targets:
            proc = Proc("serve", *engine, "--step-latency-target-ms", str(target))
            try:
                res = asyncio.run(workload(proc.base, args, seed=r))
                if sharegpt:
                    sat = _bench_serve(proc.base, sharegpt, [])
                    res["sat_out_tok_s"] = sat["output_throughput"]
                    res["sat_itl_mean_ms"] = sat["mean_itl_ms"]
                    res["sat_ttft_mean_s"] = sat["mean_ttft_ms"] / 1e3
            finally:
                proc.stop()
            results[target].append(res)
            print(target, r, {k: round(v, 2) for k, v in res.items()}, flush=True)
    sat_head = " saturation out tok/s | ITL mean ms | TTFT mean s |" if sharegpt else ""
    print(
        f"\n| step latency target | stream gap max ms | p99 ms | p50 ms | long TTFT s |{sat_head}"
        "\n|---|---|---|---|---|" + ("---|---|---|" if sharegpt else "")
    )
    for target, runs in results.items():
        m = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        name = "off (fixed budget)" if target == 0 else f"{target:g} ms"
        sat = (f" {m['sat_out_tok_s']:.1f} | {m['sat_itl_mean_ms']:.1f} | "
               f"{m['sat_ttft_mean_s']:.2f} |") if sharegpt else ""  # fmt: skip
        print(f"| {name} | {m['itl_max_ms']:.0f} | {m['itl_p99_ms']:.0f} | "
              f"{m['itl_p50_ms']:.1f} | {m['long_ttft_median_s']:.2f} |{sat}")  # fmt: skip


if __name__ == "__main__":
    main()
