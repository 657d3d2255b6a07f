"""`RayDistributedExecutor` on a real Ray cluster: one started for this module with the
`ray` CLI, on loopback, with 4 CPUs.

Greedy float32 outputs through Ray actors must equal the single-rank engine's token for
token, as they do for the multi-process executor (tests/integration/test_executors.py); a
killed actor must fail the engine within seconds; a missing cluster or missing CPUs must
fail start-up with a clear error instead of hanging.

`ray start` runs in a session of its own, which every daemon and worker of the cluster
inherits; the teardown kills that session's processes by pid. (Not `ray stop --force`: it
kills every Ray process on the machine, whoever started it.)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from pagedinfer import LLM
from pagedinfer.executor.base import ExecutorFailed
from tests.integration.conftest import PARALLEL_ENGINE as SMALL
from tests.integration.conftest import greedy_token_ids as _generate
from tests.integration.conftest import kill_mid_generation
from tests.model.tiny import make_tiny_llama_dir

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

RAY = {"distributed_executor_backend": "ray"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (field 6 of /proc/PID/stat)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # gone
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _stop_session(sid: int, timeout_s: float = 15.0) -> list[int]:
    """SIGKILL session `sid`'s processes until none is left; those alive at the end."""
    deadline = time.monotonic() + timeout_s
    while (pids := _session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return _session_pids(sid)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on 127.0.0.1; RAY_ADDRESS points this process at it."""
    from ray._private import ray_constants

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    temp_dir = tempfile.mkdtemp(prefix="pi-ray-", dir="/tmp")
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray replaces a loopback --node-ip-address with the host's routable IP (and listens
    # there) unless clusters are limited to one machine, a switch meant for macOS and
    # Windows. With it the whole cluster stays on 127.0.0.1.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cmd = [
        ray_bin, "start", "--head", "--node-ip-address=127.0.0.1",
        f"--port={address.rsplit(':', 1)[1]}", "--num-cpus=4", "--include-dashboard=false",
        f"--object-store-memory={200 * 2**20}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    started = time.monotonic()
    # A new session (its id is `ray start`'s pid), inherited by everything the cluster runs.
    proc = subprocess.Popen(
        cmd, env=env, cwd=temp_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            pytest.fail(f"`ray start` failed ({proc.returncode}):\n{output}")
        print(f"ray start: {time.monotonic() - started:.1f} s")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", address)
            mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            # The driver's copy of the switch (read when ray was imported).
            mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
            yield address
    finally:
        # Each executor disconnects on shutdown; still connected means a Ray call came
        # after that, and Ray's auto-init answered it by starting a local cluster.
        stray = ray.is_initialized()
        if stray:
            ray.shutdown()  # stops that local cluster too
        left = _stop_session(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"
        assert not stray, "this process was connected to Ray after every executor shut down"


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
