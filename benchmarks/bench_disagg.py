"""Mixed workload, disaggregated against colocated: do long prompts stall the token streams?

Workload (the same for both): `--streams` requests with short prompts stream
`--stream-tokens` tokens each, while `--long` requests with `--long-tokens`-token prompts
(and `--long-max-tokens` outputs) arrive one every `--long-interval-s` seconds. Measured on
the client: the inter-token latency (ITL) of the streams (gaps between their SSE chunks),
p50/p99/max, and the long requests' time to first token.

- colocated: one `pagedinfer serve` with `--num-threads` = all cores;
- disaggregated: a prefill server and a decode server with half the threads each (the same
  total cores) and `pagedinfer disagg-proxy` in front, KV moved by `--connector`.
Every request of the disaggregated run goes through the proxy (prefill, then decode).
Configurations alternate for `--rounds` rounds; ratios are of medians over rounds.

Usage: .venv/bin/python benchmarks/bench_disagg.py [--rounds 2] [--streams 4]
           [--stream-tokens 160] [--long 6] [--long-tokens 1024] [--long-interval-s 2]
           [--connector ZmqConnector] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import aiohttp

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`pagedinfer {command}` on a free port, up once `/health` answers 200."""

    def __init__(self, command: str, *args: str, avoid_ports: tuple[int, ...] = ()) -> None:
        self.port = free_port()
        while self.port in avoid_ports:  # a KV connector's port, bound later
            self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-disagg-", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedinfer", command, "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log.name).read()[-3000:])
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{command} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


async def stream(session, base: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(time to first token, gaps between later chunks) of one streamed completion."""
    start = time.perf_counter()
    times = []
    async with session.post(base + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]


async def workload(base: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        streams = [
            asyncio.create_task(stream(session, base, {
                "model": MODEL, "prompt": f"Stream {seed}-{i}: tell a long story about the sea.",
                "max_tokens": args.stream_tokens, "temperature": 0, "ignore_eos": True}))
            for i in range(args.streams)
        ]  # fmt: skip
        await asyncio.sleep(args.long_interval_s / 2)
        longs = []
        for _ in range(args.long):
            prompt = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]
            longs.append(asyncio.create_task(stream(session, base, {
                "model": MODEL, "prompt": prompt, "max_tokens": args.long_max_tokens,
                "temperature": 0, "ignore_eos": True})))  # fmt: skip
            await asyncio.sleep(args.long_interval_s)
        stream_results = await asyncio.gather(*streams)
        long_results = await asyncio.gather(*longs)
    gaps = sorted(g for _, gs in stream_results for g in gs)
    q = statistics.quantiles(gaps, n=100)
    return {
        "itl_p50_ms": 1e3 * q[49],
        "itl_p99_ms": 1e3 * q[98],
        "itl_max_ms": 1e3 * gaps[-1],
        "long_ttft_median_s": statistics.median(t for t, _ in long_results),
    }


def colocated(args: argparse.Namespace) -> list[Proc]:
    return [Proc("serve", "--num-threads", str(args.threads), *args.engine)]


def disaggregated(args: argparse.Namespace) -> list[Proc]:
    half = str(max(args.threads // 2, 1))
    extra: dict[str, Any] = {}
    producer: dict[str, Any] = {"kv_connector": args.connector, "kv_role": "kv_producer"}
    if args.connector == "ZmqConnector":
        producer["kv_port"] = free_port()
    elif args.connector == "SharedStorageConnector":
        extra["shared_storage_path"] = tempfile.mkdtemp(prefix="bench-disagg-kv-")
    # A transfer secret: the servers then take the proxy's kv_transfer_params, and the
    # consumer loads only what the producer tagged (docs/disaggregation.md, "Trust").
    extra["secret"] = secrets.token_hex(16)
    producer["kv_connector_extra_config"] = extra
    consumer = {**producer, "kv_role": "kv_consumer"}
    avoid = (producer.get("kv_port", 0),)
    procs = [Proc("serve", "--num-threads", half, "--kv-transfer-config", json.dumps(producer),
                  *args.engine, avoid_ports=avoid)]  # fmt: skip
    procs.append(Proc("serve", "--num-threads", half, "--kv-transfer-config",
                      json.dumps(consumer), *args.engine, avoid_ports=avoid))  # fmt: skip
    procs.append(Proc("disagg-proxy", "--prefill", procs[0].base, "--decode", procs[1].base,
                      avoid_ports=avoid))  # fmt: skip
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--long-interval-s", type=float, default=2.0)
    ap.add_argument("--connector", default="ZmqConnector")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    args.engine = [
        "--dtype", args.dtype, "--max-model-len", str(args.long_tokens + 256),
        "--kv-cache-memory-bytes", str(512 << 20), "--log-stats-interval-s", "0",
    ]  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": []}
    for r in range(args.rounds):
        for name, make in (("colocated", colocated), ("disaggregated", disaggregated)):
            procs = make(args)
            try:
                res = asyncio.run(workload(procs[-1].base, args, seed=r))
            finally:
                for p in reversed(procs):
                    p.stop()
            results[name].append(res)
            print(name, r, {k: round(v, 2) for k, v in res.items()}, flush=True)
    print("\n| setup | ITL p50 ms | ITL p99 ms | ITL max ms | long TTFT s |\n|---|---|---|---|---|")
    med = {}
    for name, runs in results.items():
        med[name] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        m = med[name]
        print(f"| {name} | {m['itl_p50_ms']:.1f} | {m['itl_p99_ms']:.1f} | "
              f"{m['itl_max_ms']:.1f} | {m['long_ttft_median_s']:.2f} |")  # fmt: skip
    c, d = med["colocated"], med["disaggregated"]
    print(f"\np99 ITL disaggregated / colocated: {d['itl_p99_ms'] / c['itl_p99_ms']:.2f}x; "
          f"p50: {d['itl_p50_ms'] / c['itl_p50_ms']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
