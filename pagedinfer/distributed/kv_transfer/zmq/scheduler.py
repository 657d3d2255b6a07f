"""`ZmqConnectorScheduler`: the scheduler side of the ZmqConnector, called through the
`ZmqConnector` facade (`connector.py`) by the scheduler, on the scheduler's thread.

Consumer (decode instance):
- A request loads remote KV only if its `kv_transfer_params` name a prompt hash equal to
  the hash of its own first `remote_num_tokens` prompt tokens: it never pulls KV computed
  for another prompt (through a mismatched or replayed `remote_request_id`).
- It pulls once per request: a preempted request, or one whose load failed, computes its
  prompt. When the local prefix cache already covers the remote tokens, the load spec has
  0 tokens: the worker only releases the producer's hold.
- A request whose load is in flight keeps its blocks when it finishes (they are being
  written) until the worker reports the load in `finished_recving`.

Producer (prefill instance), for requests with `{"do_remote_decode": true}`:
- A request's prompt blocks are held once the step that completes its prompt is built;
  the hold spec goes to the worker in that step's metadata.
- Cancels: when a held request is preempted (its blocks are freed; the hold is set again
  when its prompt is recomputed), quietly; when it finishes abnormally (aborted: the
  blocks are freed at once instead of at the lease's end), reported; when it finishes
  without `request_finished` (failed while waiting), quietly.
- A hold released (read or expired) while its request still decodes on the producer is
  remembered, so that the request's blocks are not held again when it finishes.
- A normally finished held request returns the `kv_transfer_params` the client passes to
  the decode instance: this instance's address, engine id, the request id, the prompt
  length and its hash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVTransferSpec
from pagedinfer.core.request import RequestStatus
from pagedinfer.distributed.kv_transfer.storage import token_digest

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig
    from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput
    from pagedinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["ZmqConnectorScheduler", "prompt_hash"]

_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of prompt token ids (sent in `kv_transfer_params`)."""
    return token_digest(token_ids)[:32]


def _transfer_params(sampling_params: SamplingParams | None) -> dict[str, Any]:
    extra = sampling_params.extra_args if sampling_params is not None else None
    params = extra.get("kv_transfer_params") if extra else None
    return params if isinstance(params, dict) else {}


@dataclass
class _Remote:
    """Where a decode request's prompt KV is held (its `kv_transfer_params`)."""

    host: str
    port: int
    engine_id: str
    request_id: str
    num_tokens: int
    prompt_hash: str
    """Of the producer's prompt tokens: a decode request only pulls KV computed for its own
    prompt (not another's, through a mismatched or replayed `remote_request_id`)."""

    @classmethod
    def of(cls, request: Request) -> _Remote | None:
        """`request`'s remote prompt KV, if its params name one computed for its prompt."""
        remote = cls.parse(request.kv_transfer_params)
        if remote is None:
            return None
        prompt = request.prompt_token_ids
        if remote.num_tokens > len(prompt) or prompt_hash(prompt[: remote.num_tokens]) != (
            remote.prompt_hash
        ):
            logger.warning(
                "kv_transfer_params of request %s name KV of another prompt: computing the "
                "prompt locally", request.request_id,
            )  # fmt: skip
            return None
        return remote

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> _Remote | None:
        if not params or params.get("do_remote_prefill") is not True:
            return None
        try:
            remote = cls(
                host=params["remote_host"],
                port=params["remote_port"],
                engine_id=params.get("remote_engine_id") or "",
                request_id=params["remote_request_id"],
                num_tokens=params["remote_num_tokens"],
                prompt_hash=params["remote_prompt_hash"],
            )
        except KeyError as exc:
            logger.warning("kv_transfer_params without %s: computing the prompt locally", exc)
            return None
        if not (
            isinstance(remote.host, str)
            and type(remote.port) is int
            and isinstance(remote.engine_id, str)
            and isinstance(remote.request_id, str)
            and type(remote.num_tokens) is int
            and isinstance(remote.prompt_hash, str)
        ):
            logger.warning("malformed kv_transfer_params %s: computing the prompt locally", params)
            return None
        return remote

    def as_params(self) -> dict[str, Any]:
        """The load spec's `params`, read by the worker's puller."""
        return {
            "host": self.host,
            "port": self.port,
            "engine_id": self.engine_id,
            "request_id": self.request_id,
        }


@dataclass
class _Watch:
    """A do_remote_decode request whose prompt is not complete yet."""

    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


def _cancel_spec(req_id: str, report: bool) -> KVTransferSpec:
    return KVTransferSpec(req_id, [], 0, 0, params={"cancel": True, "report": report})


class ZmqConnectorScheduler:
    """Decides the loads (consumer) and the holds and cancels (producer) of each step."""

    def __init__(self, kv_config: KVTransferConfig, engine_id: str, block_size: int) -> None:
        self.kv_config = kv_config
        self.engine_id = engine_id
        self.block_size = block_size
        # Consumer: loads for this step, loads in flight.
        self._pending_loads: list[KVTransferSpec] = []
        self._loads_in_flight: set[str] = set()
        # Producer: requests whose prompt is still being computed, requests with a hold on
        # the worker (not finished yet), holds the worker released before their request
        # finished, and cancels for the next step.
        self._watched: dict[str, _Watch] = {}
        self._holding: set[str] = set()
        self._released_early: set[str] = set()
        self._pending_cancels: list[KVTransferSpec] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.kv_config.is_kv_consumer or request.num_preemptions:
            # A preempted request loaded its KV before (the hold is gone): recompute.
            return 0, False
        remote = _Remote.of(request)
        if remote is None or remote.num_tokens <= num_computed_tokens:
            return 0, False
        return remote.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if (
            not self.kv_config.is_kv_consumer
            or request.num_preemptions
            or request.kv_load_failed
            or request.num_computed_tokens > 0  # admitted again once its load arrived
        ):
            return
        remote = _Remote.of(request)
        if remote is None:
            return
        # The scheduler clamped our count to leave the last prompt token to compute: the
        # external tokens end at min(remote prompt, prompt - 1).
        end = min(remote.num_tokens, request.num_tokens - 1)
        spec = KVTransferSpec(
            req_id=request.request_id,
            block_ids=list(block_ids),
            start=max(end - num_external_tokens, 0),
            num_tokens=max(num_external_tokens, 0),
            params=remote.as_params(),
        )
        if num_external_tokens > 0:
            self._loads_in_flight.add(request.request_id)
        # Else (everything was a local prefix hit) the spec only releases the remote hold.
        self._pending_loads.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads, holds=self._pending_cancels)
        self._pending_loads, self._pending_cancels = [], []
        if self.kv_config.is_kv_producer:
            self._cancel_gone_holds(scheduler_output, meta)
            self._hold_completed_prompts(scheduler_output, meta)
        return meta

    def _cancel_gone_holds(self, so: SchedulerOutput, meta: KVConnectorMetadata) -> None:
        """Forget this step's finished and preempted requests; cancel their holds."""
        for req_id in so.finished_req_ids:
            if req_id in self._holding:
                # Finished without `request_finished` (failed while waiting): the scheduler
                # freed its blocks already.
                meta.holds.append(_cancel_spec(req_id, report=False))
            self._watched.pop(req_id, None)
            self._holding.discard(req_id)
            self._released_early.discard(req_id)
        for req_id in so.preempted_req_ids:
            self._watched.pop(req_id, None)
            self._released_early.discard(req_id)
            if req_id in self._holding:
                # Its blocks are freed: drop the hold quietly; the recomputed prompt sets a
                # new one (a NewRequestData with the new blocks).
                self._holding.discard(req_id)
                meta.holds.append(_cancel_spec(req_id, report=False))

    def _hold_completed_prompts(self, so: SchedulerOutput, meta: KVConnectorMetadata) -> None:
        """Watch this step's new do_remote_decode requests; hold the prompts it completes."""
        computed_before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if _transfer_params(new.sampling_params).get("do_remote_decode") is True:
                self._watched[new.req_id] = _Watch(len(new.prompt_token_ids), list(new.block_ids))
                computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            watch = self._watched.get(req_id)
            if watch is not None:
                watch.block_ids.extend(cached.new_block_ids[i])
                computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed_before.items():
            watch = self._watched[req_id]
            if before + so.num_scheduled_tokens.get(req_id, 0) < watch.num_prompt_tokens:
                continue  # the prompt's KV is complete only after a later chunk
            del self._watched[req_id]
            num_blocks = -(-watch.num_prompt_tokens // self.block_size)
            meta.holds.append(
                KVTransferSpec(req_id, watch.block_ids[:num_blocks], 0, watch.num_prompt_tokens)
            )
            self._holding.add(req_id)
            self._released_early.discard(req_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            self._loads_in_flight.discard(req_id)
        for req_id in output.finished_sending:
            if req_id in self._holding:
                # Read or expired while its request still runs (it decodes here too): the
                # scheduler must not hold its blocks when it finishes.
                self._holding.discard(req_id)
                self._released_early.add(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._loads_in_flight:
            # Its blocks are being written: freed when the load is reported finished.
            return True, None
        self._watched.pop(req_id, None)
        if req_id in self._released_early:
            self._released_early.discard(req_id)
            return False, None
        if req_id not in self._holding:
            return False, None
        self._holding.discard(req_id)
        if request.status not in _NORMAL_FINISH:
            # Aborted (or failed): nobody will pull; the worker releases the blocks at once
            # (after a pull it may be serving).
            self._pending_cancels.append(_cancel_spec(req_id, report=True))
            return True, None
        kv = self.kv_config
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": kv.kv_ip,
            "remote_port": kv.kv_port,
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": prompt_hash(request.prompt_token_ids),
        }
