"""The scheduler's per-step and per-request arithmetic, apart from its queues.

`StepState` is what one `Scheduler.schedule()` call has decided so far, `PrefixMatch` the
tokens of a waiting request that need no computing, `num_new_prompt_tokens` how much of
its prompt a waiting request computes in a step, and `append_generated` / `check_stop`
apply a step's sampled tokens and the token-level stop conditions to a request.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedinfer.config import SchedulerConfig
from pagedinfer.core.block_pool import KVCacheBlock
from pagedinfer.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedinfer.structured_output.manager import StructuredOutputManager

__all__ = [
    "PrefixMatch",
    "StepState",
    "append_generated",
    "check_stop",
    "num_new_prompt_tokens",
]


@dataclass(slots=True)
class StepState:
    """What one `schedule()` call has decided so far: the running pass fills it, the
    waiting pass adds to it, `_build_output` turns it into the `SchedulerOutput`."""

    token_budget: int
    max_reqs: int
    """Requests this step may schedule: `max_num_seqs`, or under pipeline parallelism a
    share of the live requests (`Scheduler._max_reqs_this_step`)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks_of: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    scheduled_spec: dict[str, list[int]] = field(default_factory=dict)
    prefill_budget: int = 1 << 62
    """Prompt tokens this step may still compute (`PrefillBudget`, when requests decode)."""
    prefilling: set[str] = field(default_factory=set)
    """Requests scheduled for prompt tokens (or, resumed, their outputs again); the rest
    decode."""


class PrefixMatch(NamedTuple):
    """The tokens of a waiting request that need no computing
    (`Scheduler._match_computed_tokens`)."""

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


def num_new_prompt_tokens(
    config: SchedulerConfig, request: Request, match: PrefixMatch, token_budget: int
) -> int | None:
    """The tokens a waiting request computes this step: none while its KV loads (only the
    loaded tokens' slots are allocated), else the rest of its prompt capped by
    `long_prefill_token_threshold` and the budget. None when chunked prefill is off and the
    rest does not fit the budget."""
    if match.load_async:
        return 0
    num_new_tokens = request.num_tokens - match.num_computed
    threshold = config.long_prefill_token_threshold
    if 0 < threshold < num_new_tokens:
        num_new_tokens = threshold
    if not config.enable_chunked_prefill and num_new_tokens > token_budget:
        return None
    return min(num_new_tokens, token_budget)


def append_generated(
    request: Request,
    generated: list[int],
    max_model_len: int,
    structured_output_manager: StructuredOutputManager | None,
) -> list[int]:
    """Append a step's sampled tokens to a request, in order, until one of them finishes it
    (a stop condition, or a guided request's grammar completing or reaching a dead end);
    returns the tokens appended."""
    appended: list[int] = []
    for token_id in generated:
        request.append_output_token_ids(token_id)
        appended.append(token_id)
        if check_stop(request, max_model_len):
            break
        if (
            request.structured_output_request is not None
            and structured_output_manager is not None
            and (end := structured_output_manager.accept_token(request, token_id))
        ):
            request.status = end
            break
    return appended


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
