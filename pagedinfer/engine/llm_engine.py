"""Synchronous front end: input processing -> engine core -> output processing.

`LLMEngine` *holds* an engine core (composition, as in vLLM; the core runs in-process here)
and never touches the model itself. `step()` advances the core by one step and turns its
token-level outputs into `RequestOutput`s; requests finished by a stop string in the
detokenizer are aborted in the core right away so their KV blocks are freed.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

import msgspec

from pagedinfer.config import EngineConfig
from pagedinfer.core.messages import (
    EngineCoreRequest,
    KVTransferStats,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedinfer.engine.core import EngineCore
from pagedinfer.engine.input_processor import InputProcessor, PromptType
from pagedinfer.engine.output_processor import OutputProcessor, split_request
from pagedinfer.executor.base import Executor
from pagedinfer.outputs import RequestOutput
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import SamplingParams
from pagedinfer.tokenizer import Tokenizer

logger = logging.getLogger("pagedinfer")

__all__ = ["LLMEngine", "EngineStats", "num_speculative_tokens"]


class EngineStats:
    """Counters since start (or since the last `reset()`), for the periodic log line and
    `LLM.get_stats()`. The prefix-cache hit rate is over the most recent ~1,000 looked-up
    requests, as vLLM's; throughputs are since start (`as_dict`) or since the last log line
    (`log_line`)."""

    HIT_RATE_WINDOW_REQUESTS = 1000

    def __init__(
        self, log_interval_s: float = 5.0, num_speculative_tokens: int | None = None
    ) -> None:
        self.log_interval_s = log_interval_s
        self.num_speculative_tokens = num_speculative_tokens  # k: per-position figures
        self.reset()

    def reset(self) -> None:
        self.start_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished_requests = 0
        self.scheduler: SchedulerStats = SchedulerStats()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # (requests, queries, hits) per step, newest last, trimmed to the window.
        self._recent: collections.deque[tuple[int, int, int]] = collections.deque()
        self._recent_requests = 0
        self._last_log = (self.start_time, 0, 0)  # time, prompt tokens, generation tokens
        # Speculative decoding: since start, and since the last log line.
        self.spec_decoding: SpecDecodingStats | None = None
        self._spec_since_log: SpecDecodingStats | None = None
        # KV connector transfers since start (None without any).
        self.kv_transfer: KVTransferStats | None = None

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.scheduler = stats
        if stats.kv_transfer is not None:
            if self.kv_transfer is None:
                self.kv_transfer = KVTransferStats()
            self.kv_transfer.add(stats.kv_transfer)
        if stats.spec_decoding is not None:
            if self.spec_decoding is None:
                self.spec_decoding = SpecDecodingStats()
                self._spec_since_log = SpecDecodingStats()
            assert self._spec_since_log is not None
            self.spec_decoding.add(stats.spec_decoding)
            self._spec_since_log.add(stats.spec_decoding)
        if stats.prefix_cache_reset:
            self._recent.clear()
            self._recent_requests = 0
        if stats.prefix_cache_requests:
            self.prefix_cache_queries += stats.prefix_cache_queries
            self.prefix_cache_hits += stats.prefix_cache_hits
            self._recent.append(
                (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits)
            )
            self._recent_requests += stats.prefix_cache_requests
            while self._recent_requests > self.HIT_RATE_WINDOW_REQUESTS and len(self._recent) > 1:
                self._recent_requests -= self._recent.popleft()[0]

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = sum(q for _, q, _ in self._recent)
        return sum(h for _, _, h in self._recent) / queries if queries else 0.0

    def as_dict(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        return {
            "num_running_reqs": self.scheduler.num_running_reqs,
            "num_waiting_reqs": self.scheduler.num_waiting_reqs,
            "kv_cache_usage": self.scheduler.kv_cache_usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_finished_requests": self.num_finished_requests,
            "elapsed_s": elapsed,
            "prompt_throughput": self.num_prompt_tokens / elapsed,
            "generation_throughput": self.num_generation_tokens / elapsed,
            **(
                self.spec_decoding.summary(self.num_speculative_tokens)
                if self.spec_decoding is not None
                else {}
            ),
            **(
                {f"kv_{k}": v for k, v in msgspec.structs.asdict(self.kv_transfer).items()}
                if self.kv_transfer is not None
                else {}
            ),
        }

    def log_line(self, now: float | None = None) -> str:
        """vLLM-style summary since the previous call."""
        now = time.monotonic() if now is None else now
        last_time, last_prompt, last_gen = self._last_log
        interval = max(now - last_time, 1e-9)
        self._last_log = (now, self.num_prompt_tokens, self.num_generation_tokens)
        s = self.scheduler
        return (
            f"Avg prompt throughput: {(self.num_prompt_tokens - last_prompt) / interval:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(self.num_generation_tokens - last_gen) / interval:.1f} tokens/s, "
            f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
            f"KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%"
            + self._spec_log_part()
        )

    def _spec_log_part(self) -> str:
        spec = self._spec_since_log
        if spec is None or spec.num_drafts == 0:
            return ""
        self._spec_since_log = SpecDecodingStats()
        summary = spec.summary(self.num_speculative_tokens)
        per_pos = ", ".join(
            f"{v:.2f}" for k, v in summary.items() if k.startswith("spec_acceptance_pos_")
        )
        return (
            f", Spec decode: mean acceptance length "
            f"{summary['spec_mean_acceptance_length']:.2f}, acceptance rate "
            f"{summary['spec_acceptance_rate'] * 100:.1f}%, drafted "
            f"{spec.num_draft_tokens} / accepted {spec.num_accepted_tokens} tokens, "
            f"per-position acceptance [{per_pos}]"
        )

    def maybe_log(self) -> None:
        if 0 < self.log_interval_s <= time.monotonic() - self._last_log[0]:
            logger.info(self.log_line())


class LLMEngine:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        if config.parallel_config.data_parallel_size > 1:
            # One engine core steps here, in the caller's thread; several replicas need the
            # asyncio front end that routes requests between their processes.
            raise ValueError(
                f"data_parallel_size {config.parallel_config.data_parallel_size}: data "
                "parallelism is served by `pagedinfer serve --data-parallel-size N` (AsyncLLM); "
                "the offline LLM / LLMEngine run one engine core (data_parallel_size 1)."
            )
        self.config = config
        self.tokenizer = Tokenizer.from_model_path(config.model_config.model)
        self.engine_core = EngineCore(config, executor_class)
        self.max_model_len = self.engine_core.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.engine_core.model_info.vocab_size,
            self.max_model_len,
            config.structured_outputs_config,
            config.kv_transfer_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.stats = EngineStats(
            config.observability_config.log_stats_interval_s, num_speculative_tokens(config)
        )

    def shutdown(self) -> None:
        """Stop the engine core and its workers (worker processes, with tensor or pipeline
        parallelism); the engine cannot be used afterwards."""
        self.engine_core.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Validate and queue one request; raises ValueError for bad input (nothing queued).
        With `pooling_params` it is a pooling request (`params` from
        `pooling_sampling_params`): its one output carries `pooled`."""
        self._check_unused(request_id)
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, pooling_params
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
        parent, children = split_request(request)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests run."""
        return self.engine_core.reset_prefix_cache()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        removed = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(removed)

    def step(self) -> list[RequestOutput]:
        """One engine core step and the request outputs it completed. After a step that
        made no progress (a grammar compiling, a KV transfer pending) it waits the core's
        poll interval, so that a `while engine.has_unfinished_requests(): engine.step()`
        loop does not spin."""
        outputs, progressed = self.engine_core.step()
        if not progressed:
            time.sleep(self.engine_core.poll_interval_s())
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self.stats.record_scheduler(outputs.scheduler_stats)
        self.stats.num_generation_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
        self.stats.num_finished_requests += sum(1 for o in processed.request_outputs if o.finished)
        self.stats.maybe_log()
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()


def num_speculative_tokens(config: EngineConfig) -> int | None:
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None else None
