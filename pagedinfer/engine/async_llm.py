"""`AsyncLLM`: the asyncio front end of the engine (what the API server uses).

    engine = AsyncLLM.from_options(max_model_len=2048)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(out.outputs[0].text)

As in vLLM: input processing (validation, tokenization) and output processing (incremental
detokenization, stop strings, logprobs, n > 1 fan-in) run here, in the caller's process; the
engine core runs behind an `EngineCoreClient` (its own process by default). One background
task (`_output_handler`) pulls every step's outputs from the client and puts each request's
`RequestOutput`s into that request's `RequestOutputCollector`; `generate()` only waits on
its collector. A consumer that goes away (the generator closed or cancelled: a client that
disconnected) aborts its request in the engine at once, freeing its KV blocks. When the
engine dies, every waiting `generate()` raises `EngineDeadError` and later calls fail fast.
With `data_parallel_size > 1` the client is a `DPAsyncMPClient`: several engine cores, each
new request routed to the least loaded (see `engine/dp_client.py`); nothing else changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from pagedinfer.config import EngineConfig, build_engine_config
from pagedinfer.core.messages import EngineCoreRequest
from pagedinfer.engine.core_client import (
    AsyncMPClient,
    EngineCoreClient,
    EngineDeadError,
    InprocClient,
)
from pagedinfer.engine.dp_client import DPAsyncMPClient
from pagedinfer.engine.input_processor import InputProcessor, PromptType, pooling_sampling_params
from pagedinfer.engine.llm_engine import EngineStats, num_speculative_tokens
from pagedinfer.engine.metrics import IterationStats, StatLogger
from pagedinfer.engine.output_processor import OutputProcessor, split_request
from pagedinfer.logging_utils import setup_logging
from pagedinfer.outputs import RequestOutput
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams
from pagedinfer.tokenizer import Tokenizer

logger = logging.getLogger("pagedinfer")

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputCollector"]


class RequestOutputCollector:
    """One request's outputs on their way from the output handler to `generate()`.

    If the consumer falls behind, DELTA outputs are merged (text and tokens appended) and
    CUMULATIVE ones replaced by the newest, so a slow client never makes the queue grow.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._item is None or isinstance(item, BaseException):
            self._item = item
        elif isinstance(self._item, RequestOutput):
            if self.output_kind == RequestOutputKind.DELTA:
                self._item.add(item)
            else:
                self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._item is None:
            await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


def _make_engine_core_client(config: EngineConfig, multiprocess: bool) -> EngineCoreClient:
    """One engine core process (`AsyncMPClient`), one per data-parallel replica behind a
    load-balancing client (`DPAsyncMPClient`), or the core in this process (`InprocClient`,
    tests and debugging)."""
    if config.parallel_config.data_parallel_size > 1:
        if not multiprocess:
            raise ValueError(
                f"data_parallel_size {config.parallel_config.data_parallel_size} runs one "
                "engine core process per replica: it needs multiprocess=True."
            )
        return DPAsyncMPClient(config)
    return AsyncMPClient(config) if multiprocess else InprocClient(config)


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, multiprocess: bool = True) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_model_path(config.model_config.model)
        self.engine_core = _make_engine_core_client(config, multiprocess)
        info = self.engine_core.info
        self.max_model_len = info.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer,
            info.vocab_size,
            info.max_model_len,
            config.structured_outputs_config,
            config.kv_transfer_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.stats = EngineStats(
            config.observability_config.log_stats_interval_s, num_speculative_tokens(config)
        )
        self.stat_loggers: list[StatLogger] = []
        """Given every step's statistics (the server adds its Prometheus logger here)."""
        self._handler: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None

    @classmethod
    def from_options(cls, model: str | None = None, *, multiprocess: bool = True, **kwargs: Any):
        """Like `LLM(model, **kwargs)`: flat engine options routed to the config sections."""
        setup_logging()
        return cls(build_engine_config(model=model, **kwargs), multiprocess=multiprocess)

    # ------------------------------------------------------------------------- health

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.is_dead

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is gone."""
        if self.errored:
            raise self._dead_error or EngineDeadError("Engine core is dead.")

    # ------------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as the engine produces them (shaped by
        `sampling_params.output_kind`); ValueError at once for bad input. With
        `pooling_params` (see `encode`), one final output carrying `pooled`."""
        await self.check_health()
        self._ensure_handler()
        if request_id in self.output_processor.request_states or (
            request_id in self.output_processor.parent_requests
        ):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        request, prompt_text = self.input_processor.process(
            request_id, prompt, sampling_params, arrival_time, priority, pooling_params
        )
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        self._add(request, prompt_text, collector)
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # cancelled, closed early, or the engine died
                self._abort([request_id])

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """A pooling request: `prompt` runs through the model (batched with whatever else
        runs) and its hidden states come back pooled, in `RequestOutput.pooled`."""
        params = pooling_sampling_params(truncate_prompt_tokens)
        final = None
        async for out in self.generate(
            prompt, params, request_id, priority=priority, pooling_params=pooling_params
        ):
            final = out
        assert final is not None
        return final

    def _add(
        self, request: EngineCoreRequest, prompt_text: str | None, collector: RequestOutputCollector
    ) -> None:
        num_prompt_tokens = len(request.prompt_token_ids) * request.sampling_params.n
        self.stats.num_prompt_tokens += num_prompt_tokens
        for stat_logger in self.stat_loggers:
            stat_logger.record_prompt_tokens(num_prompt_tokens)
        parent, children = split_request(request)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index, queue=collector)
            self.engine_core.add_request(child)

    def _abort(self, request_ids: list[str]) -> None:
        iteration_stats = IterationStats() if self.stat_loggers else None
        removed = self.output_processor.abort_requests(request_ids, iteration_stats)
        if iteration_stats is not None and removed:
            for stat_logger in self.stat_loggers:
                stat_logger.record(None, iteration_stats)
        if removed and not self.engine_core.is_dead:
            self.engine_core.abort_requests(removed)

    async def abort(self, request_id: str) -> None:
        self._abort([request_id])

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_core.call_utility("reset_prefix_cache"))

    async def get_kv_cache_usage(self) -> float:
        return float(await self.engine_core.call_utility("get_kv_cache_usage"))

    async def get_scheduler_stats(self) -> dict[str, float]:
        """The engine core's running / waiting counts and KV usage, asked now."""
        return dict(await self.engine_core.call_utility("get_scheduler_stats"))

    def get_stats(self) -> dict[str, float]:
        return self.stats.as_dict()

    # ------------------------------------------------------------------ output handler

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(
                self._output_handler(), name="pagedinfer-output-handler"
            )

    async def _output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output()
                iteration_stats = IterationStats() if self.stat_loggers else None
                processed = self.output_processor.process_outputs(
                    outputs.outputs, outputs.timestamp, iteration_stats
                )
                for stat_logger in self.stat_loggers:
                    stat_logger.record(outputs.scheduler_stats, iteration_stats)
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                if outputs.scheduler_stats is not None:
                    self.stats.record_scheduler(outputs.scheduler_stats)
                self.stats.num_generation_tokens += sum(
                    len(o.new_token_ids) for o in outputs.outputs
                )
                self.stats.num_finished_requests += sum(1 for o in outputs.outputs if o.finished)
                self.stats.maybe_log()
        except EngineDeadError as exc:
            self._dead_error = exc
            self._fail_all(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("Output handler failed.")
            self._dead_error = EngineDeadError(f"Output handler failed: {exc}")
            self._fail_all(self._dead_error)

    def _fail_all(self, exc: BaseException) -> None:
        queues = {id(s.queue): s.queue for s in self.output_processor.request_states.values()}
        queues.update(
            {id(p.queue): p.queue for p in self.output_processor.parent_requests.values()}
        )
        for q in queues.values():
            if q is not None:
                q.put(exc)
        self.output_processor.request_states.clear()
        self.output_processor.parent_requests.clear()

    def shutdown(self) -> None:
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self.engine_core.shutdown()

    def __del__(self) -> None:
        try:
            self.engine_core.shutdown()
        except Exception:
            pass
