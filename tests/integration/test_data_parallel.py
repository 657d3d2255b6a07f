"""`pagedinfer serve --data-parallel-size 2` as a real server process: two engine cores
behind one front end (`engine/dp_client.py`).
- 16 concurrent greedy completions all finish with the text a single engine gives
  (`LLM.generate`, float32), and the router gave both replicas a share (the per-replica
  "Data parallel: routed [a, b] requests" log line);
- two long streams dropped mid-stream (one on each replica) are aborted in the replica that
  holds them: /metrics (summed over replicas, asked at scrape time) is back to 0 running,
  0 waiting and 0 KV usage long before they could have finished, and the server keeps
  serving;
- one engine core killed (last: it ends the module's server) fails the in-flight requests
  of both replicas at once, and /health turns 503."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import DP_MODEL as MODEL
from tests.integration.conftest import dp_complete as _complete
from tests.integration.conftest import dp_prompt as _prompt
from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = pytest.mark.integration

aiohttp = pytest.importorskip("aiohttp")

NUM_REQUESTS = 16
ROUTED = re.compile(r"Data parallel: routed \[(\d+), (\d+)\] requests")


@pytest.fixture(scope="module")
def server(dp_reference):  # after the dp_reference: the two never load models at the same time
    srv = ServerProcess(
        "--data-parallel-size", "2", "--log-stats-interval-s", "0.2", *small_engine_flags(512)
    )
    yield srv
    srv.stop()


def _metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        body = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


async def _stream_then_drop(session, base: str, i: int) -> int:
    """A 480-token stream, dropped after 3 chunks; the number of chunks read."""
    body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    resp = await session.post(base + "/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    chunks = 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            assert "error" not in json.loads(line[6:]), line
            chunks += 1
            if chunks >= 3:
                break
    resp.close()  # the client goes away mid-stream
    return chunks


def test_concurrent_requests_match_one_engine_and_use_both_replicas(server, dp_reference) -> None:
    async def run() -> list[str]:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(
                *(_complete(session, server.base, i) for i in range(NUM_REQUESTS))
            )

    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        assert text == dp_reference[i], i
    # The front end logs the per-replica routed counts every 0.2 s while outputs flow; the
    # last line of the burst counts all of it.
    lines = ROUTED.findall(server.log())
    assert lines, server.log()[-3000:]
    routed = [int(n) for n in lines[-1]]
    assert sum(routed) == NUM_REQUESTS, lines
    assert min(routed) >= NUM_REQUESTS // 4, lines  # a burst is spread, not herded


def test_dropped_streams_are_aborted_in_their_replica(server, dp_reference) -> None:
    before = _metrics(server.base)

    async def run() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # Two at once on an idle group: the local bump sends them to different replicas.
            return await asyncio.gather(
                *(_stream_then_drop(session, server.base, i) for i in (0, 1))
            )

    assert asyncio.run(run()) == [3, 3]
    # 480 tokens take far longer than this deadline: if an abort had gone to the wrong
    # replica (or nowhere), its request would still be running and holding blocks.
    deadline = time.monotonic() + 5
    while True:
        after = _metrics(server.base)
        idle = (
            after["pagedinfer:num_requests_running"] == 0
            and after["pagedinfer:num_requests_waiting"] == 0
            and after["pagedinfer:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["pagedinfer:num_requests_running"] == 0
    assert after["pagedinfer:num_requests_waiting"] == 0
    assert after["pagedinfer:kv_cache_usage_perc"] == 0
    aborts = "pagedinfer:request_success_total{finished_reason=abort}"
    assert after[aborts] - before[aborts] == 2

    # Still serving, with the same text.
    async def one() -> str:
        async with aiohttp.ClientSession() as session:
            return await _complete(session, server.base, 2)

    assert asyncio.run(one()) == dp_reference[2]


def _engine_pids(server_pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if b"pagedinfer.engine.core_proc" in cmd.read():
                        pids.append(int(child))
    return pids


def test_killing_one_replica_fails_every_in_flight_request(server) -> None:
    pids = _engine_pids(server.pid)
    assert len(pids) == 2, pids

    async def stream(session, i: int, started: asyncio.Event, events: list[str]) -> None:
        body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": 480, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with session.post(server.base + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        started.set()

    async def run() -> tuple[list[list[str]], float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            events: list[list[str]] = [[], []]
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [
                asyncio.ensure_future(stream(session, i, started[i], events[i])) for i in (0, 1)
            ]
            # Both running (one on each replica) before the kill.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.kill(pids[0], signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.gather(*tasks)
            return events, time.monotonic() - killed_at

    events, elapsed = asyncio.run(run())
    assert elapsed < 10, elapsed
    for stream_events in events:  # the survivor's request fails too: the group is dead
        errors = [json.loads(e)["error"] for e in stream_events if '"error"' in e]
        assert errors and "engine core" in errors[0]["message"], stream_events[-3:]
        assert stream_events[-1] == "[DONE]"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.base + "/health", timeout=30)
    assert info.value.code == 503
