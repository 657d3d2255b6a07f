"""The executor interface: how the engine core drives its worker(s).

`EngineCore` only ever calls these methods; whether the worker lives in the same process
(`UniProcExecutor`) or in one process per rank behind shared-memory queues is hidden here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput

__all__ = ["Executor", "ModelInfo"]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model (plain data)."""

    vocab_size: int
    max_position_embeddings: int
    num_kv_blocks: int
    dtype: str
    load_time_s: float
    kv_bytes_per_block: int


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def load_model(self) -> ModelInfo:
        """Load weights on every worker and return model facts and the KV block count."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the forward pass; None means "call sample_tokens() next"."""

    @abstractmethod
    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
        """Sample from the logits of the last execute_model()."""

    def shutdown(self) -> None:
        """Release workers (no-op in-process)."""
