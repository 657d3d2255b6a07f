"""The engine core: scheduler + executor, advanced one step at a time.

`EngineCore.step()` is the heartbeat (vLLM's design):
    schedule -> execute_model -> (grammar bitmask) -> sample_tokens -> update_from_output.
Every batch takes that one path through a batch queue (one batch, or one per pipeline stage
in flight). `step()` never sleeps: it reports whether it made progress, and its drivers
(`LLMEngine.step`, `InprocClient`, the busy loop of `EngineCoreProc`) wait
`poll_interval_s()` when it did not.

Startup: load the model on the executor, derive `max_model_len` and the number of KV blocks,
check that one full-length request fits in the cache, allocate the cache, build the
scheduler. The derived values are kept here (never written back into the frozen config).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from pagedinfer.config import EngineConfig
from pagedinfer.core.kv_cache_utils import BlockHasher, get_hash_fn
from pagedinfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.sched_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedinfer.core.scheduler import Scheduler
from pagedinfer.core.trace import StepTracer
from pagedinfer.distributed.kv_transfer.base import KVConnectorRole
from pagedinfer.distributed.kv_transfer.factory import create_connector
from pagedinfer.executor.base import Executor, ModelInfo

logger = logging.getLogger("pagedinfer")

__all__ = ["EngineCore"]


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        """`executor_class`: by default the one `distributed_executor_backend` names."""
        self.config = config
        if executor_class is None:
            executor_class = Executor.get_class(config)
        self.executor = executor_class(config)
        try:
            self._init_after_executor(config)
        except BaseException:
            self.executor.shutdown()  # worker processes must not outlive a failed start
            raise

    def _init_after_executor(self, config: EngineConfig) -> None:
        info = self.executor.load_model()
        self.model_info = info
        self.max_model_len = self._resolve_max_model_len(info)
        block_size = config.cache_config.block_size
        self.executor.initialize_cache(info.num_kv_blocks, self.max_model_len)
        self.kv_connector = create_connector(config, KVConnectorRole.SCHEDULER)
        kv_config = config.kv_transfer_config
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_kv_blocks=info.num_kv_blocks,
            max_model_len=self.max_model_len,
            speculative_config=config.speculative_config,
            pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
            kv_connector=self.kv_connector,
            kv_load_failure_policy=(
                kv_config.kv_load_failure_policy if kv_config is not None else "recompute"
            ),
        )
        if kv_config is not None:
            logger.info(
                "KV transfer: %s as %s (engine %s).",
                kv_config.kv_connector, kv_config.kv_role, kv_config.engine_id,
            )  # fmt: skip
        # Batches launched and not yet finished (`step`): one, or under pipeline parallelism
        # up to one per stage, each as its output or (in flight) a future of it.
        self.batch_queue_size = self.executor.max_concurrent_batches
        self.batch_queue: deque[
            tuple[ModelRunnerOutput | Future[ModelRunnerOutput], SchedulerOutput]
        ] = deque()
        self.peak_batches_in_flight = 0
        cache_config = config.cache_config
        self.block_hasher: BlockHasher | None = None
        if cache_config.enable_prefix_caching:
            self.block_hasher = BlockHasher(
                block_size, get_hash_fn(cache_config.prefix_caching_hash_algo)
            )
        from pagedinfer.structured_output.manager import StructuredOutputManager

        self.structured_output_manager = StructuredOutputManager(
            config, info.vocab_size, config.scheduler_config.max_num_seqs, self.max_model_len
        )
        self.scheduler.structured_output_manager = self.structured_output_manager
        # Set when anything changed the scheduler since the last snapshot sent while idle.
        self._stats_dirty = False
        self.tracer: StepTracer | None = None
        trace_path = config.observability_config.trace_path
        if trace_path:
            self.tracer = StepTracer(trace_path, block_size, info.num_kv_blocks)
            self.scheduler.tracer = self.tracer
            self.scheduler.kv_cache_manager.block_pool.tracer = self.tracer
        capacity_tokens = info.num_kv_blocks * block_size
        logger.info(
            "Model %s loaded in %.2f s (dtype %s, max_model_len %d).",
            config.model_config.model or "SmolLM2-135M-Instruct (default GGUF)",
            info.load_time_s,
            info.dtype,
            self.max_model_len,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens); maximum concurrency for "
            "%d-token requests: %.2fx.",
            info.num_kv_blocks,
            block_size,
            info.num_kv_blocks * info.kv_bytes_per_block / 2**20,
            capacity_tokens,
            self.max_model_len,
            capacity_tokens / self.max_model_len,
        )

    def _resolve_max_model_len(self, info: ModelInfo) -> int:
        capacity = info.num_kv_blocks * self.config.cache_config.block_size
        requested = self.config.model_config.max_model_len
        if requested is not None:
            if requested > info.max_position_embeddings:
                raise ValueError(
                    f"max_model_len {requested} exceeds the model's context length "
                    f"{info.max_position_embeddings}."
                )
            if requested > capacity:
                raise ValueError(
                    f"The KV cache holds {capacity} tokens, fewer than max_model_len "
                    f"{requested}: raise kv_cache_memory_bytes or lower max_model_len."
                )
            return requested
        if capacity < info.max_position_embeddings:
            logger.warning(
                "KV cache (%d tokens) is smaller than the model context (%d): "
                "max_model_len capped to %d.",
                capacity,
                info.max_position_embeddings,
                capacity,
            )
        return min(info.max_position_embeddings, capacity)

    def add_request(self, request: EngineCoreRequest) -> None:
        req = Request.from_engine_core_request(request, self.block_hasher)
        if req.sampling_params.structured_outputs is not None:
            req.status = RequestStatus.WAITING_FOR_FSM
            self.structured_output_manager.grammar_init(req)
        self.scheduler.add_request(req)
        self._stats_dirty = True

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._stats_dirty = True

    def idle_outputs(self) -> EngineCoreOutputs | None:
        """One scheduler snapshot as the engine goes idle, if anything changed since the last.

        Step outputs carry the scheduler's state *before* later aborts freed their blocks;
        without this, a front end's gauges (running, waiting, KV usage) would keep the last
        busy step's values until the next request arrives."""
        if not self._stats_dirty or self.scheduler.has_unfinished_requests():
            return None
        self._stats_dirty = False
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_kv_transfers(self) -> bool:
        """Held blocks or loads in flight: a busy loop keeps stepping (the workers report
        finished transfers only when stepped), even with no unfinished request."""
        return self.kv_connector is not None and self.scheduler.has_pending_kv_transfers()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    # Utility methods the front end may call (protocol.UTILITY_METHODS).
    def get_kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    def get_scheduler_stats(self) -> dict[str, Any]:
        """The scheduler's state now (running, waiting, KV usage; prefix-cache counters are
        left for the step outputs to carry)."""
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "kv_cache_usage": self.scheduler.kv_cache_manager.usage,
        }

    def ping(self) -> str:
        return "pong"

    def poll_interval_s(self) -> float:
        """How long a driver of `step()` waits after a step that made no progress before it
        steps again: 1 ms while requests wait (for a grammar compile, a KV load or a batch
        slot), 10 ms when only blocks held for a remote reader are left, 0 with nothing."""
        if self.scheduler.has_unfinished_requests():
            return 0.001
        return 0.01 if self.has_pending_kv_transfers() else 0.0

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """One engine step: the outputs, and whether it made progress (ran or launched a
        batch, or emitted, loaded or transferred anything). A driver that gets False waits
        `poll_interval_s()` before the next step instead of spinning; `step()` never sleeps.

        Every batch goes through the batch queue: schedule, launch (`_launch`), and once the
        queue is full, finish the oldest (`_finish_oldest`). Without pipeline parallelism the
        queue holds one batch, launched and finished in the same step. With it, up to one
        batch per stage is in flight: the next is scheduled and launched while earlier ones
        are still in the pipeline, and only then is the oldest waited for. A request runs in
        one in-flight batch at a time: its `num_computed_tokens` advanced when it was
        scheduled, so it has nothing to run until its batch returns (and the scheduler leaves
        a preempted request waiting while its old batch is in flight)."""
        sched = self.scheduler
        unrun_outputs: EngineCoreOutputs | None = None
        if len(self.batch_queue) < self.batch_queue_size and (
            sched.has_unfinished_requests() or self.has_pending_kv_transfers()
        ):
            scheduler_output = sched.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                self._launch(scheduler_output)
                if len(self.batch_queue) < self.batch_queue_size:
                    return EngineCoreOutputs(), True  # fill the pipeline first
            else:
                unrun_outputs, progressed = self._step_without_tokens(scheduler_output)
                if not self.batch_queue:
                    return unrun_outputs, progressed
        if not self.batch_queue:
            return EngineCoreOutputs(), False
        outputs = self._finish_oldest()
        if unrun_outputs is not None and unrun_outputs.outputs:
            outputs.outputs = unrun_outputs.outputs + outputs.outputs
        return outputs, True

    def _launch(self, scheduler_output: SchedulerOutput) -> None:
        """Start a batch with tokens and queue it: in one go (forward, grammar bitmask while
        it runs, sample) with a queue of one, asynchronously under pipeline parallelism."""
        requests = self.scheduler.requests
        if self.batch_queue_size == 1:
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            if runner_output is None:
                grammar_output = self.structured_output_manager.grammar_bitmask(
                    requests, scheduler_output
                )
                runner_output = self.executor.sample_tokens(grammar_output)
            # The prompt-token budget of steps with decodes follows their measured time.
            self.scheduler.observe_step_time(time.perf_counter() - start)
            self.batch_queue.append((runner_output, scheduler_output))
        else:
            grammar_output = self.structured_output_manager.grammar_bitmask(
                requests, scheduler_output
            )
            future = self.executor.execute_model_async(scheduler_output, grammar_output)
            self.batch_queue.append((future, scheduler_output))
            self.scheduler.in_flight.update(scheduler_output.num_scheduled_tokens)
        self.peak_batches_in_flight = max(self.peak_batches_in_flight, len(self.batch_queue))
        if self.tracer is not None:
            self.tracer.batch_launched()

    def _finish_oldest(self) -> EngineCoreOutputs:
        """Wait for the oldest queued batch and hand its output to the scheduler; the trace
        gets the batch's record (its scheduling, and the blocks its output freed)."""
        result, scheduler_output = self.batch_queue.popleft()
        runner_output = result.result() if isinstance(result, Future) else result
        sched = self.scheduler
        if sched.in_flight:
            sched.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        if self.tracer is not None:
            self.tracer.batch_finishing()
        outputs = sched.update_from_output(scheduler_output, runner_output)
        self._stats_dirty = True
        if self.tracer is not None:
            self.tracer.end_step(
                [o.request_id for o in outputs.outputs if o.finished],
                sched.kv_cache_manager.usage,
            )
        return outputs

    def _step_without_tokens(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[EngineCoreOutputs, bool]:
        """A schedule with nothing to compute: (outputs, whether anything progressed).

        With a KV connector the workers run its step anyway (loads may start, transfers
        finish); a poll where nothing was admitted, finished or transferred reports nothing
        (a front end would otherwise get a message per poll). Without one, only requests
        whose grammar is still compiling (or just failed) are left, nothing reaches the
        workers, and the requests finished since the last batch wait for the next one."""
        sched = self.scheduler
        if self.kv_connector is not None:
            runner_output = self.executor.execute_model(scheduler_output)
            assert runner_output is not None, "a step without tokens returns its output"
            outputs = sched.update_from_output(scheduler_output, runner_output)
            self._stats_dirty = True
            kv_output = runner_output.kv_connector_output
            meta = scheduler_output.kv_connector_metadata
            if (
                not outputs.outputs
                and (kv_output is None or kv_output.is_empty())
                and not (meta is not None and meta.loads)
            ):
                return EngineCoreOutputs(), False
            return outputs, True
        sched.finished_req_ids |= scheduler_output.finished_req_ids
        outputs = sched.update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
        return outputs, bool(outputs.outputs)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.tracer is not None:
            self.tracer.close()
        self.executor.shutdown()
