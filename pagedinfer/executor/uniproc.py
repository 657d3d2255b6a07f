"""In-process executor: one worker, called directly (tests, CPU, single device)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedinfer.executor.base import Executor, ModelInfo

if TYPE_CHECKING:
    from pagedinfer.worker.worker import Worker

__all__ = ["UniProcExecutor", "model_info"]


def model_info(worker: Worker) -> ModelInfo:
    """What `Executor.load_model` reports, read off a loaded worker."""
    arch = worker.arch
    assert arch is not None
    return ModelInfo(
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings,
        num_kv_blocks=worker.num_kv_blocks(),
        dtype=str(worker.dtype).removeprefix("torch."),
        load_time_s=worker.load_time_s,
        kv_bytes_per_block=worker.kv_bytes_per_block(),
    )


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # Imported here so that the engine package never imports worker code at module
        # level (the multi-process executor imports it only inside the child).
        from pagedinfer.worker.worker import Worker

        self.worker = Worker(config)

    def load_model(self) -> ModelInfo:
        self.worker.load_model()
        return model_info(self.worker)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        return self.worker.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.worker.shutdown()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """`method` of the worker (the whitelist the process executors accept)."""
        from pagedinfer.executor.messages import WORKER_UTILITY_METHODS

        if method not in WORKER_UTILITY_METHODS:
            raise ValueError(f"unknown worker method {method!r}")
        return [getattr(self.worker, method)(*args)]
