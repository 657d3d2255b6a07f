"""Tensor and pipeline parallelism through `MultiProcExecutor`: real worker processes,
shared-memory queues and gloo collectives, on the default model and on a tiny one.

Greedy float32 outputs must equal the single-rank engine's token for token (the sharded
matmuls only change the summation order of the row-parallel products). A worker killed
with SIGKILL must fail the engine within 5 s and leave no process or shared-memory segment.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedinfer import LLM
from tests.integration.conftest import PARALLEL_ENGINE as SMALL
from tests.integration.conftest import greedy_token_ids as _generate
from tests.integration.conftest import kill_mid_generation
from tests.model.tiny import make_tiny_llama_dir

pytestmark = pytest.mark.integration


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tp1_outputs(single_rank_run) -> list[list[int]]:
    return single_rank_run[0]


def test_tp3_equals_tp1(prompts, tp1_outputs, single_rank_run):
    before = _shm_entries()
    with LLM(tensor_parallel_size=3, **SMALL) as llm:
        infos = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")
        assert _generate(llm, prompts) == tp1_outputs
    # Each rank holds a third of the heads and of the MLP, one KV head, all 30 layers.
    assert [i["tp_rank"] for i in infos] == [0, 1, 2]
    assert {i["num_heads"] for i in infos} == {3} and {i["num_kv_heads"] for i in infos} == {1}
    assert {tuple(i["layers"]) for i in infos} == {(0, 30)}
    assert len({i["pid"] for i in infos}) == 3
    # Each rank loaded only its shard: a third of everything (the norms, 0.1%, replicate).
    for i in infos:
        assert i["param_bytes"] < 0.34 * single_rank_run[1], (i["param_bytes"], single_rank_run[1])
    assert all(not _alive(i["pid"]) for i in infos)
    assert _shm_entries() <= before


def test_pp2_equals_tp1(prompts, tp1_outputs):
    with LLM(pipeline_parallel_size=2, **SMALL) as llm:
        core = llm.llm_engine.engine_core
        infos = core.executor.collective_rpc("rank_info")
        assert _generate(llm, prompts) == tp1_outputs
        # The requests were split over two batches, both in the pipeline at once.
        assert core.peak_batches_in_flight == 2
    assert [tuple(i["layers"]) for i in infos] == [(0, 15), (15, 30)]


TINY_PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(6)]
TINY_ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 8 * 2**20, "max_model_len": 256}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The tiny random model (4 query, 2 KV heads, 2 layers) and its single-rank outputs."""
    model = make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")))
    with LLM(model, **TINY_ENGINE) as llm:
        return model, _generate(llm, TINY_PROMPTS, 24)


def test_tiny_tp2_pp2_equals_single(tiny_model):
    model, expected = tiny_model
    with LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, **TINY_ENGINE) as llm:
        infos = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")
        assert _generate(llm, TINY_PROMPTS, 24) == expected
    assert [(i["tp_rank"], i["pp_rank"]) for i in infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_tiny_tp4_replicates_kv_heads(tiny_model):
    """More ranks than KV heads: each of the 2 KV heads is held by 2 ranks (vLLM's
    replication), each rank one query head; outputs still equal the single rank's."""
    model, expected = tiny_model
    with LLM(model, tensor_parallel_size=4, **TINY_ENGINE) as llm:
        infos = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")
        assert _generate(llm, TINY_PROMPTS, 24) == expected
    assert [(i["num_heads"], i["num_kv_heads"]) for i in infos] == [(1, 1)] * 4
    assert [i["kv_head_start"] for i in infos] == [0, 0, 1, 1]


def test_sigkill_worker_fails_engine_fast():
    before = _shm_entries()
    llm = LLM(tensor_parallel_size=3, **SMALL)
    executor = llm.llm_engine.engine_core.executor
    pids = [w.proc.pid for w in executor.workers]
    errors, elapsed = kill_mid_generation(llm, pids[1], warmup_s=3.0)
    assert elapsed < 5.0, f"failure reported after {elapsed:.1f} s"
    assert errors and "worker rank 1" in str(errors[0]) and "signal 9" in str(errors[0])
    llm.shutdown()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert _shm_entries() <= before


def _worker_pids(server_pid: int) -> list[int]:
    """The worker processes of the server's engine core (its grandchildren)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pagedinfer.executor.worker_proc" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
            with open(f"/proc/{ppid}/stat") as f:
                grandparent = int(f.read().split(")")[-1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if grandparent == server_pid:
            pids.append(int(pid))
    return sorted(pids)


def test_server_worker_sigkill_ends_streams_with_error():
    """The same through `pagedinfer serve`: the engine core's step fails, FATAL reaches the
    front end, each streaming request ends with an error naming the dead rank, /health
    turns 503, and stopping the server leaves no worker or shared-memory segment."""
    import asyncio
    import json
    import urllib.error
    import urllib.request

    import aiohttp

    from tests.integration.server_proc import ServerProcess, small_engine_flags

    before = _shm_entries()
    server = ServerProcess("--tensor-parallel-size", "3", *small_engine_flags())
    try:
        pids = _worker_pids(server.pid)
        assert len(pids) == 3, pids

        async def stream(session, started: asyncio.Event, events: list[str]) -> None:
            body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
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
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                events: list[list[str]] = [[], []]
                started = [asyncio.Event(), asyncio.Event()]
                tasks = [asyncio.ensure_future(stream(session, started[i], events[i]))
                         for i in (0, 1)]  # fmt: skip
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                os.kill(pids[2], signal.SIGKILL)
                killed_at = time.monotonic()
                await asyncio.gather(*tasks)
                return events, time.monotonic() - killed_at

        events, elapsed = asyncio.run(run())
        assert elapsed < 5.0, f"streams ended {elapsed:.1f} s after the kill"
        for stream_events in events:
            errors = [json.loads(e)["error"] for e in stream_events if '"error"' in e]
            assert errors, stream_events[-3:]
            assert "worker rank 2" in errors[0]["message"], errors[0]
            assert stream_events[-1] == "[DONE]"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.base + "/health", timeout=30)
        assert info.value.code == 503
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert _shm_entries() <= before
