"""The engine core's view of one request: its tokens, progress and lifecycle state.

`Request` is owned by the scheduler and never crosses a process boundary (the worker gets
`NewRequestData` / `CachedRequestData` instead). Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`, appended only through
  `append_output_token_ids`;
- `num_computed_tokens <= num_tokens`; it grows when a step is scheduled and is reset to 0
  on preemption (recompute);
- a finished status is final (`RequestStatus.is_finished`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedinfer.core.messages import EngineCoreRequest, FinishReason
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedinfer.structured_output.manager import StructuredOutputRequest

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Order matters: every status after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.pooling_params = pooling_params
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Resolved by the input processor (None means "up to max_model_len").
        self.max_tokens = sampling_params.max_tokens

        self.num_computed_tokens = 0
        # Prefix-cache hit length at first schedule (-1 until then).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # KV connectors: tokens loaded from outside at first schedule, and whether a load
        # failed (the prompt is then computed locally, without asking the connector again).
        self.num_external_computed_tokens = 0
        self.kv_load_failed = False
        self.spec_token_ids: list[int] = []
        # Guided decoding: the grammar being compiled / in use (structured_output/manager.py).
        self.structured_output_request: StructuredOutputRequest | None = None
        # True while the scheduled chunk does not reach the end of the known tokens.
        self.is_prefill_chunk = False
        # Prefix caching: hashes of the full blocks of all_token_ids, kept up to date as
        # tokens are appended (see core/kv_cache_utils.py).
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            block_hasher=block_hasher,
            pooling_params=request.pooling_params,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs and mean pooling need every prompt position computed: no cache
        hits (as vLLM). Last-token pooling reads only the last position, always computed."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (
            pooling is not None and pooling.pooling_type == "mean"
        )

    @property
    def kv_transfer_params(self) -> dict[str, object] | None:
        """The client's KV transfer parameters (disaggregated prefill), as vLLM carries
        them: `sampling_params.extra_args["kv_transfer_params"]`."""
        extra = self.sampling_params.extra_args
        # The engine passes the client's JSON object through; connectors validate it.
        params: dict[str, object] | None = (
            None if extra is None else extra.get("kv_transfer_params")
        )
        return params

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority-heap order: lower priority value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
