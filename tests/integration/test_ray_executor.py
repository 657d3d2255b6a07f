"""`RayDistributedExecutor` on a real Ray cluster: one started for this module with the
`ray` CLI, on loopback, with 4 CPUs (the `ray_cluster` fixture in conftest.py).

Greedy float32 outputs through Ray actors must equal the single-rank engine's token for
token, as they do for the multi-process executor (tests/integration/test_executors.py); a
killed actor must fail the engine within seconds; a missing cluster or missing CPUs must
fail start-up with a clear error instead of hanging.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from pagedinfer import LLM
from pagedinfer.executor.base import ExecutorFailed
from tests.integration.conftest import PARALLEL_ENGINE as SMALL
from tests.integration.conftest import greedy_token_ids as _generate
from tests.integration.conftest import kill_mid_generation
from tests.integration.conftest import process_alive as _alive
from tests.model.tiny import make_tiny_llama_dir

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

RAY = {"distributed_executor_backend": "ray"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_disconnected() -> None:
    """No thread of a shut-down executor calls Ray any more (one that did would auto-start
    a local cluster): wait past its polling interval, then check."""
    time.sleep(1.0)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def tp1_outputs(single_rank_run) -> list[list[int]]:
    return single_rank_run[0]


def test_tp3_equals_tp1(ray_cluster, prompts, tp1_outputs):
    with LLM(tensor_parallel_size=3, **RAY, **SMALL) as llm:
        executor = llm.llm_engine.engine_core.executor
        assert type(executor).__name__ == "RayDistributedExecutor"
        infos = executor.collective_rpc("rank_info")
        assert _generate(llm, prompts) == tp1_outputs
    assert [i["tp_rank"] for i in infos] == [0, 1, 2]
    assert {i["num_heads"] for i in infos} == {3} and {i["num_kv_heads"] for i in infos} == {1}
    pids = [i["pid"] for i in infos]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert not ray.is_initialized()  # the executor's own connection is closed again


def test_tiny_tp2_pp2_equals_single(ray_cluster, tmp_path, monkeypatch):
    """4 ranks (the cluster's 4 CPUs) and pipelined batches (`execute_model_async`); every
    call goes through the object store, as calls above 100 KiB do."""
    from pagedinfer.executor import ray_executor

    monkeypatch.setattr(ray_executor, "_INLINE_ARG_BYTES", 0)
    model = make_tiny_llama_dir(str(tmp_path / "tiny"))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    opts = {"dtype": "float32", "kv_cache_memory_bytes": 8 * 2**20, "max_model_len": 256}
    with LLM(model, **opts) as llm:
        expected = _generate(llm, prompts, 24)
    with LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, **RAY, **opts) as llm:
        core = llm.llm_engine.engine_core
        infos = core.executor.collective_rpc("rank_info")
        assert _generate(llm, prompts, 24) == expected
        assert core.peak_batches_in_flight == 2
    assert [(i["tp_rank"], i["pp_rank"]) for i in infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    _assert_disconnected()


def test_killed_actor_fails_engine_fast(ray_cluster, tmp_path):
    model = make_tiny_llama_dir(str(tmp_path / "tiny"))
    opts = {"dtype": "float32", "kv_cache_memory_bytes": 8 * 2**20, "max_model_len": 512}
    llm = LLM(model, tensor_parallel_size=2, **RAY, **opts)
    try:
        pids = [i["pid"] for i in llm.llm_engine.engine_core.executor.collective_rpc("rank_info")]
        errors, elapsed = kill_mid_generation(llm, pids[1], warmup_s=1.0, max_tokens=500)
        assert elapsed < 5.0, f"failure reported after {elapsed:.1f} s"
        # The death is named first, even when rank 0's broken collective reported first.
        assert errors and isinstance(errors[0], ExecutorFailed), errors
        assert str(errors[0]).startswith(f"worker rank 1 (pid {pids[1]} on 127.0.0.1) died")
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[0])
    _assert_disconnected()


def test_worker_error_fails_executor(ray_cluster, tmp_path):
    """A call that raises on the workers comes back as `ExecutorFailed` with the worker's
    error; the executor is then failed for good and its actors are gone."""
    model = make_tiny_llama_dir(str(tmp_path / "tiny"))
    opts = {"dtype": "float32", "kv_cache_memory_bytes": 8 * 2**20, "max_model_len": 256}
    with LLM(model, tensor_parallel_size=2, **RAY, **opts) as llm:
        executor = llm.llm_engine.engine_core.executor
        pids = [i["pid"] for i in executor.collective_rpc("rank_info")]
        with pytest.raises(ExecutorFailed, match="worker 0: TypeError"):
            executor.collective_rpc("rank_info", (1,))  # rank_info takes no argument
        with pytest.raises(ExecutorFailed, match="worker 0: TypeError"):
            _generate(llm, [[5, 6, 7]], max_tokens=2)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)


def test_not_enough_cpus_fails_clearly(ray_cluster, monkeypatch):
    from pagedinfer.executor.ray_executor import RayDistributedExecutor

    monkeypatch.setattr(RayDistributedExecutor, "placement_timeout_s", 2.0)
    started = time.monotonic()
    # "4 free": the earlier tests' executors gave their placement groups back.
    with pytest.raises(ExecutorFailed, match=r"could not place 5 workers.* 4 free CPUs of 4\."):
        LLM(pipeline_parallel_size=5, **RAY, **SMALL)
    assert time.monotonic() - started < 30
    assert not ray.is_initialized()


def test_no_cluster_fails_fast(monkeypatch):
    """A closed port: an error naming `ray start --head` within seconds (ray.init alone
    would retry for minutes). Needs no cluster."""
    address = f"127.0.0.1:{_free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"No Ray cluster reachable.*ray start --head"):
        LLM(tensor_parallel_size=3, **RAY, **SMALL)
    assert time.monotonic() - started < 20
    assert not ray.is_initialized()
