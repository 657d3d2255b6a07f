"""The server against the offline engine on the same prompts, and its latency under load.

    .venv/bin/python benchmarks/bench_serving.py [--num-prompts 200] [--dtype bfloat16] \
        [--repeats 2] [--clients 1,4,16] [--dataset-path sharegpt.json] [--out serving.json]

Per round (the order of the two flips each round; every engine in its own process, one at a
time):
- offline: `pagedinfer bench throughput --dataset-name sharegpt --num-prompts N --ignore-eos`
  (`LLM.generate`, every request submitted at once);
- server at saturation: `pagedinfer serve` with the same engine flags, then
  `pagedinfer bench serve` with the same dataset, seed and N, request rate inf, no
  concurrency cap;
the ratio is server output tok/s / offline output tok/s (goal >= 0.9).
Then, on one server, TTFT and ITL at 1, 4 and 16 concurrent clients
(`bench serve --max-concurrency C --num-prompts 4*C`, at least 8).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGEDINFER = [sys.executable, "-m", "pagedinfer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Server:
    def __init__(self, engine_flags: list[str]) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [*PAGEDINFER, "serve", "--port", str(self.port), *engine_flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during startup")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _bench_serve(base: str, dataset: list[str], extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [*PAGEDINFER, "bench", "serve", "--base-url", base, *dataset, "--ignore-eos",
             "--save-result", "--result-dir", tmp, "--result-filename", "r.json",
             "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,99", *extra],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        with open(os.path.join(tmp, "r.json")) as f:
            return json.load(f)


def _offline(dataset: list[str], engine_flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        subprocess.run(
            [*PAGEDINFER, "bench", "throughput", *dataset, "--ignore-eos", "--disable-tqdm",
             "--output-json", out, *engine_flags],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        with open(out) as f:
            return json.load(f)


def main() -> None:
    from bench_spec_decode import add_dataset_path_arg, checked_dataset_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--out", default=None, help="Write every figure as JSON here.")
    add_dataset_path_arg(parser)
    args = parser.parse_args()
    sharegpt = ["--dataset-name", "sharegpt", "--dataset-path",
                checked_dataset_path(parser, args.dataset_path)]  # fmt: skip

    engine_flags = ["--dtype", args.dtype, "--log-stats-interval-s", "0"]
    dataset = [*sharegpt, "--num-prompts", str(args.num_prompts)]
    rounds = []
    for r in range(args.repeats):
        order = ["offline", "server"] if r % 2 == 0 else ["server", "offline"]
        got: dict[str, dict] = {}
        for kind in order:
            _log(f"round {r + 1}: {kind}")
            if kind == "offline":
                got[kind] = _offline(dataset, engine_flags)
            else:
                server = Server(engine_flags)
                try:
                    got[kind] = _bench_serve(server.base, dataset, [])
                finally:
                    server.stop()
        offline_tps = got["offline"]["output_tokens_per_second"]
        server_tps = got["server"]["output_throughput"]
        row = {
            "round": r + 1,
            "order": order,
            "offline_output_tok_s": offline_tps,
            "server_output_tok_s": server_tps,
            "ratio": server_tps / offline_tps,
            "offline_output_tokens": got["offline"]["total_output_tokens"],
            "server_output_tokens": got["server"]["total_output_tokens"],
            "server_failed": got["server"]["failed"],
        }
        _log(json.dumps(row))
        rounds.append(row)

    latency = []
    if not args.skip_latency:
        server = Server(engine_flags)
        try:
            _bench_serve(server.base, [*sharegpt, "--num-prompts", "4"], [])
            for clients in (int(c) for c in args.clients.split(",")):
                n = max(8, 4 * clients)
                _log(f"latency: {clients} clients, {n} prompts")
                res = _bench_serve(
                    server.base,
                    [*sharegpt, "--num-prompts", str(n), "--seed", "1"],
                    ["--max-concurrency", str(clients)],
                )
                row = {"clients": clients, "num_prompts": n, "failed": res["failed"]}
                for m in ("ttft", "itl", "tpot", "e2el"):
                    for stat in ("mean", "median", "p99"):
                        row[f"{stat}_{m}_ms"] = res[f"{stat}_{m}_ms"]
                row["output_throughput"] = res["output_throughput"]
                _log(json.dumps(row))
                latency.append(row)
        finally:
            server.stop()

    print("\n| round | order | offline out tok/s | server out tok/s | server / offline |")
    print("|---|---|---|---|---|")
    for row in rounds:
        print(f"| {row['round']} | {' then '.join(row['order'])} | "
              f"{row['offline_output_tok_s']:.1f} | {row['server_output_tok_s']:.1f} | "
              f"{row['ratio']:.3f} |")  # fmt: skip
    if rounds:
        print(f"\nmedian ratio: {statistics.median(r['ratio'] for r in rounds):.3f}")
    if latency:
        print("\n| clients | requests | TTFT mean / median / p99 ms | ITL mean / median / p99 ms "
              "| TPOT mean ms | out tok/s |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for row in latency:
            print(
                f"| {row['clients']} | {row['num_prompts']} | "
                f"{row['mean_ttft_ms']:.1f} / {row['median_ttft_ms']:.1f} / "
                f"{row['p99_ttft_ms']:.1f} | {row['mean_itl_ms']:.1f} / "
                f"{row['median_itl_ms']:.1f} / {row['p99_itl_ms']:.1f} | "
                f"{row['mean_tpot_ms']:.1f} | {row['output_throughput']:.1f} |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rounds": rounds, "latency": latency, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
