"""Messages between the front end (LLMEngine / AsyncLLM) and the engine core.

These msgspec structs are the only things that cross that boundary, so the same types work
in-process today and over ZMQ (msgpack) when the engine core runs in its own process. They
hold plain Python data: no torch tensors, no live `Request` objects.
"""

from __future__ import annotations

import enum
import time

import msgspec

from pagedinfer.sampling_params import SamplingParams

__all__ = [
    "EngineCoreRequest",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FinishReason",
    "LogprobsLists",
    "SchedulerStats",
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None
