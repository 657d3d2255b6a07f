"""Synchronous front end: input processing -> engine core -> output processing.

`LLMEngine` *holds* an engine core (composition, as in vLLM; the core runs in-process here)
and never touches the model itself. `step()` advances the core by one step and turns its
token-level outputs into `RequestOutput`s; requests finished by a stop string in the
detokenizer are aborted in the core right away so their KV blocks are freed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec

from pagedinfer.config import EngineConfig
from pagedinfer.core.messages import EngineCoreRequest, SchedulerStats
from pagedinfer.engine.core import EngineCore
from pagedinfer.engine.input_processor import InputProcessor, PromptType
from pagedinfer.engine.output_processor import OutputProcessor, ParentRequest
from pagedinfer.executor.base import Executor
from pagedinfer.executor.uniproc import UniProcExecutor
from pagedinfer.outputs import RequestOutput
from pagedinfer.sampling_params import SamplingParams
from pagedinfer.tokenizer import Tokenizer

logger = logging.getLogger("pagedinfer")

__all__ = ["LLMEngine", "EngineStats"]


class EngineStats:
    """Counters since start (or since the last `reset()`), for logs and `LLM.get_stats()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished_requests = 0
        self.scheduler: SchedulerStats = SchedulerStats()

    def as_dict(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {
            "num_running_reqs": self.scheduler.num_running_reqs,
            "num_waiting_reqs": self.scheduler.num_waiting_reqs,
            "kv_cache_usage": self.scheduler.kv_cache_usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_finished_requests": self.num_finished_requests,
            "elapsed_s": elapsed,
            "prompt_throughput": self.num_prompt_tokens / elapsed,
            "generation_throughput": self.num_generation_tokens / elapsed,
        }


class LLMEngine:
    def __init__(
        self, config: EngineConfig, executor_class: type[Executor] = UniProcExecutor
    ) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_model_path(config.model_config.model)
        self.engine_core = EngineCore(config, executor_class)
        self.max_model_len = self.engine_core.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.engine_core.model_info.vocab_size, self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.stats = EngineStats()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue one request; raises ValueError for bad input (nothing queued)."""
        self._check_unused(request_id)
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority
        )
        self.add_processed_request(request, prompt_text)

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.output_processor.request_states or (
            request_id in self.output_processor.parent_requests
        ):
            raise ValueError(f"Request id {request_id!r} is already in use.")

    def add_processed_request(self, request: EngineCoreRequest, prompt_text: str | None) -> None:
        """Queue a request already built by `input_processor.process` (validated)."""
        self._check_unused(request.request_id)
        self.stats.num_prompt_tokens += len(request.prompt_token_ids) * request.sampling_params.n
        if request.sampling_params.n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return
        # n > 1: fan out into n independent child requests (they share nothing but the
        # prompt; prefix caching later lets them share its KV blocks).
        parent = ParentRequest(request.request_id, request.sampling_params)
        for index in range(parent.n):
            child_id, child_params = parent.get_child_info(index)
            child = msgspec.structs.replace(
                request, request_id=child_id, sampling_params=child_params
            )
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        removed = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(removed)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self.stats.scheduler = outputs.scheduler_stats
        self.stats.num_generation_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
        self.stats.num_finished_requests += sum(1 for o in processed.request_outputs if o.finished)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()
