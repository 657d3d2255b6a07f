"""In-process executor: one worker, called directly (tests, CPU, single device)."""

from __future__ import annotations

from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedinfer.executor.base import Executor, ModelInfo

__all__ = ["UniProcExecutor"]


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # Imported here so that the engine package never imports worker code at module
        # level (the multi-process executor imports it only inside the child).
        from pagedinfer.worker.worker import Worker

        self.worker = Worker(config)

    def load_model(self) -> ModelInfo:
        arch = self.worker.load_model()
        return ModelInfo(
            vocab_size=arch.vocab_size,
            max_position_embeddings=arch.max_position_embeddings,
            num_kv_blocks=self.worker.num_kv_blocks(),
            dtype=str(self.worker.dtype).removeprefix("torch."),
            load_time_s=self.worker.load_time_s,
            kv_bytes_per_block=self.worker.kv_bytes_per_block(),
        )

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
        return self.worker.sample_tokens(grammar_output)
