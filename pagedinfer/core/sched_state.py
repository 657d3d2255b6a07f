"""What the scheduler owns between steps, and the operations that are not the step itself.

`SchedulerState` holds the requests (by id, the waiting queue, the running list), the KV
cache manager, the KV-transfer tracker, the speculative-decoding and preemption counters,
and the optional tracer and guided-decoding manager the engine core sets. It adds, aborts,
frees and preempts requests and makes the stats. `core/scheduler.py`'s `Scheduler`
extends it with the step algorithm (`schedule()`, `update_from_output()`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedinfer.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.kv_transfer_tracker import KVTransferTracker
from pagedinfer.core.messages import SchedulerStats, SpecDecodingStats
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.request_queue import create_request_queue
from pagedinfer.core.step_budget import PrefillBudget
from pagedinfer.core.trace import StepTracer

if TYPE_CHECKING:
    from pagedinfer.distributed.kv_transfer.base import KVConnectorBase
    from pagedinfer.structured_output.manager import StructuredOutputManager

__all__ = ["SchedulerState"]

# PrefillBudget's bounds: a step with decodes computes at least this many prompt tokens
# (prompts progress however heavy the decodes are), and starts from the second before its
# first measurement.
_MIN_PREFILL_TOKENS = 32
_INITIAL_PREFILL_TOKENS = 64


class SchedulerState:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        pipeline_parallel_size: int = 1,
        kv_connector: KVConnectorBase | None = None,
        kv_load_failure_policy: str = "recompute",
    ) -> None:
        self.config = scheduler_config
        # Pipeline parallelism: stages before the last never sample, so they are sent each
        # step's tokens, and the live requests are split over the batches in flight.
        self.pipeline_parallel_size = pipeline_parallel_size
        # Pipeline parallelism: requests in a batch still in the pipeline (the engine core
        # keeps this); a preempted one is not resumed until its old batch is back.
        self.in_flight: set[str] = set()
        self.max_model_len = max_model_len
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        # Prompt tokens per step while requests decode, sized from measured step times.
        self.prefill_budget: PrefillBudget | None = None
        if (
            scheduler_config.step_latency_target_ms > 0
            and scheduler_config.enable_chunked_prefill
            and pipeline_parallel_size == 1  # several batches in flight: no step to time
        ):
            self.prefill_budget = PrefillBudget(
                scheduler_config.step_latency_target_ms / 1000,
                max_tokens=self.max_num_scheduled_tokens,
                min_tokens=_MIN_PREFILL_TOKENS,
                initial=_INITIAL_PREFILL_TOKENS,
            )
        self._last_step_prefill_tokens = 0
        self._last_step_had_decodes = False
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            max_model_len=max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests finished since the last schedule(); sent to workers so they drop state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Optional step recorder (core/trace.py), set by the engine core.
        self.tracer: StepTracer | None = None
        # Guided decoding (structured_output/manager.py), set by the engine core.
        self.structured_output_manager: StructuredOutputManager | None = None
        # Requests finished while waiting (a grammar that failed to compile): reported by
        # the next update_from_output.
        self._finished_waiting: list[Request] = []
        # Speculative decoding: drafts arrive with each ModelRunnerOutput and are scheduled
        # (with their KV slots) the next step. Drafters that run a model write KV for the
        # drafts they feed back in, `num_lookahead_tokens` slots past the scheduled ones.
        self.num_lookahead_tokens = 0
        if speculative_config is not None and speculative_config.method in ("draft_model", "eagle"):
            self.num_lookahead_tokens = speculative_config.num_speculative_tokens
        self._spec_stats: SpecDecodingStats | None = (
            SpecDecodingStats() if speculative_config is not None else None
        )
        # KV transfer (disaggregated prefill): the connector and what is in flight.
        self.kv_transfer: KVTransferTracker | None = (
            KVTransferTracker(kv_connector, self.kv_cache_manager, kv_load_failure_policy)
            if kv_connector is not None
            else None
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or (
            self.kv_transfer is not None and request.request_id in self.kv_transfer.held_requests
        ):
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step loop (aborts): blocks are freed at once."""
        assert RequestStatus.is_finished(status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a remote reader, or loads in flight: the workers must keep being
        polled (`get_finished`) even with nothing to compute."""
        return self.kv_transfer is not None and self.kv_transfer.has_pending(self.waiting)

    def _free_request(self, request: Request) -> dict[str, object] | None:
        """Free a finished request's blocks, unless its KV connector holds them for a
        remote reader; returns the connector's `kv_transfer_params` for the client."""
        assert request.is_finished()
        params = None
        if self.kv_transfer is not None:
            params = self.kv_transfer.request_finished(request)
        else:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.tracer is not None:
            self.tracer.note_preempted(request.request_id)
        self.waiting.prepend(request)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions_total,
            prefix_cache_requests=prefix.requests if prefix else 0,
            prefix_cache_queries=prefix.queries if prefix else 0,
            prefix_cache_hits=prefix.hits if prefix else 0,
            prefix_cache_reset=prefix.reset if prefix else False,
            spec_decoding=self._take_spec_stats(),
            kv_transfer=self.kv_transfer.take_stats() if self.kv_transfer is not None else None,
        )

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        """The drafts verified since the last call (and start counting anew)."""
        stats = self._spec_stats
        if stats is None or stats.num_drafts == 0:
            return None
        self._spec_stats = SpecDecodingStats()
        return stats
