"""The contracts between the scheduler and the workers.

`SchedulerOutput` (scheduler -> worker) says, for one step, how many tokens each request
computes and where their KV goes. New requests are sent in full once (`NewRequestData`);
requests the worker already knows are sent as deltas (`CachedRequestData`). Chunked
prefill, decode, and later prefix hits and speculative tokens all reduce to
`num_scheduled_tokens[req_id]`.

`ModelRunnerOutput` (worker -> scheduler) carries the sampled token ids per request, in the
order of `req_ids`; a request whose scheduled chunk did not reach the end of its prompt gets
an empty list.

All types are plain dataclasses of Python data (no torch, no live `Request`), so they can be
sent to worker processes as msgpack (`distributed/serial.py`, typed decoding, no pickle).

Deviation from vLLM: a request resumed after preemption is sent again as `NewRequestData`
carrying its output tokens too (the worker dropped its state when it was preempted), instead
of vLLM's `resumed_req_ids` inside `CachedRequestData`. One code path, same information.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

# Imported at run time: the executor decodes these dataclasses by their annotations.
from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVConnectorOutput
from pagedinfer.core.messages import LogprobsLists
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.core.request import Request

__all__ = [
    "NewRequestData",
    "CachedRequestData",
    "SchedulerOutput",
    "ModelRunnerOutput",
    "GrammarOutput",
]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already generated (non-empty only for a request resumed after preemption)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    """A pooling request: its prompt's hidden states are pooled, no token sampled."""
    cache_salt: str | None = None
    """Its prefix-cache salt (a tenant's): store-backed KV connectors key by it too."""

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
            cache_salt=request.cache_salt,
        )


@dataclass
class CachedRequestData:
    """Per-step deltas for requests the worker already holds (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block table this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens with KV already in the cache before this step."""
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Pipeline parallelism only (else empty): each request's tokens run this step (drafts
    excluded). Stages before the last never sample, so they learn the new tokens here."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> number of tokens computed this step. Its iteration order is the batch order
    (running requests first, then newly admitted ones)."""
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished (or aborted) since the previous step: workers drop their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted in this step: workers drop their state (they come back as new)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """This step's KV transfers (distributed/kv_transfer/); None without a connector."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    """Per request: the sampled token(s); empty for a non-final prefill chunk."""
    logprobs: LogprobsLists | None = None
    """One row per sampled token: request i's `len(sampled_token_ids[i])` rows follow those
    of the requests before it (`logprobs_row_of(i)` is the first)."""
    prompt_logprobs_dict: dict[str, LogprobsLists | None] = field(default_factory=dict)
    """req_id -> logprobs of the prompt positions computed this step."""
    draft_token_ids: dict[str, list[int]] | None = None
    """Speculative decoding: req_id -> the drafts proposed for the next step."""
    kv_connector_output: KVConnectorOutput | None = None
    """What the worker's KV connector finished or failed (None without a connector)."""
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    """req_id -> the vector of a pooling request whose prefill completed this step."""
    _row_starts: list[int] | None = field(default=None, repr=False, compare=False)

    def logprobs_row_of(self, index: int) -> int:
        if self._row_starts is None:
            starts, total = [], 0
            for tokens in self.sampled_token_ids:
                starts.append(total)
                total += len(tokens)
            self._row_starts = starts
        return self._row_starts[index]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class GrammarOutput:
    """Engine core -> worker, beside a `SchedulerOutput`: the step's guided-decoding bitmask
    (`StructuredOutputManager.grammar_bitmask`), rows in the batch order of `req_ids`. The
    runner sets the logits of disallowed tokens to -inf before sampling. numpy, so it crosses
    to worker processes as raw bytes."""

    req_ids: list[str]
    bitmask: npt.NDArray[np.int32]  # [sum(num_rows), ceil(vocab_size / 32)]
    num_rows: list[int] = field(default_factory=list)
    """Rows per request (1 + its scheduled draft tokens), in `req_ids` order; empty means one
    row each."""
    stats: dict[str, float] = field(default_factory=dict)

    def rows_of(self, index: int) -> int:
        return self.num_rows[index] if self.num_rows else 1
