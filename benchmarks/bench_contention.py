"""One decode stream's inter-token latency on an idle machine and beside busy processes (#23
item 6: a server shares its CPU; losing a core should cost about what the core was worth).

For each server setting (`--settings`: extra `serve` flags and environment, `;`-separated),
a real `pagedinfer serve` on the default model streams `--tokens` tokens (`ignore_eos`,
greedy) `--streams` times in a row with 0, 1, ... `--max-busy` busy-looping processes
(`while True: pass`) running beside it, then idle again; each stream's chunk arrival gaps are
its ITLs. Prints mean / p50 / p90 / max ITL and the mean's ratio to the setting's first idle
figure.

    .venv/bin/python benchmarks/bench_contention.py [--max-busy 2] [--tokens 64] [--streams 3] \\
        [--settings "default;--num-threads 1;OMP_WAIT_POLICY=PASSIVE"]

A setting is flags (`--num-threads 1`) and/or VAR=VALUE words, which go into the server's
environment.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.integration.server_proc import ServerProcess  # noqa: E402


def stream_gaps(port: int, tokens: int) -> list[float]:
    """Seconds between consecutive streamed chunks of one completion."""
    body = json.dumps({"prompt": "Tell me a long story about the sea.", "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    stamps = []
    for line in resp:
        if line.startswith(b"data: {"):
            stamps.append(time.perf_counter())
    conn.close()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def start_server(setting: str, *extra: str) -> ServerProcess:
    """A `pagedinfer serve` with a setting's flags and VAR=VALUE environment words."""
    words = setting.split() if setting != "default" else []
    env = dict(os.environ)
    flags = []
    for word in words:
        if "=" in word and not word.startswith("--"):
            key, _, value = word.partition("=")
            env[key] = value
        else:
            flags.append(word)
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # ServerProcess inherits the environment
    try:
        return ServerProcess(*extra, *flags)
    finally:
        os.environ.clear()
        os.environ.update(old)


def run_setting(setting: str, args: argparse.Namespace) -> list[dict]:
    srv = start_server(setting, "--max-model-len", "1024")
    rows = []
    try:
        stream_gaps(srv.port, 8)  # warm-up
        idle_mean = None
        for busy in [*range(args.max_busy + 1), 0]:  # idle again last: threads come back
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]  # fmt: skip
            try:
                time.sleep(1.0)
                gaps = [g for _ in range(args.streams) for g in stream_gaps(srv.port, args.tokens)]
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            mean = statistics.fmean(gaps)
            idle_mean = idle_mean or mean
            q = statistics.quantiles(gaps, n=10)
            rows.append({"setting": setting, "busy": busy, "mean_ms": mean * 1e3,
                         "p50_ms": statistics.median(gaps) * 1e3, "p90_ms": q[-1] * 1e3,
                         "max_ms": max(gaps) * 1e3, "ratio": mean / idle_mean})  # fmt: skip
            r = rows[-1]
            line = (f"| {setting} | {busy} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | "
                    f"{r['p90_ms']:.1f} | {r['max_ms']:.0f} | {r['ratio']:.2f}x |")  # fmt: skip
            print(line, flush=True)
    finally:
        srv.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-busy", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--settings", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.streams} streams of {args.tokens} tokens per row")  # fmt: skip
    print("| setting | busy processes | mean ITL ms | p50 | p90 | max | mean / idle |")
    print("|---|---|---|---|---|---|---|")
    rows = [r for s in args.settings.split(";") for r in run_setting(s.strip(), args)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
