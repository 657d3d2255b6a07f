"""The executor interface: how the engine core drives its worker(s).

`EngineCore` only ever calls these methods; whether the worker lives in the same process
(`UniProcExecutor`) or in one process per rank behind shared-memory queues is hidden here.

A step is `execute_model(scheduler_output)` and then, unless that returned the step's
`ModelRunnerOutput`, `sample_tokens(grammar_output)`: the engine fills the grammar bitmask
between the two calls, while the forward pass runs. A step with no scheduled tokens (the KV
connector's poll: loads start, finished transfers are reported) runs no forward pass and
returns its output from `execute_model` at once; every other step returns None there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass

from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

__all__ = ["Executor", "ExecutorFailed", "ModelInfo"]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model (plain data)."""

    vocab_size: int
    max_position_embeddings: int
    num_kv_blocks: int
    dtype: str
    load_time_s: float
    kv_bytes_per_block: int


class ExecutorFailed(RuntimeError):
    """A worker died or failed: the executor can run nothing more (the engine fails its
    requests with this message and stops)."""


class Executor(ABC):
    """Subclasses: `UniProcExecutor` ("uni"), `MultiProcExecutor` ("mp"),
    `RayDistributedExecutor` ("ray"); `Executor.get_class` picks one from the config."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.executor_backend
        if backend == "uni":
            from pagedinfer.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pagedinfer.executor.multiproc import MultiProcExecutor

            return MultiProcExecutor
        from pagedinfer.executor.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may keep in flight: one per pipeline stage."""
        return 1

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> Future[ModelRunnerOutput]:
        """Forward and sample in one go, returning at once (pipeline parallelism keeps up
        to `max_concurrent_batches` of these in flight). The default runs it inline."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            out = self.execute_model(scheduler_output)
            future.set_result(out if out is not None else self.sample_tokens(grammar_output))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def check_health(self) -> None:
        """Raise `ExecutorFailed` if a worker is gone (in-process: always healthy)."""

    @abstractmethod
    def load_model(self) -> ModelInfo:
        """Load weights on every worker and return model facts and the KV block count."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker, whose model then runs sequences
        of at most `max_model_len` tokens (its RoPE tables may depend on it)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Start the step's forward pass and return None: `sample_tokens()` returns the
        step's output. A step with no scheduled tokens has no forward pass and returns its
        `ModelRunnerOutput` here (its KV connector's transfers); no `sample_tokens()` follows."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample from the logits of the last execute_model() (that returned None), with the
        disallowed tokens of `grammar_output`'s requests masked."""

    def shutdown(self) -> None:
        """Release workers (no-op in-process)."""
