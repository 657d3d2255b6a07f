"""Front-end output processing: engine-core token outputs -> user-facing `RequestOutput`s.

Role: `OutputProcessor` keeps one `RequestState` per engine-core request. For every
`EngineCoreOutput` of a step it detokenizes the new ids, checks stop strings, converts logprobs
and builds a `RequestOutput` shaped by the request's `output_kind`:
- CUMULATIVE: all text / token ids / logprobs so far;
- DELTA: only what is new since the previous output (concatenating the deltas gives the
  CUMULATIVE result);
- FINAL_ONLY: one output, when the request finishes.

Stop strings are detected here, not in the engine core, so a request that hits one is finished
here and its id is returned in `reqs_to_abort`: the caller must abort it in the engine core.

`n > 1`: the caller creates a `ParentRequest` and submits `n` child requests (ids
`f"{i}_{parent_id}"`, each with `n=1`, seeds `seed + i`). Children's completions are merged into
one `RequestOutput` under the parent id with `outputs` ordered by index; it finishes when every
child has. Per step: CUMULATIVE carries every child seen so far, DELTA the children that
changed, FINAL_ONLY all `n` once the last child finishes.

Async hook: a request added with a `queue` (anything with `.put(RequestOutput)`) gets its
outputs put there instead of in the returned list (used by AsyncLLM).

Callers: `LLMEngine` / `AsyncLLM` (add_request before submitting to the engine core,
process_outputs after every engine step, abort_requests on user aborts).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from pagedinfer.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedinfer.engine.detokenizer import IncrementalDetokenizer, TokenizerLike
from pagedinfer.engine.logprobs import LogprobsProcessor, TokenTextCache
from pagedinfer.engine.metrics import FinishedRequestStats, IterationStats
from pagedinfer.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "OutputProcessor",
    "OutputProcessorOutput",
    "ParentRequest",
    "RequestState",
    "split_request",
]


class OutputQueue(Protocol):
    """Where a request's outputs go: the caller's list offline, an asyncio collector in
    AsyncLLM, which also takes the exception that ends a request."""

    def put(self, item: RequestOutput | BaseException, /) -> object: ...


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    """Outputs for requests without a queue, in engine-output order (parents after children)."""
    reqs_to_abort: list[str]
    """Engine-core request ids finished here by a stop string: abort them in the engine core."""
    num_generation_tokens: int = 0
    """New tokens in this batch of outputs (counted only with log_stats)."""


def _metrics(arrival: float, first_token: float | None, finished: float | None) -> dict[str, float]:
    metrics = {"arrival_time": arrival}
    if first_token is not None:
        metrics["first_token_time"] = first_token
    if finished is not None:
        metrics["finished_time"] = finished
    return metrics


class ParentRequest:
    """Fans one user request with `n > 1` out into `n` child requests and merges their outputs."""

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        # Request-level fields, filled in by OutputProcessor.add_request from the first child.
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.arrival_time = 0.0
        self.queue: OutputQueue | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.num_external_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self._prompt_logprobs_sent = False
        self._unfinished: set[int] = set(range(self.n))
        self._latest: dict[int, CompletionOutput] = {}  # newest full completion per child
        self._step: dict[int, CompletionOutput] = {}  # DELTA completions of the current step

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Child request id and sampling params (n=1, seed offset by the index)."""
        if not 0 <= index < self.n:
            raise IndexError(f"child index {index} out of range for n={self.n}")
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index  # distinct but reproducible streams per child
        return f"{index}_{self.request_id}", params

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def add_child_output(
        self, index: int, completion: CompletionOutput | None, finished: bool
    ) -> None:
        if completion is not None:
            if self.output_kind == RequestOutputKind.DELTA:
                self._step[index] = completion
            else:
                self._latest[index] = completion
        if finished:
            self._unfinished.discard(index)

    def remove_child(self, index: int) -> None:
        """Forget an aborted child: the parent no longer waits for it."""
        self._unfinished.discard(index)
        self._latest.pop(index, None)
        self._step.pop(index, None)

    def make_request_output(self, now: float) -> RequestOutput | None:
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [self._step[i] for i in sorted(self._step)]
            self._step.clear()
            prompt_logprobs = None
            if self.prompt_logprobs and not self._prompt_logprobs_sent:
                self._prompt_logprobs_sent = True
                prompt_logprobs = self.prompt_logprobs
        else:
            outputs = [self._latest[i] for i in sorted(self._latest)]
            prompt_logprobs = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            num_external_cached_tokens=self.num_external_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
            metrics=_metrics(self.arrival_time, self.first_token_time, now if finished else None),
        )


def split_request(
    request: EngineCoreRequest,
) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """n == 1: (None, [request]). n > 1: the parent that merges the children's outputs and
    the n independent child requests (they share nothing but the prompt; prefix caching
    later lets them share its KV blocks)."""
    if request.sampling_params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, request.sampling_params)
    children = []
    for index in range(parent.n):
        child_id, child_params = parent.get_child_info(index)
        children.append(
            msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        )
    return parent, children


class RequestState:
    """Front-end state of one engine-core request (a child, if it has a parent)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: TokenizerLike | None,
        token_text: TokenTextCache,
        parent: ParentRequest | None = None,
        request_index: int = 0,
        queue: OutputQueue | None = None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.parent = parent
        self.request_index = request_index
        self.queue = queue
        self.arrival_time = request.arrival_time
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.num_generation_tokens = 0
        self.num_cached_tokens = 0
        self.num_external_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.pooled: list[float] | None = None
        self.detokenizer = IncrementalDetokenizer.from_request(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor.from_request(token_text, request)

    def make_completion_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        """Completion as of now: delta or cumulative per output_kind (FINAL_ONLY: cumulative).

        In DELTA mode this consumes the new text, so call it once per engine output.
        """
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs_processor.logprobs
        if delta:
            token_ids = list(new_token_ids)
            if logprobs is not None:
                logprobs = logprobs[max(0, len(logprobs) - len(new_token_ids)) :]
        else:
            # Copies: a RequestOutput handed to the user must not change under them later.
            token_ids = list(self.detokenizer.token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def make_request_output(
        self, completion: CompletionOutput, finished: bool, now: float
    ) -> RequestOutput:
        if self.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs = self.logprobs_processor.pop_prompt_logprobs()
        else:
            prompt_logprobs = self.logprobs_processor.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            num_external_cached_tokens=self.num_external_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
            metrics=_metrics(self.arrival_time, self.first_token_time, now if finished else None),
            pooled=self.pooled,
        )


class OutputProcessor:
    """Turns engine-core outputs into `RequestOutput`s; see the module docstring."""

    def __init__(self, tokenizer: TokenizerLike | None, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text = TokenTextCache(tokenizer)

    def get_num_unfinished_requests(self) -> int:
        """Engine-core requests still tracked (each child of an n>1 request counts)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: OutputQueue | None = None,
    ) -> None:
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id} already running.")
        state = RequestState(
            request, prompt, self.tokenizer, self._token_text, parent_req, request_index, queue
        )
        self.request_states[request_id] = state
        if parent_req is not None and parent_req.request_id not in self.parent_requests:
            parent_req.prompt = prompt
            parent_req.prompt_token_ids = request.prompt_token_ids
            parent_req.arrival_time = request.arrival_time
            parent_req.queue = queue
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(
        self, request_ids: Iterable[str], iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Drop the state of the given requests (parent ids expand to their children).

        Returns the engine-core request ids that were dropped, i.e. what the engine core must
        abort. No output is produced for them; with `iteration_stats`, each is recorded there
        as finished with reason "abort".
        """
        removed: list[str] = []
        now = time.monotonic()

        def record(state: RequestState) -> None:
            if iteration_stats is not None:
                iteration_stats.finished_requests.append(
                    FinishedRequestStats(
                        str(FinishReason.ABORT),
                        now - state.arrival_time,
                        len(state.prompt_token_ids),
                        state.num_generation_tokens,
                    )
                )

        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            if parent is not None:
                for index in range(parent.n):
                    child_id = f"{index}_{parent.request_id}"
                    if (child := self.request_states.pop(child_id, None)) is not None:
                        removed.append(child_id)
                        record(child)
                continue
            state = self.request_states.pop(request_id, None)
            if state is None:
                continue
            removed.append(request_id)
            record(state)
            if state.parent is not None:
                state.parent.remove_child(state.request_index)
                self._drop_parent_if_done(state.parent)
        return removed

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """Update request states from one engine step's outputs and build RequestOutputs;
        with `iteration_stats`, record this step's latencies and finished requests there."""
        now = time.monotonic() if engine_core_timestamp is None else engine_core_timestamp
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        touched_parents: dict[str, ParentRequest] = {}
        num_generation_tokens = 0

        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted in the front end while this step was running
            new_token_ids = output.new_token_ids
            num_generation_tokens += len(new_token_ids)
            if output.num_cached_tokens:
                state.num_cached_tokens = output.num_cached_tokens
                state.num_external_cached_tokens = output.num_external_cached_tokens
            if output.kv_transfer_params is not None:
                state.kv_transfer_params = output.kv_transfer_params
            if output.pooled is not None:
                state.pooled = output.pooled
            if new_token_ids:
                if iteration_stats is not None:
                    iteration_stats.num_generation_tokens += len(new_token_ids)
                    if state.first_token_time is None:
                        iteration_stats.time_to_first_tokens.append(now - state.arrival_time)
                    else:
                        iteration_stats.inter_token_latencies.append(now - state.last_token_time)
                if state.first_token_time is None:
                    state.first_token_time = now
                state.last_token_time = now
                state.num_generation_tokens += len(new_token_ids)

            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            # Engine-core STOP means a stop token (EOS / stop_token_ids): it knows no strings.
            stop_str = state.detokenizer.update(
                new_token_ids,
                stop_terminated=finish_reason == FinishReason.STOP,
                finished=finish_reason is not None,
            )
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            state.logprobs_processor.update_from_output(output)
            finished = finish_reason is not None

            parent = state.parent
            if parent is None:
                if finished or state.output_kind != RequestOutputKind.FINAL_ONLY:
                    completion = state.make_completion_output(
                        new_token_ids, finish_reason, stop_reason
                    )
                    self._emit(
                        state.make_request_output(completion, finished, now),
                        state.queue,
                        request_outputs,
                    )
            else:
                self._update_parent(parent, state, new_token_ids, finish_reason, stop_reason)
                touched_parents[parent.request_id] = parent

            if finished:
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(
                        FinishedRequestStats(
                            str(finish_reason),
                            now - state.arrival_time,
                            len(state.prompt_token_ids),
                            state.num_generation_tokens,
                        )
                    )
                del self.request_states[output.request_id]
                if not output.finished:
                    reqs_to_abort.append(output.request_id)

        for parent in touched_parents.values():
            request_output = parent.make_request_output(now)
            if request_output is not None:
                self._emit(request_output, parent.queue, request_outputs)
            self._drop_parent_if_done(parent)

        return OutputProcessorOutput(
            request_outputs=request_outputs,
            reqs_to_abort=reqs_to_abort,
            num_generation_tokens=num_generation_tokens if self.log_stats else 0,
        )

    # ----------------------------------------------------------------------------- internals

    @staticmethod
    def _emit(
        request_output: RequestOutput, queue: OutputQueue | None, out: list[RequestOutput]
    ) -> None:
        if queue is not None:
            queue.put(request_output)
        else:
            out.append(request_output)

    def _update_parent(
        self,
        parent: ParentRequest,
        state: RequestState,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> None:
        finished = finish_reason is not None
        completion = None
        if finished or parent.output_kind != RequestOutputKind.FINAL_ONLY:
            completion = state.make_completion_output(new_token_ids, finish_reason, stop_reason)
        parent.add_child_output(state.request_index, completion, finished)
        # Request-level fields: every child sees the same prompt, so the first to report wins.
        if state.first_token_time is not None and parent.first_token_time is None:
            parent.first_token_time = state.first_token_time
        parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
        parent.num_external_cached_tokens = max(
            parent.num_external_cached_tokens, state.num_external_cached_tokens
        )
        if parent.kv_transfer_params is None:
            parent.kv_transfer_params = state.kv_transfer_params
        if parent.prompt_logprobs is None and state.logprobs_processor.prompt_logprobs:
            parent.prompt_logprobs = state.logprobs_processor.prompt_logprobs

    def _drop_parent_if_done(self, parent: ParentRequest) -> None:
        # Aborted children are discarded from the parent too, so "finished" also covers a
        # parent whose remaining children were all aborted.
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
