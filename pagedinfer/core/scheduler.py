"""Continuous-batching scheduler over a per-step token budget (vLLM V1's algorithm).

There are no prefill or decode phases: every request has `num_computed_tokens` and
`num_tokens_with_spec`, and each step hands out tokens so the former catches up with the
latter. A prompt chunk, a decode and speculative tokens are the same case.

`schedule()`:
1. RUNNING requests first, in order, while the token budget lasts. When the KV pool has no
   room, preempt (recompute) the newest running request (FCFS) or the worst-priority one,
   until the current request fits or is itself the victim.
2. WAITING requests (FCFS or by priority), only if nothing was preempted in this step,
   while budget and `max_num_seqs` allow. No preemption on behalf of waiting requests.
   Which ones are skipped (keeping their place) and what stops the pass: the docstring of
   `_schedule_waiting`.
3. `num_computed_tokens` is advanced optimistically at schedule time, so a chunked prefill
   continues next step without waiting for this step's output.

`update_from_output()` appends the sampled tokens, applies token-level stop conditions
(EOS, stop token ids, max_tokens, max_model_len; stop *strings* are the front end's job),
frees finished requests and returns `EngineCoreOutputs`.

Called by `engine.core.EngineCore`; pure Python, no torch.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedinfer.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedinfer.core.block_pool import KVCacheBlock
from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVTransferStats,
    LogprobsLists,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.request_queue import create_request_queue
from pagedinfer.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedinfer.core.trace import StepTracer

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
    from pagedinfer.distributed.kv_transfer.base import KVConnectorBase
    from pagedinfer.structured_output.manager import StructuredOutputManager

__all__ = ["Scheduler", "check_stop"]


@dataclass(slots=True)
class _StepState:
    """What one `schedule()` call has decided so far: the running pass fills it, the
    waiting pass adds to it, `_build_output` turns it into the `SchedulerOutput`."""

    token_budget: int
    max_reqs: int
    """Requests this step may schedule: `max_num_seqs`, or under pipeline parallelism a
    share of the live requests (`_max_reqs_this_step`)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks_of: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    scheduled_spec: dict[str, list[int]] = field(default_factory=dict)


class _PrefixMatch(NamedTuple):
    """The tokens of a waiting request that need no computing (`_match_computed_tokens`)."""

    computed_blocks: list[KVCacheBlock]
    """Blocks of the local prefix-cache hit."""
    num_local: int
    """Tokens of the local prefix-cache hit."""
    num_external: int
    """Tokens the KV connector provides after the local hit."""
    load_async: bool
    """The connector loads them over later steps; the request waits meanwhile."""
    num_computed: int
    """Tokens counted as computed once the request is admitted."""


class _Head(enum.Enum):
    """Whether the head of the waiting queue can start (`_prepare_waiting_head`)."""

    READY = enum.auto()
    NOT_READY = enum.auto()
    """It keeps its place and the pass goes on with the next request."""
    FINISHED = enum.auto()
    """It left the queue, finished (its grammar failed to compile)."""


class Scheduler:
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
        # KV transfer (disaggregated prefill, distributed/kv_transfer/): the scheduler-side
        # connector, requests whose asynchronous load finished, finished requests whose
        # blocks are held for a remote reader, and the transfer counters of this interval.
        self.connector = kv_connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.finished_recving_kv_req_ids: set[str] = set()
        self.held_requests: dict[str, Request] = {}
        self._kv_stats: KVTransferStats | None = (
            KVTransferStats() if kv_connector is not None else None
        )

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held_requests:
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
        return bool(self.held_requests) or any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting
        )

    def _free_request(self, request: Request) -> dict[str, object] | None:
        """Free a finished request's blocks, unless its KV connector holds them for a
        remote reader; returns the connector's `kv_transfer_params` for the client."""
        assert request.is_finished()
        hold, params = False, None
        if self.connector is not None:
            hold, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)
            )
        if hold:
            self.held_requests[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    # ------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """One step's batch: the running requests first (`_schedule_running`), then, if that
        preempted nothing, waiting ones (`_schedule_waiting`); then the output for the
        workers, with `num_computed_tokens` advanced optimistically."""
        step = _StepState(self.max_num_scheduled_tokens, self._max_reqs_this_step())
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return self._build_output(step)

    def _max_reqs_this_step(self) -> int:
        """Pipeline parallelism: split the live requests over pp batches, so that every
        stage has one to work on (a single batch of everything would leave the other
        stages idle while it passes through)."""
        if self.pipeline_parallel_size == 1:
            return self.max_num_running_reqs
        live = len(self.running) + len(self.waiting)
        return max(1, -(-live // self.pipeline_parallel_size))

    def _schedule_running(self, step: _StepState) -> None:
        """Schedule RUNNING requests in `self.running` order while the token budget and
        `step.max_reqs` last. Each asks for all its remaining tokens (the rest of its
        prompt, or its decode token plus drafts), capped by `long_prefill_token_threshold`,
        the budget and `max_model_len`; one with nothing to compute is passed over. When the
        KV pool cannot hold a request's slots, running requests are preempted until it fits
        (`_preempt_until_fits`); a request that is itself the victim ends the pass, since
        nothing after it could allocate either."""
        threshold = self.config.long_prefill_token_threshold
        req_index = 0
        while (
            req_index < len(self.running)
            and step.token_budget > 0
            and len(step.num_scheduled_tokens) < step.max_reqs
        ):
            request = self.running[req_index]
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(
                num_new_tokens,
                step.token_budget,
                self.max_model_len - 1 - request.num_computed_tokens,
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue

            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is None:
                new_blocks, req_index = self._preempt_until_fits(
                    step, request, num_new_tokens, req_index
                )
                if new_blocks is None:
                    break  # the request preempted itself

            step.scheduled_running.append(request)
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.new_blocks_of[request.request_id] = new_blocks
            step.token_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                # The drafts that fit (budget, max_model_len) go to the workers; the rest
                # are dropped. New drafts come with this step's output.
                num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    step.scheduled_spec[request.request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []

    def _preempt_until_fits(
        self, step: _StepState, request: Request, num_new_tokens: int, req_index: int
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt running requests (`_pick_victim`: the newest under FCFS, the worst
        priority otherwise) until `request`'s slots can be allocated. A victim already
        scheduled in this step gives its budget back. Returns the new blocks (None if
        `request` itself was preempted) and `request`'s index in `self.running`, which
        moves down when a victim before it leaves."""
        while True:
            victim = self._pick_victim()
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim_index < req_index:
                req_index -= 1
            if victim.request_id in step.num_scheduled_tokens:
                step.scheduled_running.remove(victim)
                step.token_budget += step.num_scheduled_tokens.pop(victim.request_id)
                step.new_blocks_of.pop(victim.request_id, None)
                step.scheduled_spec.pop(victim.request_id, None)
            self._preempt_request(victim)
            step.preempted.append(victim)
            if victim is request:
                return None, req_index
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_blocks is not None:
                return new_blocks, req_index

    def _schedule_waiting(self, step: _StepState) -> None:
        """Admit waiting requests while the budget, `max_num_seqs` and `step.max_reqs` allow.

        Order: the queue's. FCFS takes arrival order, except that preempted requests are put
        back at the front (so they resume first, in their original order); the priority
        policy takes the lowest `priority` value, then the earliest arrival, then the
        request id (`Request.__lt__`), preempted or not. `schedule` runs this pass only when
        the running pass preempted nothing: a step that had to free blocks for running
        requests has none to give new ones, and a waiting request never preempts.

        The head of the queue is *skipped* (set aside, and put back where it was when the
        pass ends, so it keeps its place for the next step) when it cannot start yet: its
        previous batch is still in the pipeline (`in_flight`), its asynchronous KV load has
        not finished, its grammar is still compiling, or the KV connector cannot tell yet
        how many of its tokens it has. A request admitted to an asynchronous load is set
        aside the same way (it waits in WAITING_FOR_REMOTE_KVS, holding its blocks). A
        request whose grammar failed leaves the queue, finished.

        The pass *stops* (nothing behind the head is admitted this step, as in vLLM, so a
        large head is not overtaken step after step by smaller requests taking the blocks
        and budget it waits for) when, with chunked prefill off, the head's prompt does not
        fit the remaining budget, or when the head's KV slots cannot be allocated. One
        exception to the latter: if other waiting requests hold blocks (their KV was loaded
        while they waited), the head is skipped instead. Those requests need only their
        last few blocks; with a pool they fill, nothing would ever run and free blocks.
        """
        skipped: list[Request] = []
        while (
            len(self.waiting) > 0
            and step.token_budget > 0
            and len(self.running) < self.max_num_running_reqs
            and len(step.num_scheduled_tokens) < step.max_reqs
        ):
            request = self.waiting.peek()
            head = self._prepare_waiting_head(request)
            if head is _Head.FINISHED:
                continue
            if head is _Head.NOT_READY:
                skipped.append(self.waiting.pop())
                continue
            match = self._match_computed_tokens(request)
            if match is None:  # the connector cannot tell yet
                skipped.append(self.waiting.pop())
                continue
            num_new_tokens = self._num_new_waiting_tokens(request, match, step.token_budget)
            if num_new_tokens is None:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=match.num_local,
                new_computed_blocks=match.computed_blocks,
                num_lookahead_tokens=0 if match.load_async else self.num_lookahead_tokens,
                num_external_computed_tokens=match.num_external,
                # Loaded KV is entered in the prefix cache only once it proved valid.
                delay_cache_blocks=match.num_external > 0,
            )
            if new_blocks is None:
                if self._others_waiting_hold_blocks(request):
                    skipped.append(self.waiting.pop())
                    continue
                break
            if not self._admit_waiting_head(step, request, match, num_new_tokens, new_blocks):
                skipped.append(request)

        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _prepare_waiting_head(self, request: Request) -> _Head:
        """Whether the head of the waiting queue can start now. A finished asynchronous
        load makes it schedulable (`_remote_kvs_arrived`), and so does a compiled grammar;
        a grammar that failed finishes it with the error (reported by the next
        `update_from_output`) and takes it out of the queue."""
        if request.request_id in self.in_flight:
            return _Head.NOT_READY
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.finished_recving_kv_req_ids:
                return _Head.NOT_READY
            self._remote_kvs_arrived(request)
        if request.status == RequestStatus.WAITING_FOR_FSM:
            so = request.structured_output_request
            assert so is not None
            if not so.is_ready():
                return _Head.NOT_READY
            if so.error is not None:
                self.waiting.pop()
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"structured outputs: {so.error}"
                self._finished_waiting.append(request)
                return _Head.FINISHED
            request.status = RequestStatus.WAITING
        return _Head.READY

    def _match_computed_tokens(self, request: Request) -> _PrefixMatch | None:
        """The prompt tokens of a waiting request that need no computing: on its first
        schedule (and after a preemption), its local prefix-cache hit plus the tokens its KV
        connector can provide, always leaving the last prompt token to compute (its logits
        are needed); after an asynchronous load, the tokens it loaded. None while the
        connector cannot tell yet."""
        if request.num_computed_tokens != 0:
            return _PrefixMatch([], 0, 0, False, request.num_computed_tokens)
        computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.connector is not None and not request.kv_load_failed:
            num_ext, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if num_ext is None:
                return None
            num_external = min(num_ext, request.num_tokens - 1 - num_local)
            if load_async and num_external <= 0:
                load_async, num_external = False, 0
        return _PrefixMatch(
            computed_blocks, num_local, num_external, load_async, num_local + num_external
        )

    def _num_new_waiting_tokens(
        self, request: Request, match: _PrefixMatch, token_budget: int
    ) -> int | None:
        """The tokens a waiting request computes this step: none while its KV loads (only
        the loaded tokens' slots are allocated), else the rest of its prompt capped by
        `long_prefill_token_threshold` and the budget. None when chunked prefill is off and
        the rest does not fit the budget."""
        if match.load_async:
            return 0
        num_new_tokens = request.num_tokens - match.num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
            return None
        return min(num_new_tokens, token_budget)

    def _admit_waiting_head(
        self,
        step: _StepState,
        request: Request,
        match: _PrefixMatch,
        num_new_tokens: int,
        new_blocks: list[KVCacheBlock],
    ) -> bool:
        """Take the head of the waiting queue, its slots allocated, out of the queue: it
        runs in this step (True), or, with an asynchronous load, waits for its KV, its
        prefix counted as computed once the load is reported finished (False)."""
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_block_ids(request.request_id),
                match.num_external,
            )  # fmt: skip
            if match.num_external:
                request.num_external_computed_tokens = match.num_external
        self.waiting.pop()
        request.num_computed_tokens = match.num_computed
        if match.load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return False
        step.new_blocks_of[request.request_id] = new_blocks  # fresh ones; hits in "cached"
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = match.num_computed
        step.scheduled_new.append(request)
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.token_budget -= num_new_tokens
        return True

    def _build_output(self, step: _StepState) -> SchedulerOutput:
        """The step's `SchedulerOutput` (batch order: running requests in running order,
        then new ones); then `num_computed_tokens` advances past the scheduled tokens."""
        num_scheduled_tokens = step.num_scheduled_tokens
        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        ordered = {r.request_id: num_scheduled_tokens[r.request_id] for r in step.scheduled_running}
        for r in step.scheduled_new:
            ordered[r.request_id] = num_scheduled_tokens[r.request_id]

        cached = CachedRequestData()
        for r in step.scheduled_running:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append([b.block_id for b in step.new_blocks_of[r.request_id]])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if self.pipeline_parallel_size > 1:
                end = min(r.num_computed_tokens + ordered[r.request_id], r.num_tokens)
                cached.new_token_ids.append(r.all_token_ids[r.num_computed_tokens : end])
        new_reqs = [
            NewRequestData.from_request(r, self.kv_cache_manager.get_block_ids(r.request_id))
            for r in step.scheduled_new
        ]
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=step.scheduled_spec,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted},
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        # A new set, not .clear(): the output keeps a reference to the old one.
        self.finished_req_ids = set()
        if self.tracer is not None:
            self._trace_scheduled(self.tracer, ordered, step.scheduled_new, step.new_blocks_of)
        for req_id, n in ordered.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        return output

    def _others_waiting_hold_blocks(self, request: Request) -> bool:
        """Whether a waiting request other than `request` holds KV blocks (only requests
        with an asynchronous load do)."""
        held = self.kv_cache_manager.req_to_blocks
        return any(r is not request and r.request_id in held for r in self.waiting)

    def _remote_kvs_arrived(self, request: Request) -> None:
        """The asynchronous load of a waiting request finished: enter the loaded blocks in
        the prefix cache and make it schedulable. After a failed load (see
        `_handle_invalid_blocks`) the request starts over and computes its prompt."""
        self.finished_recving_kv_req_ids.discard(request.request_id)
        if request.kv_load_failed:
            self._restart_without_loaded_kv(request)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.status = (
                RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            )

    def _restart_without_loaded_kv(self, request: Request) -> None:
        """Drop a request's blocks after a failed load (the bad ones were never entered in
        the prefix cache; its good local hits are found again) and make it compute its
        prompt from the start. The caller puts it in the waiting queue if it is not."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_external_computed_tokens = 0
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """Blocks whose KV load failed (missing, partial or corrupted): the requests that
        loaded them recompute their prompt without the connector (`kv_load_failure_policy`
        "recompute") or finish with an error ("fail"). Returns the requests whose output of
        this step must be dropped (it was computed on the bad KV)."""
        dropped: set[str] = set()
        for req_id, request in list(self.requests.items()):
            if request.num_external_computed_tokens == 0 or request.kv_load_failed:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            if invalid_block_ids.isdisjoint(block_ids):
                continue
            request.kv_load_failed = True
            dropped.add(req_id)
            if self._kv_stats is not None:
                self._kv_stats.num_failed_loads += 1
            logger.warning(
                "KV load failed for request %s (%d external tokens): %s.", req_id,
                request.num_external_computed_tokens,
                "finishing it with an error" if self.kv_load_failure_policy == "fail"
                else "recomputing its prompt",
            )  # fmt: skip
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.kv_load_failure_policy == "recompute":
                continue  # WAITING_FOR_REMOTE_KVS: restarts when its load is reported done
            else:
                self.waiting.remove(request)
            if self.kv_load_failure_policy == "fail":
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = "KV transfer failed: the loaded KV cache was invalid"
                self._finished_waiting.append(request)
                continue
            self._restart_without_loaded_kv(request)
            request.num_cached_tokens = -1
            request.spec_token_ids = []
            self.waiting.prepend(request)
        return dropped

    def _update_from_kv_xfer_finished(self, kv_output: KVConnectorOutput) -> None:
        """Finished loads make their requests schedulable; finished sends release held
        blocks. A request finished (aborted) while its load was in flight is held by its
        connector until the load ends: its blocks are still being written."""
        for req_id in kv_output.finished_recving:
            if req_id in self.requests:
                self.finished_recving_kv_req_ids.add(req_id)
            elif (request := self.held_requests.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(request)
        for req_id in kv_output.finished_sending:
            request = self.held_requests.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        if self._kv_stats is not None:
            self._kv_stats.add(kv_output.stats)
        assert self.connector is not None
        self.connector.update_connector_output(kv_output)

    def _trace_scheduled(
        self,
        tracer: StepTracer,
        ordered: dict[str, int],
        scheduled_new: list[Request],
        new_blocks_of: dict[str, list[KVCacheBlock]],
    ) -> None:
        """Report the step's scheduled chunks (before num_computed_tokens advances)."""
        new_ids = {r.request_id for r in scheduled_new}
        for req_id, n in ordered.items():
            request = self.requests[req_id]
            tracer.note_scheduled(
                req_id,
                start=request.num_computed_tokens,
                num_tokens=n,
                prompt_len=request.num_prompt_tokens,
                known=request.num_tokens,
                cached=request.num_computed_tokens if req_id in new_ids else 0,
                new_blocks=[b.block_id for b in new_blocks_of.get(req_id, [])],
            )

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

    # ---------------------------------------------------------------------- outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        logprobs = runner_output.logprobs
        kv_output = runner_output.kv_connector_output
        dropped: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            dropped = self._handle_invalid_blocks(set(kv_output.invalid_block_ids))
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in dropped:
                continue  # aborted while the step ran, or computed on KV that failed to load
            if request.status != RequestStatus.RUNNING:
                continue  # preempted while its (pipelined) batch ran: recomputed later
            req_index = runner_output.req_id_to_index[req_id]
            generated = runner_output.sampled_token_ids[req_index]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and generated:
                # The verified run: accepted drafts, then one more token. The rejected
                # drafts' KV slots are simply computed again (with the right tokens) later.
                num_accepted = len(generated) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                if self._spec_stats is not None:
                    self._spec_stats.observe_draft(len(drafts), num_accepted)
            new_token_ids: list[int] = []
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break
                if (
                    request.structured_output_request is not None
                    and self.structured_output_manager is not None
                    and (end := self.structured_output_manager.accept_token(request, token_id))
                ):
                    request.status = end  # the grammar is complete, or at a dead end
                    break
            prompt_logprobs = runner_output.prompt_logprobs_dict.get(req_id)
            if not new_token_ids and prompt_logprobs is None and not request.is_finished():
                continue
            new_logprobs = None
            if logprobs is not None and new_token_ids:
                # One row per generated token (several with speculative decoding).
                first = runner_output.logprobs_row_of(req_index)
                rows = slice(first, first + len(new_token_ids))
                new_logprobs = LogprobsLists(
                    logprob_token_ids=logprobs.logprob_token_ids[rows],
                    logprobs=logprobs.logprobs[rows],
                    sampled_token_ranks=logprobs.sampled_token_ranks[rows],
                )
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_external_cached_tokens=request.num_external_computed_tokens,
                )
            )
            if request.is_finished():
                stopped.append(request)

        for request in self._finished_waiting:
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                )
            )
            self._free_request(request)
        self._finished_waiting = []

        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            output_of = {o.request_id: o for o in outputs}
            for request in stopped:
                params = self._free_request(request)
                if params is not None:
                    output_of[request.request_id].kv_transfer_params = params
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output)
        if runner_output.draft_token_ids:
            self.update_draft_token_ids(runner_output.draft_token_ids)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Take the proposer's drafts for the next step. Requests that finished or are in
        the middle of their prompt take none; a draft is cut to the tokens the request may
        still generate (max_tokens) and, for guided requests, to what its grammar accepts."""
        manager = self.structured_output_manager
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            if request.max_tokens is not None:
                drafts = drafts[: max(0, request.max_tokens - request.num_output_tokens - 1)]
            if drafts and request.structured_output_request is not None and manager:
                drafts = manager.validate_tokens(request, drafts)
            request.spec_token_ids = list(drafts)

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
            kv_transfer=self._take_kv_stats(),
        )

    def _take_kv_stats(self) -> KVTransferStats | None:
        stats = self._kv_stats
        if stats is None or stats.is_empty():
            return None
        self._kv_stats = KVTransferStats()
        return stats

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        """The drafts verified since the last call (and start counting anew)."""
        stats = self._spec_stats
        if stats is None or stats.num_drafts == 0:
            return None
        self._spec_stats = SpecDecodingStats()
        return stats


def check_stop(request: Request, max_model_len: int) -> bool:
    """Apply token-level stop conditions after one appended token; sets the status."""
    params = request.sampling_params
    # The length caps come first: min_tokens can hold back a stop token, never run a
    # request past max_model_len (nor past max_tokens, which validation keeps >= min_tokens).
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False
