"""The engine side of guided decoding: compile grammars off the step loop, fill the bitmask.

Flow of one structured request (vLLM's design, seed 000 chapter 3):
1. The front end validated its spec and chose the backend (`StructuredOutputsParams.
   resolved_backend`); the engine core adds it in WAITING_FOR_FSM and calls
   `grammar_init`, which submits the compile to a thread pool. Compiled grammars are cached
   by (kind, spec): a repeated schema compiles once, each request then gets its own matcher.
2. The scheduler skips the request, keeping its place, until `StructuredOutputRequest.
   is_ready()`; a compile that fails or takes longer than the timeout finishes that request
   alone with reason "error" and the problem in `stop_reason`.
3. Each step, after scheduling, `grammar_bitmask` fills one row of the packed int32 mask
   per structured request that samples this step, in batch order; the model runner expands
   it over the vocabulary and sets the disallowed logits to -inf before sampling.
4. After sampling, the scheduler calls `accept_token` per kept token; a grammar that
   reaches its end finishes the request with reason "stop".

Reasoning (`StructuredOutputsParams.reasoning_end`, vLLM's reasoning-aware guided decoding):
the request samples freely, without mask rows, until its output contains that text; the
grammar then sees only the tokens after it.

Closing within the budget (`StructuredOutputsParams.close_within_max_tokens`): within
`CLOSE_WINDOW` tokens of the end of its budget, a JSON request's text is completed by
`json_closer.closing_text` each step; once that completion needs about all the budget left,
its tokens (checked by the grammar first) are forced one row at a time, and the request
finishes with reason "length" when the last is sampled.

Speculative decoding (several tokens per step): `validate_tokens` trims a request's draft to
the prefix its grammar allows (the scheduler then schedules only that), and
`grammar_bitmask` gives a request with k scheduled draft tokens k + 1 rows: the mask at each
verification position, found by advancing the grammar through the drafts and rolling it back.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedinfer.core.sched_output import GrammarOutput
from pagedinfer.sampling_params import StructuredOutputsParams
from pagedinfer.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    allow_only,
    create_backend,
)
from pagedinfer.structured_output.json_closer import closing_text
from pagedinfer.structured_output.specs import StructuredOutputOptions, canonical_spec

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig
    from pagedinfer.core.request import Request, RequestStatus
    from pagedinfer.core.sched_output import SchedulerOutput

logger = logging.getLogger("pagedinfer")

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "spec_key"]

CLOSE_WINDOW = 64
"""`close_within_max_tokens`: the closing is worked out each step once the budget left is at
most this many tokens (closings of forced tool calls measure 2-20 tokens)."""
CLOSE_MARGIN = 4
"""... and forced once it needs at least the budget left less this margin (one free token
can lengthen the closing: a comma in an object still missing required properties), or, at
a boundary between two elements, once one more element would not fit."""


def spec_key(params: StructuredOutputsParams) -> tuple[StructuredOutputOptions, str]:
    """(kind, spec text): the compile-cache key (schemas and choices as compact JSON, keys in
    their given order: the backends emit properties in that order)."""
    if params.json is not None:
        kind, spec = StructuredOutputOptions.JSON, params.json
    elif params.json_object:
        kind, spec = StructuredOutputOptions.JSON_OBJECT, ""
    elif params.regex is not None:
        kind, spec = StructuredOutputOptions.REGEX, params.regex
    elif params.choice is not None:
        kind, spec = StructuredOutputOptions.CHOICE, params.choice
    elif params.structural_tag is not None:
        kind, spec = StructuredOutputOptions.STRUCTURAL_TAG, params.structural_tag
    else:
        assert params.grammar is not None
        kind, spec = StructuredOutputOptions.GRAMMAR, params.grammar
    return kind, canonical_spec(kind, spec)


@dataclass
class StructuredOutputRequest:
    """A request's grammar: compiling (a future), ready (a matcher) or failed (an error)."""

    params: StructuredOutputsParams
    backend: str
    key: tuple[StructuredOutputOptions, str]
    future: concurrent.futures.Future | None = None
    deadline: float = 0.0
    grammar: StructuredOutputGrammar | None = None
    error: str | None = None
    pending_end: str | None = None
    """While set (the reasoning has not ended), the grammar neither masks nor advances."""
    pending_ids: list[int] | None = None
    """The output tokens so far while `pending_end` is set (their text is searched)."""
    grammar_start: int = 0
    """Output tokens before the grammar's first (the reasoning, if any)."""
    closing: list[int] | None = None
    """`close_within_max_tokens`, once started: the completion's tokens not yet sampled."""
    schema: Any = None
    """`close_within_max_tokens`: the JSON schema, parsed when first needed."""

    @property
    def constraining(self) -> bool:
        """Whether the grammar is compiled and applies to the next token."""
        return self.grammar is not None and self.pending_end is None

    def is_ready(self) -> bool:
        """True once compiled or failed (then `error` says why); never blocks."""
        if self.grammar is not None or self.error is not None:
            return True
        assert self.future is not None
        if self.future.done():
            try:
                self.grammar = self.future.result()
            except Exception as exc:  # the request fails alone
                self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return True
        if time.monotonic() > self.deadline:
            self.future.cancel()
            self.error = "grammar compilation timed out"
            return True
        return False


class StructuredOutputManager:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config.structured_outputs_config
        self.max_model_len = max_model_len
        self.model = config.model_config.model
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.compile_timeout_s = self.config.structured_outputs_compile_timeout_s
        workers = max(1, ((os.cpu_count() or 1) + 1) // 2)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "pagedinfer-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        # One backend per (name, disable_any_whitespace, disable_additional_properties): the
        # options are fixed when a backend is made; each caches its compiled grammars.
        self._backends: dict[tuple[str, bool, bool], StructuredOutputBackend] = {}
        # One lock per spec: concurrent requests with the same spec compile it once (the
        # second waits, then hits the backend's cache).
        self._spec_locks: dict[tuple[Any, ...], threading.Lock] = {}
        self._bitmask: Any = None  # torch int32 [max_num_seqs, words]
        self.bitmask_time_s = 0.0
        self.num_bitmask_steps = 0
        self.num_closed = 0
        """Requests whose JSON was closed within their budget (`close_within_max_tokens`)."""
        self.num_requests = {"xgrammar": 0, "guidance": 0}
        """Structured requests per backend (what "auto" chose, or the engine's)."""

    # ---------------------------------------------------------------------- compiling

    def _backend(self, name: str, params: StructuredOutputsParams) -> StructuredOutputBackend:
        """The backend for `name` and the request's options, built on first use (in a pool
        thread: the tokenizer and the first backend take a second or so)."""
        key = (
            name,
            params.disable_any_whitespace or self.config.disable_any_whitespace,
            params.disable_additional_properties or self.config.disable_additional_properties,
        )
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                if self._tokenizer is None:
                    from pagedinfer.tokenizer import Tokenizer

                    self._tokenizer = Tokenizer.from_model_path(self.model)
                backend = create_backend(
                    name,  # type: ignore[arg-type]
                    self._tokenizer,
                    self.vocab_size,
                    disable_any_whitespace=key[1],
                    disable_additional_properties=key[2],
                )
                self._backends[key] = backend
            return backend

    @property
    def num_compiles(self) -> int:
        return sum(b.num_compiles for b in list(self._backends.values()))

    @property
    def num_cache_hits(self) -> int:
        return sum(b.num_cache_hits for b in list(self._backends.values()))

    def grammar_init(self, request: Request) -> None:
        """Start compiling `request`'s grammar; the scheduler polls `is_ready()`."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        backend = params.resolved_backend or (
            "guidance" if self.config.structured_outputs_backend == "guidance" else "xgrammar"
        )
        kind, spec = spec_key(params)
        self.num_requests[backend] = self.num_requests.get(backend, 0) + 1
        so_request = StructuredOutputRequest(params, backend, (kind, spec))
        if params.reasoning_end:
            so_request.pending_end, so_request.pending_ids = params.reasoning_end, []
        so_request.deadline = time.monotonic() + self.compile_timeout_s
        so_request.future = self._pool.submit(self._compile, backend, kind, spec, params)
        request.structured_output_request = so_request

    def _compile(
        self,
        backend_name: str,
        kind: StructuredOutputOptions,
        spec: str,
        params: StructuredOutputsParams,
    ) -> StructuredOutputGrammar:
        backend = self._backend(backend_name, params)
        with self._lock:
            lock = self._spec_locks.setdefault((id(backend), kind, spec), threading.Lock())
        with lock:
            return backend.compile_grammar(kind, spec)

    # ------------------------------------------------------------------------ per step

    def grammar_bitmask(
        self, requests: dict[str, Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        """Rows for the structured requests that sample in this step (batch order): one per
        request, plus one per scheduled draft token. A terminated grammar's row allows
        everything (its request is about to finish); so do the rows after a draft token the
        grammar refuses (the rejection sampler stops at that token anyway)."""
        rows: list[tuple[str, StructuredOutputGrammar, list[int], list[int] | None]] = []
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            so = request.structured_output_request if request is not None else None
            if so is None or not so.constraining or request.is_prefill_chunk:
                continue
            assert so.grammar is not None
            closing = self._closing(request, so) if so.params.close_within_max_tokens else None
            rows.append((req_id, so.grammar, drafts_of.get(req_id, []), closing))
        if not rows:
            return None
        start = time.perf_counter()
        total = sum(1 + len(drafts) for _, _, drafts, _ in rows)
        if self._bitmask is None or self._bitmask.shape[0] < total:
            backend = next(iter(self._backends.values()))
            self._bitmask = backend.allocate_token_bitmask(max(self.max_num_seqs, total))
        bitmask = self._bitmask[:total]
        bitmask.fill_(-1)
        row = 0
        for _, grammar, drafts, closing in rows:
            if closing:  # forced: the closing's next tokens (drafts that differ are rejected)
                for j in range(min(1 + len(drafts), len(closing))):
                    allow_only(bitmask, row + j, closing[j])
            elif drafts:
                self._fill_draft_rows(grammar, drafts, bitmask, row)
            elif not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, row)
            row += 1 + len(drafts)
        self.bitmask_time_s += time.perf_counter() - start
        self.num_bitmask_steps += 1
        return GrammarOutput(
            [r for r, _, _, _ in rows],
            bitmask.numpy().copy(),
            num_rows=[1 + len(d) for _, _, d, _ in rows] if drafts_of else [],
        )

    def _budget_left(self, request: Request) -> float:
        """Tokens the request may still sample (max_tokens, max_model_len)."""
        left = float("inf")
        if request.max_tokens is not None:
            left = request.max_tokens - request.num_output_tokens
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - request.num_tokens)
        return left

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _closing(self, request: Request, so: StructuredOutputRequest) -> list[int] | None:
        """The tokens to force from here for `close_within_max_tokens` (see the module
        docstring), or None while the request samples freely."""
        if so.closing is not None:
            return so.closing
        left = self._budget_left(request)
        if left > CLOSE_WINDOW or so.grammar is None or so.grammar.is_terminated():
            return None
        if so.schema is None:
            json_spec = so.params.json
            so.schema = json.loads(json_spec) if isinstance(json_spec, str) else json_spec
        text = self._tokenizer.decode(request.output_token_ids[so.grammar_start :])
        tail = closing_text(text, so.schema)
        if not tail:  # complete already (the grammar lets it end), or no closing known
            return None
        ids = self._encode(tail)
        if len(ids) + CLOSE_MARGIN < left:
            # At (or one quote from) the end of a value, with only brackets left to close:
            # close now if one more element, at any of those levels (a comma, its minimal
            # form, the closing after it), could not be finished in the budget. One token
            # (`",` or `},`) can take the text there, and the closing would then grow by a
            # whole element at once: cut, or finished by inventing a whole tool call.
            run = len(tail) - len(tail.lstrip('"}]'))
            worst = 0
            for k in range(run + 1 if run else 0):
                more = closing_text(text + tail[:k] + ",", so.schema)
                if more is not None:
                    worst = max(worst, len(self._encode(tail[:k] + "," + more)))
            if worst + CLOSE_MARGIN < left:
                return None
        # The grammar must take every token and then allow the end (EOS).
        eos = self._tokenizer.eos_token_id
        check = ids if eos is None else [*ids, eos]
        if so.grammar.validate_tokens(check) != check:
            logger.debug("Request %s: the grammar refuses the closing %r.", request.request_id,
                         tail)  # fmt: skip
            return None
        so.closing = ids
        self.num_closed += 1
        return ids

    @staticmethod
    def _fill_draft_rows(
        grammar: StructuredOutputGrammar, drafts: list[int], bitmask: Any, first_row: int
    ) -> None:
        """Row j = the mask after drafts[:j]: advance through the drafts one at a time,
        filling as we go, then roll the grammar back to where it was."""
        advanced = 0
        for j in range(len(drafts) + 1):
            grammar.fill_bitmask(bitmask, first_row + j)
            if j == len(drafts) or not grammar.accept_tokens("", [drafts[j]]):
                break
            advanced += 1
        grammar.rollback(advanced)

    def validate_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (a draft) that the request's grammar accepts
        from its current state; the grammar itself does not move. Requests without a ready
        grammar take the draft as it is."""
        so = request.structured_output_request
        if so is None or not so.constraining or so.grammar is None or not token_ids:
            return token_ids
        return so.grammar.validate_tokens(token_ids)

    def accept_token(self, request: Request, token_id: int) -> RequestStatus | None:
        """Advance the request's grammar by one sampled token. Returns FINISHED_STOPPED when
        the grammar is complete, FINISHED_ERROR (with `request.stop_reason` set) if the
        grammar refuses the token (a dead end: no token was allowed), else None."""
        from pagedinfer.core.request import RequestStatus

        so = request.structured_output_request
        if so is None or so.grammar is None:
            return None
        if so.pending_end is not None:
            self._watch_reasoning(so, token_id)
            return None
        if so.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if so.closing is not None:
            if so.closing and so.closing[0] == token_id:
                so.closing.pop(0)
            else:  # cannot happen: the mask allowed this token alone
                so.closing = None
        if not so.grammar.accept_tokens(request.request_id, [token_id]):
            logger.error("Request %s: token %d rejected by its grammar.", request.request_id,
                         token_id)  # fmt: skip
            request.stop_reason = (
                "structured outputs: the grammar allows no continuation here (is the spec "
                "satisfiable?)"
            )
            return RequestStatus.FINISHED_ERROR
        if so.closing == []:  # the forced completion is out: cut by the budget, yet whole
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return RequestStatus.FINISHED_STOPPED if so.grammar.is_terminated() else None

    def _watch_reasoning(self, so: StructuredOutputRequest, token_id: int) -> None:
        """Add a free token; once the output's text holds `pending_end` the grammar takes
        over from the next token. The window of the last 32 tokens holds any end marker
        (`</think>` is one token in the models that use it, under 8 in any tokenizer)."""
        assert so.pending_ids is not None and so.pending_end is not None
        so.pending_ids.append(token_id)
        tail = so.pending_ids[-32:]
        if so.pending_end in self._tokenizer.decode(tail, skip_special_tokens=False):
            so.grammar_start = len(so.pending_ids)
            so.pending_end, so.pending_ids = None, None

    def stats(self) -> dict[str, float]:
        return {
            "grammar_compiles": self.num_compiles,
            "grammar_cache_hits": self.num_cache_hits,
            "bitmask_time_s": self.bitmask_time_s,
            "bitmask_steps": self.num_bitmask_steps,
            "grammar_closed_at_budget": self.num_closed,
            **{f"grammar_requests_{name}": n for name, n in self.num_requests.items()},
        }

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for backend in self._backends.values():
            backend.destroy()
