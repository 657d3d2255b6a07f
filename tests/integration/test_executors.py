"""Tensor and pipeline parallelism through `MultiProcExecutor`: real worker processes,
shared-memory queues and gloo collectives, on the default model and on a tiny one.

Greedy float32 outputs must equal the single-rank engine's token for token (the sharded
matmuls only change the summation order of the row-parallel products). A worker killed
with SIGKILL must fail the engine within 5 s and leave no process or shared-memory segment.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagedinfer import LLM, SamplingParams
from tests.model.tiny import make_tiny_llama_dir

MAX_TOKENS = 32
SMALL = {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 1024}


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


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
def tp1_outputs(prompts) -> list[list[int]]:
    with LLM(**SMALL) as llm:
        return _generate(llm, prompts)


def test_tp3_equals_tp1(prompts, tp1_outputs):
    before = _shm_entries()
    with LLM(tensor_parallel_size=3, **SMALL) as llm:
        infos = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")
        assert _generate(llm, prompts) == tp1_outputs
    # Each rank holds a third of the heads and of the MLP, one KV head, all 30 layers.
    assert [i["tp_rank"] for i in infos] == [0, 1, 2]
    assert {i["num_heads"] for i in infos} == {3} and {i["num_kv_heads"] for i in infos} == {1}
    assert {tuple(i["layers"]) for i in infos} == {(0, 30)}
    assert len({i["pid"] for i in infos}) == 3
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


def test_tiny_tp2_pp2_equals_single(tmp_path):
    model = make_tiny_llama_dir(str(tmp_path / "tiny"))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    opts = {"dtype": "float32", "kv_cache_memory_bytes": 8 * 2**20, "max_model_len": 256}
    with LLM(model, **opts) as llm:
        expected = _generate(llm, prompts, 24)
    with LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, **opts) as llm:
        infos = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")
        assert _generate(llm, prompts, 24) == expected
    assert [(i["tp_rank"], i["pp_rank"]) for i in infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_sigkill_worker_fails_engine_fast():
    before = _shm_entries()
    llm = LLM(tensor_parallel_size=3, **SMALL)
    executor = llm.llm_engine.engine_core.executor
    pids = [w.proc.pid for w in executor.workers]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _generate(llm, [[1, 2, 3, 4]] * 4, max_tokens=2000)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(3.0)  # mid-generation
    assert thread.is_alive()
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=30)
    elapsed = time.monotonic() - killed_at
    assert not thread.is_alive()
    assert elapsed < 5.0, f"failure reported after {elapsed:.1f} s"
    assert errors and "worker rank 1" in str(errors[0]) and "signal 9" in str(errors[0])
    llm.shutdown()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert _shm_entries() <= before
