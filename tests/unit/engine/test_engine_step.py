"""EngineCore.step: one path for every batch, its (outputs, progressed) result, the trace.

A fake executor stands in for the workers (it samples token 7 for every scheduled request,
so prompts are kept shorter than the token budget: every request samples at each step), and
records the calls the engine makes, so the tests see the executor contract from the
engine's side. One test runs the tiny random Llama through the real runner for the
`execute_model` contract.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pagedinfer.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
)
from pagedinfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedinfer.core.request import RequestStatus
from pagedinfer.core.sched_output import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedinfer.engine.core import EngineCore
from pagedinfer.executor.base import Executor, ModelInfo
from pagedinfer.sampling_params import SamplingParams

TOKEN = 7


class FakeExecutor(Executor):
    """Samples `TOKEN` for every scheduled request; `calls` lists what the engine asked."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, Any]] = []
        self._pending: SchedulerOutput | None = None

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    def load_model(self) -> ModelInfo:
        return ModelInfo(
            vocab_size=256,
            max_position_embeddings=512,
            num_kv_blocks=64,
            dtype="float32",
            load_time_s=0.0,
            kv_bytes_per_block=1,
        )

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.calls.append(("execute_model", scheduler_output))
        assert scheduler_output.total_num_scheduled_tokens > 0, "no connector: no empty steps"
        self._pending = scheduler_output
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        self.calls.append(("sample_tokens", grammar_output))
        assert self._pending is not None
        req_ids = list(self._pending.num_scheduled_tokens)
        self._pending = None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[TOKEN] for _ in req_ids],
        )


def _core(pp: int = 1, trace_path: str | None = None) -> EngineCore:
    config = EngineConfig(
        parallel_config=ParallelConfig(pipeline_parallel_size=pp),
        observability_config=ObservabilityConfig(trace_path=trace_path),
    )
    return EngineCore(config, FakeExecutor)


def _request(req_id: str, max_tokens: int = 3, prompt_len: int = 5) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def _run(core: EngineCore) -> tuple[dict[str, list[int]], int]:
    """Step until every request finished: (tokens per request, number of steps)."""
    tokens: dict[str, list[int]] = {}
    num_steps = 0
    while core.has_unfinished_requests() or core.batch_queue:
        outputs, progressed = core.step()
        assert progressed
        num_steps += 1
        for out in outputs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, num_steps


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """`step()` leaves the idling to its drivers."""

    def fail(seconds: float) -> None:
        raise AssertionError(f"step() slept {seconds} s")

    monkeypatch.setattr(time, "sleep", fail)


def test_idle_step_makes_no_progress_and_waits_nothing() -> None:
    core = _core()
    try:
        outputs, progressed = core.step()
        assert outputs == EngineCoreOutputs(timestamp=outputs.timestamp) and not progressed
        assert core.poll_interval_s() == 0.0
        assert core.executor.calls == []  # type: ignore[attr-defined]
    finally:
        core.shutdown()


def test_a_batch_is_scheduled_run_sampled_and_finished_in_one_step() -> None:
    core = _core()
    try:
        core.add_request(_request("a"))
        core.add_request(_request("b"))
        outputs, progressed = core.step()
        assert progressed
        assert {o.request_id: o.new_token_ids for o in outputs.outputs} == {
            "a": [TOKEN],
            "b": [TOKEN],
        }
        assert outputs.scheduler_stats is not None
        calls = core.executor.calls  # type: ignore[attr-defined]
        assert [name for name, _ in calls] == ["execute_model", "sample_tokens"]
        assert calls[1][1] is None  # no structured request: no grammar bitmask
        assert not core.batch_queue and core.peak_batches_in_flight == 1
        tokens, num_steps = _run(core)
        assert tokens == {"a": [TOKEN, TOKEN], "b": [TOKEN, TOKEN]} and num_steps == 2
    finally:
        core.shutdown()


def test_pipeline_keeps_two_batches_in_flight_and_finishes_every_request() -> None:
    core = _core(pp=2)
    try:
        for i in range(4):
            core.add_request(_request(str(i), max_tokens=4))
        outputs, progressed = core.step()  # the first batch fills the pipeline
        assert progressed and not outputs.outputs and len(core.batch_queue) == 1
        tokens, _ = _run(core)
        assert tokens == {str(i): [TOKEN] * 4 for i in range(4)}
        assert core.peak_batches_in_flight == 2
        assert not core.scheduler.in_flight and not core.batch_queue
    finally:
        core.shutdown()


class _CompilingGrammar:
    """A StructuredOutputRequest whose compile never ends (the test decides)."""

    grammar = None
    error: str | None = None

    def is_ready(self) -> bool:
        return False


def test_a_step_with_only_compiling_grammars_makes_no_progress_and_keeps_finished_ids() -> None:
    core = _core()
    try:
        core.add_request(_request("a", max_tokens=10))
        core.step()
        # A request waiting for its grammar (the scheduler skips it) and an abort.
        core.add_request(_request("fsm"))
        fsm = core.scheduler.requests["fsm"]
        fsm.status = RequestStatus.WAITING_FOR_FSM
        fsm.structured_output_request = _CompilingGrammar()  # type: ignore[assignment]
        core.abort_requests(["a"])
        outputs, progressed = core.step()
        assert not outputs.outputs and not progressed
        assert core.poll_interval_s() == 0.001
        # Nothing reached the workers; the next batch they see drops "a".
        core.add_request(_request("b"))
        core.step()
        last_batch = core.executor.calls[-2][1]  # type: ignore[attr-defined]
        assert "a" in last_batch.finished_req_ids and "b" in last_batch.num_scheduled_tokens
    finally:
        core.shutdown()


@pytest.mark.parametrize("pp", [1, 2])
def test_trace_has_one_record_per_batch(tmp_path, pp: int) -> None:
    path = tmp_path / "trace.jsonl"
    core = _core(pp=pp, trace_path=str(path))
    try:
        for i in range(3):
            core.add_request(_request(str(i), max_tokens=3))
        _run(core)
        num_batches = sum(
            1
            for name, _ in core.executor.calls  # type: ignore[attr-defined]
            if name == "execute_model"
        )
    finally:
        core.shutdown()
    header, *steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["trace"] == "pagedinfer"
    assert len(steps) == num_batches > 0
    assert [s["step"] for s in steps] == list(range(num_batches))
    keys = {"step", "time", "kv_usage", "scheduled", "preempted", "finished",
            "stored_blocks", "evicted_blocks", "freed_blocks"}  # fmt: skip
    assert all(set(s) == keys for s in steps)
    # Every request's prompt and its decodes appear once; each finish once.
    for i in range(3):
        entries = [e for s in steps for e in s["scheduled"] if e["req"] == str(i)]
        assert sum(e["tokens"] for e in entries) == 5 + 3 - 1
    assert sorted(r for s in steps for r in s["finished"]) == ["0", "1", "2"]


def test_runner_returns_the_output_of_a_step_without_tokens_from_execute_model(
    tmp_path,
) -> None:
    """The `Executor.execute_model` contract on the real runner (tiny random Llama)."""
    from pagedinfer.core.sched_output import CachedRequestData
    from pagedinfer.executor.uniproc import UniProcExecutor
    from tests.model.tiny import make_tiny_llama_dir

    model_dir = make_tiny_llama_dir(str(tmp_path / "tiny"))
    config = EngineConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32"),
        cache_config=CacheConfig(kv_cache_memory_bytes=2**20),
    )
    core = EngineCore(config, UniProcExecutor)
    try:
        empty = SchedulerOutput([], CachedRequestData(), {}, 0)
        out = core.executor.execute_model(empty)
        assert isinstance(out, ModelRunnerOutput) and out.req_ids == []
        core.add_request(_request("a", max_tokens=2))
        tokens, num_steps = _run(core)
        assert len(tokens["a"]) == 2 and num_steps == 2
    finally:
        core.shutdown()


class _StubWorker:
    """What `handle_call` needs of a worker: the runner's `execute_model` contract."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[1]])


def test_worker_process_answers_a_step_without_tokens_from_the_output_rank() -> None:
    """The process executors wait for a reply to `ExecuteModel` exactly when the step has
    no tokens (`Executor.execute_model`); only the output rank sends it."""
    from pagedinfer.core.sched_output import CachedRequestData
    from pagedinfer.executor.messages import ExecuteModel, SampleTokens
    from pagedinfer.executor.worker_proc import handle_call

    worker = _StubWorker()
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    batch = SchedulerOutput([], CachedRequestData(), {"a": 1}, 1)
    wanted, result = handle_call(worker, ExecuteModel(empty), rank=1, output_rank=1)
    assert wanted and isinstance(result, ModelRunnerOutput) and result.req_ids == []
    assert not handle_call(worker, ExecuteModel(empty), rank=0, output_rank=1)[0]
    assert handle_call(worker, ExecuteModel(batch), rank=1, output_rank=1) == (False, None)
    wanted, result = handle_call(worker, SampleTokens(), rank=1, output_rank=1)
    assert wanted and result.req_ids == ["a"]
    wanted, result = handle_call(worker, ExecuteModel(batch, True), rank=1, output_rank=1)
    assert wanted and result.req_ids == ["a"]
