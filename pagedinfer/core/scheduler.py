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

What the scheduler owns between steps (queues, KV cache manager, KV-transfer tracker,
counters) and the operations outside the step (add, abort, free, preempt, stats) are in
`core/sched_state.py`; the per-request arithmetic (stop conditions, prompt chunk sizes) is
in `core/sched_utils.py`.

Called by `engine.core.EngineCore`; pure Python, no torch.
"""

from __future__ import annotations

import enum

from pagedinfer.core.block_pool import KVCacheBlock
from pagedinfer.core.kv_transfer_tracker import restart_without_loaded_kv
from pagedinfer.core.messages import EngineCoreOutput, EngineCoreOutputs, LogprobsLists
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedinfer.core.sched_state import SchedulerState
from pagedinfer.core.sched_utils import (
    PrefixMatch,
    StepState,
    append_generated,
    num_new_prompt_tokens,
)
from pagedinfer.core.trace import StepTracer

__all__ = ["Scheduler"]


class _Head(enum.Enum):
    """Whether the head of the waiting queue can start (`_prepare_waiting_head`)."""

    READY = enum.auto()
    NOT_READY = enum.auto()
    """It keeps its place and the pass goes on with the next request."""
    FINISHED = enum.auto()
    """It left the queue, finished (its grammar failed to compile)."""


class Scheduler(SchedulerState):
    """The step algorithm over `SchedulerState`: `schedule()` and `update_from_output()`."""

    # ------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """One step's batch: the running requests first (`_schedule_running`), then, if that
        preempted nothing, waiting ones (`_schedule_waiting`); then the output for the
        workers, with `num_computed_tokens` advanced optimistically."""
        step = StepState(self.max_num_scheduled_tokens, self._max_reqs_this_step())
        if self.prefill_budget is not None and any(_is_decoding(r) for r in self.running):
            step.prefill_budget = self.prefill_budget.tokens
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        self._last_step_prefill_tokens = sum(
            step.num_scheduled_tokens[req_id] for req_id in step.prefilling
        )
        self._last_step_had_decodes = len(step.num_scheduled_tokens) > len(step.prefilling)
        return self._build_output(step)

    def observe_step_time(self, seconds: float) -> None:
        """The engine core timed the step `schedule()` last returned (forward and
        sampling): the prompt-token budget of steps with decodes follows it."""
        if self.prefill_budget is not None:
            self.prefill_budget.observe(
                seconds, self._last_step_prefill_tokens, self._last_step_had_decodes
            )

    def _max_reqs_this_step(self) -> int:
        """Pipeline parallelism: split the live requests over pp batches, so that every
        stage has one to work on (a single batch of everything would leave the other
        stages idle while it passes through)."""
        if self.pipeline_parallel_size == 1:
            return self.max_num_running_reqs
        live = len(self.running) + len(self.waiting)
        return max(1, -(-live // self.pipeline_parallel_size))

    def _schedule_running(self, step: StepState) -> None:
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
            prefilling = not _is_decoding(request)
            num_new_tokens = min(
                num_new_tokens,
                step.token_budget,
                step.prefill_budget if prefilling else num_new_tokens,
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
            if prefilling:
                step.prefill_budget -= num_new_tokens
                step.prefilling.add(request.request_id)
            req_index += 1
            if request.spec_token_ids:
                # The drafts that fit (budget, max_model_len) go to the workers; the rest
                # are dropped. New drafts come with this step's output.
                num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
                if num_spec > 0:
                    step.scheduled_spec[request.request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []

    def _preempt_until_fits(
        self, step: StepState, request: Request, num_new_tokens: int, req_index: int
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
                given_back = step.num_scheduled_tokens.pop(victim.request_id)
                step.token_budget += given_back
                if victim.request_id in step.prefilling:
                    step.prefilling.discard(victim.request_id)
                    step.prefill_budget += given_back
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

    def _schedule_waiting(self, step: StepState) -> None:
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
            and step.prefill_budget > 0
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
            num_new_tokens = num_new_prompt_tokens(
                self.config, request, match, min(step.token_budget, step.prefill_budget)
            )
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
        load makes it schedulable (`KVTransferTracker.load_arrived`), and so does a compiled
        grammar;
        a grammar that failed finishes it with the error (reported by the next
        `update_from_output`) and takes it out of the queue."""
        if request.request_id in self.in_flight:
            return _Head.NOT_READY
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert self.kv_transfer is not None
            if not self.kv_transfer.load_arrived(request):
                return _Head.NOT_READY
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

    def _match_computed_tokens(self, request: Request) -> PrefixMatch | None:
        """The prompt tokens of a waiting request that need no computing: on its first
        schedule (and after a preemption), its local prefix-cache hit plus the tokens its KV
        connector can provide, always leaving the last prompt token to compute (its logits
        are needed); after an asynchronous load, the tokens it loaded. None while the
        connector cannot tell yet."""
        if request.num_computed_tokens != 0:
            return PrefixMatch([], 0, 0, False, request.num_computed_tokens)
        computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.kv_transfer is not None:
            external = self.kv_transfer.num_external_tokens(request, num_local)
            if external is None:
                return None
            num_external, load_async = external
        return PrefixMatch(
            computed_blocks, num_local, num_external, load_async, num_local + num_external
        )

    def _admit_waiting_head(
        self,
        step: StepState,
        request: Request,
        match: PrefixMatch,
        num_new_tokens: int,
        new_blocks: list[KVCacheBlock],
    ) -> bool:
        """Take the head of the waiting queue, its slots allocated, out of the queue: it
        runs in this step (True), or, with an asynchronous load, waits for its KV, its
        prefix counted as computed once the load is reported finished (False)."""
        if self.kv_transfer is not None:
            self.kv_transfer.after_alloc(request, match.num_external)
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
        step.prefill_budget -= num_new_tokens
        step.prefilling.add(request.request_id)
        return True

    def _build_output(self, step: StepState) -> SchedulerOutput:
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
        if self.kv_transfer is not None:
            output.kv_connector_metadata = self.kv_transfer.connector.build_connector_meta(output)
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

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """Blocks whose KV load failed: the requests that loaded them recompute their prompt
        without the connector (`kv_load_failure_policy` "recompute") or finish with an error
        ("fail"). Returns the requests whose output of this step must be dropped (it was
        computed on the bad KV)."""
        assert self.kv_transfer is not None
        failed = self.kv_transfer.find_failed_loads(self.requests.values(), invalid_block_ids)
        fail = self.kv_transfer.failure_policy == "fail"
        for request in failed:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not fail:
                continue  # WAITING_FOR_REMOTE_KVS: restarts when its load is reported done
            else:
                self.waiting.remove(request)
            if fail:
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = "KV transfer failed: the loaded KV cache was invalid"
                self._finished_waiting.append(request)
                continue
            restart_without_loaded_kv(self.kv_cache_manager, request)
            request.num_cached_tokens = -1
            request.spec_token_ids = []
            self.waiting.prepend(request)
        return {r.request_id for r in failed}

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
                grammar=(
                    None
                    if request.structured_output_request is None
                    else request.structured_output_request.backend
                ),
            )

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
            new_token_ids = append_generated(
                request, generated, self.max_model_len, self.structured_output_manager
            )
            pooled = runner_output.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request ends with its prefill
                request.status = RequestStatus.FINISHED_STOPPED
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
                    pooled=pooled,
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
            assert self.kv_transfer is not None
            self.kv_transfer.update_from_output(kv_output, self.requests)
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


def _is_decoding(request: Request) -> bool:
    """Whether a running request computes one token a step (its next, plus any drafts)
    rather than its prompt (or, resumed after a preemption, its outputs again)."""
    return request.num_tokens - request.num_computed_tokens <= 1
