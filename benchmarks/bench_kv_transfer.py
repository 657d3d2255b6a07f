"""Per-request KV transfer cost of each connector, for prompts of 512 and 2048 tokens.

For each connector and prompt length, a producer (prefill) instance computes `--requests`
distinct prompts (max_tokens=1), one at a time, and saves or holds their KV; a consumer
(decode) instance then runs each prompt alone (max_tokens=1), loading the KV. Reported per
request:
- bytes moved, save time on the producer (the writer thread's time; SharedStorage and Redis)
  and load time on the consumer (reading, checking and scattering into the paged cache; for
  ZmqConnector the pull over TCP), with the resulting MB/s;
- the consumer's time to first token with the load, against the same instance computing the
  prompt itself (no KV stored for it): what the transfer saves on the decode side.

The store-backed connectors' producer and consumer run in this process, one after the
other; the ZmqConnector's producer runs in a process of its own, whose server thread answers
the consumer's pulls over loopback TCP. Redis is a real redis-server on loopback.

Usage: .venv/bin/python benchmarks/bench_kv_transfer.py [--lengths 512,2048] [--requests 4]
           [--connectors SharedStorageConnector,RedisConnector,ZmqConnector] [--dtype auto]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pagedinfer import LLM, SamplingParams  # noqa: E402

CONNECTORS = ["SharedStorageConnector", "RedisConnector", "ZmqConnector"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    import redis

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"], stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def prompts_of(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def kv_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.get_stats().items() if k.startswith("kv_n") or "time" in k}


def run_one(connector: str, length: int, args: argparse.Namespace, extra: dict[str, Any]):
    engine: dict[str, Any] = dict(
        dtype=args.dtype, kv_cache_memory_bytes=768 << 20, max_model_len=length + 64,
        max_num_batched_tokens=max(2048, length + 64), log_stats_interval_s=0,
    )  # fmt: skip
    producer_cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_producer",
                                    "kv_connector_extra_config": extra}  # fmt: skip
    if connector == "ZmqConnector":
        producer_cfg["kv_port"] = free_port()
    consumer_cfg = {**producer_cfg, "kv_role": "kv_consumer"}
    prompts = prompts_of(length, args.requests, seed=length)
    if connector == "ZmqConnector":
        # The producer in its own process, as in a deployment: its server thread answers
        # the pulls while the consumer computes, and must not share the consumer's GIL.
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_producer_process, args=(child, producer_cfg, engine, prompts))
        proc.start()
        params, saved = parent.recv()
        try:
            return _consume(connector, length, args, engine, consumer_cfg, prompts, params,
                            saved)  # fmt: skip
        finally:
            parent.send("done")
            proc.join(60)
    with LLM(kv_transfer_config=producer_cfg, **engine) as producer:
        params, saved = _produce(producer, prompts)
        return _consume(connector, length, args, engine, consumer_cfg, prompts, params, saved)


def _produce(producer: LLM, prompts: list[list[int]]) -> tuple[list[Any], dict[str, float]]:
    """Prefill each prompt alone; its kv_transfer_params and the save counters."""
    remote = SamplingParams(
        max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    warm = SamplingParams(max_tokens=1, temperature=0)
    producer.generate([{"prompt_token_ids": prompts[0][:64]}], warm, use_tqdm=False)
    before = kv_stats(producer)
    params = []
    for p in prompts:
        (out,) = producer.generate([{"prompt_token_ids": p}], remote, use_tqdm=False)
        params.append(out.kv_transfer_params)
    return params, {k: v - before.get(k, 0) for k, v in kv_stats(producer).items()}


def _producer_process(conn, producer_cfg, engine, prompts) -> None:
    with LLM(kv_transfer_config=producer_cfg, **engine) as producer:
        conn.send(_produce(producer, prompts))
        conn.recv()  # serve pulls until the consumer is done


def _consume(connector, length, args, engine, consumer_cfg, prompts, params, saved):
    """Run each prompt alone on a consumer, loading its KV, then prompts nobody stored."""
    fresh = prompts_of(length, args.requests, seed=length + 1)  # never stored
    one = SamplingParams(max_tokens=1, temperature=0)
    with LLM(kv_transfer_config=consumer_cfg, enable_prefix_caching=False,
             **engine) as consumer:  # fmt: skip
        consumer.generate([{"prompt_token_ids": fresh[0][:64]}], one, use_tqdm=False)
        ttft_load, ttft_compute = [], []
        before = kv_stats(consumer)
        for p, kv in zip(prompts, params):
            extra_args = {"kv_transfer_params": kv} if kv else None
            sp = SamplingParams(max_tokens=1, temperature=0, extra_args=extra_args)
            start = time.perf_counter()
            (out,) = consumer.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
            ttft_load.append(time.perf_counter() - start)
            assert out.num_external_cached_tokens > 0, "nothing was loaded"
        loaded = {k: v - before.get(k, 0) for k, v in kv_stats(consumer).items()}
        for p in fresh:
            start = time.perf_counter()
            consumer.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            ttft_compute.append(time.perf_counter() - start)
    n = args.requests
    load_bytes = loaded["kv_num_loaded_bytes"] / n
    return {
        "connector": connector,
        "tokens": length,
        "MB per request": load_bytes / 2**20,
        "save ms": 1e3 * saved.get("kv_save_time_s", 0.0) / n,
        "load ms": 1e3 * loaded["kv_load_time_s"] / n,
        "load MB/s": load_bytes / 2**20 / max(loaded["kv_load_time_s"] / n, 1e-9),
        "TTFT with load ms": 1e3 * statistics.median(ttft_load),
        "TTFT computing ms": 1e3 * statistics.median(ttft_compute),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    rows = []
    redis_proc = None
    tmp = tempfile.mkdtemp(prefix="kv-bench-")
    try:
        for connector in args.connectors.split(","):
            extra: dict[str, Any] = {}
            if connector == "SharedStorageConnector":
                extra["shared_storage_path"] = tmp
            elif connector == "RedisConnector":
                if redis_proc is None:
                    redis_proc, url = start_redis()
                extra["redis_url"] = url
            for length in (int(x) for x in args.lengths.split(",")):
                rows.append(run_one(connector, length, args, extra))
                print(rows[-1], flush=True)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
