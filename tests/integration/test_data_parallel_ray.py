"""`pagedinfer serve --data-parallel-size 2 --data-parallel-backend ray` as a real server
process: two engine cores as Ray actors on a real cluster (the `ray_cluster` fixture:
loopback, 4 CPUs; the server inherits the fixture's RAY_ADDRESS), behind one front end that
drives them over TCP sockets (`engine/dp_replicas.py`, `engine/ray_client.py`).
- 8 concurrent greedy completions all finish with the text a single engine gives
  (`LLM.generate`, float32), and the router gave both replicas a share;
- the engine cores are Ray actor processes, not the server's: Ray started them, outside the
  server's process tree (and its process group, which `ServerProcess.stop` kills);
- stopping the server (SIGTERM, as Ctrl-C would) ends both actors;
- a killed actor fails the in-flight request within seconds and turns /health 503 (Ray
  fails the actor's `run` call, which the front end watches); killing the server outright
  then ends the surviving actor too (SIGKILL: nothing of ours runs; Ray ends the actors of
  a driver that is gone, which stands in for a local engine core's parent-process check)."""

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
from tests.integration.conftest import process_alive
from tests.integration.server_proc import ServerProcess, small_engine_flags
from tests.integration.test_data_parallel import ROUTED

pytestmark = pytest.mark.integration

pytest.importorskip("ray")
aiohttp = pytest.importorskip("aiohttp")

NUM_REQUESTS = 8  # the first 8 of the mp test's prompts and dp_reference texts
READY = re.compile(r"Data-parallel engine core (\d) of 2 ready \(Ray actor pid (\d+) on ([\d.]+),")


@pytest.fixture(scope="module")
def server(ray_cluster, dp_reference):  # after the dp_reference: never two model loads at once
    srv = _start_server()
    yield srv
    srv.stop()


def _start_server() -> ServerProcess:
    return ServerProcess(
        "--data-parallel-size", "2", "--data-parallel-backend", "ray",
        "--log-stats-interval-s", "0.2", *small_engine_flags(512),
    )  # fmt: skip


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether all of `pids` end within `timeout_s` (Ray ends an actor's process
    asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(process_alive(p) for p in pids)


def _engine_actors(server: ServerProcess) -> list[tuple[int, str]]:
    """(pid, node IP) of each engine core, in rank order, from the server's start-up log."""
    found = {int(rank): (int(pid), ip) for rank, pid, ip in READY.findall(server.log())}
    assert sorted(found) == [0, 1], server.log()[-3000:]
    return [found[0], found[1]]


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # ppid, after "pid (comm) state"
        chain.append(pid)
    return chain


def test_ray_replicas_serve_like_one_engine(server, dp_reference) -> None:
    actors = _engine_actors(server)
    pids = [pid for pid, _ in actors]
    assert len(set(pids)) == 2 and all(ip == "127.0.0.1" for _, ip in actors), actors
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().startswith(b"ray::EngineCoreActor"), pid  # Ray's process title
        assert server.pid not in _ancestors(pid), pid  # Ray's raylet started it, not us

    async def run() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(
                *(_complete(session, server.base, i) for i in range(NUM_REQUESTS))
            )

    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        assert text == dp_reference[i], i
    # The last per-replica line of the burst counts all of it.
    lines = ROUTED.findall(server.log())
    assert lines, server.log()[-3000:]
    routed = [int(n) for n in lines[-1]]
    assert sum(routed) == NUM_REQUESTS and min(routed) >= NUM_REQUESTS // 4, lines


def test_stopping_the_server_ends_the_actors(server) -> None:
    pids = [pid for pid, _ in _engine_actors(server)]
    assert all(process_alive(p) for p in pids)
    server.proc.terminate()  # the fixture's stop() then finds it gone
    server.proc.wait(timeout=30)
    assert "Data parallel: requests routed per engine core" in server.log()  # shut down
    assert _wait_gone(pids), server.log()[-3000:]


def test_killed_actor_fails_the_server_and_a_killed_server_its_actors(server) -> None:
    """On a server of its own, after the module's stopped (its CPUs are free again)."""
    srv = _start_server()
    try:
        pids = [pid for pid, _ in _engine_actors(srv)]

        async def stream_then_kill() -> tuple[list[str], float]:
            body = {"model": MODEL, "prompt": _prompt(0), "max_tokens": 480, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            events: list[str] = []
            killed_at = 0.0
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async with session.post(srv.base + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:  # running: on either replica, all fail
                                os.kill(pids[0], signal.SIGKILL)
                                killed_at = time.monotonic()
            return events, time.monotonic() - killed_at

        events, elapsed = asyncio.run(stream_then_kill())
        assert elapsed < 10, elapsed
        errors = [json.loads(e)["error"] for e in events if '"error"' in e]
        assert errors and "engine core" in errors[0]["message"], events[-3:]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.base + "/health", timeout=30)
        assert info.value.code == 503
        assert process_alive(pids[1])
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        assert _wait_gone(pids[1:]), srv.log()[-3000:]
    finally:
        srv.stop()
