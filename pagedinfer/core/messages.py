"""Messages between the front end (LLMEngine / AsyncLLM) and the engine core.

These msgspec structs are the only things that cross that boundary, so the same types work
in-process today and over ZMQ (msgpack) when the engine core runs in its own process. They
hold plain Python data: no torch tensors, no live `Request` objects.
"""

from __future__ import annotations

import enum
import time

import msgspec

from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import SamplingParams

__all__ = [
    "EngineCoreRequest",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FinishReason",
    "KVTransferStats",
    "LogprobsLists",
    "SchedulerStats",
    "SpecDecodingStats",
]


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI-style string."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    """Set for a pooling (embedding) request: it finishes with its prefill, no token sampled."""


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs for a run of tokens; row i is one token position.

    Column 0 of each row is the sampled (or, for prompts, the actual next) token, columns
    1..k the top-k tokens in descending order.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    """Logprobs of prompt tokens 1..n-1 (sent once, with the first generated token)."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens not computed here: local prefix-cache hits plus external ones."""
    num_external_cached_tokens: int = 0
    """Of those, tokens whose KV a KV connector loaded (disaggregated prefill)."""
    kv_transfer_params: dict[str, object] | None = None
    """Set when the request finishes, by its KV connector (e.g. where a decode instance
    fetches the prompt's KV from)."""
    pooled: list[float] | None = None
    """A pooling request's vector (with its finish)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding counts (of one step, or summed): a "draft" is one request's
    proposal verified in one step. Acceptance rate = accepted / draft tokens; mean
    acceptance length = 1 + accepted / drafts (the bonus or correction token counted, as
    vLLM does); per-position acceptance = accepted_per_pos[i] / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted_tokens:
            per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        theirs = other.num_accepted_tokens_per_pos
        if len(per_pos) < len(theirs):
            per_pos.extend([0] * (len(theirs) - len(per_pos)))
        for i, n in enumerate(theirs):
            per_pos[i] += n

    def summary(self, num_speculative_tokens: int | None = None) -> dict[str, float]:
        """The figures `LLM.get_stats()` reports (per position up to k, when given)."""
        drafts = self.num_drafts
        per_pos = list(self.num_accepted_tokens_per_pos)
        if num_speculative_tokens is not None:
            per_pos = (per_pos + [0] * num_speculative_tokens)[:num_speculative_tokens]
        out: dict[str, float] = {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "spec_mean_acceptance_length": (
                1 + self.num_accepted_tokens / drafts if drafts else 0.0
            ),
        }
        for i, n in enumerate(per_pos):
            out[f"spec_acceptance_pos_{i}"] = n / drafts if drafts else 0.0
        return out


class KVTransferStats(msgspec.Struct, omit_defaults=True):
    """KV connector transfers (of one interval, or summed)."""

    num_loaded_tokens: int = 0
    num_loaded_bytes: int = 0
    load_time_s: float = 0.0
    num_saved_tokens: int = 0
    num_saved_bytes: int = 0
    save_time_s: float = 0.0
    num_failed_loads: int = 0
    """Requests whose loaded KV was missing, partial or corrupted."""

    def add(self, other: KVTransferStats) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name in self.__struct_fields__)


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the scheduler after one step (for logging and `LLM.get_stats()`)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    """Preemptions since start."""
    prefix_cache_requests: int = 0
    """Requests looked up in the prefix cache during this step."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache during this step."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    prefix_cache_reset: bool = False
    spec_decoding: SpecDecodingStats | None = None
    """Drafts verified during this step (None without speculative decoding)."""
    kv_transfer: KVTransferStats | None = None
    """KV connector transfers since the last stats (None without any)."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None
