"""`ZmqConnectorScheduler`: the scheduler side of the ZmqConnector, called through the
`ZmqConnector` facade (`connector.py`) by the scheduler, on the scheduler's thread.

Consumer (decode instance):
- A request loads remote KV only if `trust.check_remote` believes its `kv_transfer_params`:
  a trusted producer, a valid tag when a transfer secret is set, and a prompt hash equal to
  the hash of its own first `remote_num_tokens` prompt tokens (it never pulls KV computed
  for another prompt). The load spec carries that hash: the producer checks it again.
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
- A hold spec carries the prompt's hash: the server serves it only to a pull naming it.
- A normally finished held request returns the `kv_transfer_params` the client passes to
  the decode instance: this instance's address, engine id, the request id, the prompt
  length and its hash, and with a transfer secret their tag (`trust.sign`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVTransferSpec
from pagedinfer.core.request import RequestStatus
from pagedinfer.distributed.kv_transfer.trust import (
    KVTransferRefused,
    RemotePrefill,
    check_remote,
    prompt_hash,
    sign,
    transfer_secret,
    trusted_producers,
)

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig
    from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput
    from pagedinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["ZmqConnectorScheduler"]

_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _transfer_params(sampling_params: SamplingParams | None) -> dict[str, Any]:
    extra = sampling_params.extra_args if sampling_params is not None else None
    params = extra.get("kv_transfer_params") if extra else None
    return params if isinstance(params, dict) else {}


def _remote(kv_config: KVTransferConfig, request: Request) -> RemotePrefill | None:
    """`request`'s remote prompt KV, if its params name KV this instance may load
    (`trust.check_remote`). The front end refused or stripped any other already; this is the
    engine's own check, for requests that reach it another way."""
    try:
        return check_remote(request.kv_transfer_params, kv_config, request.prompt_token_ids)
    except KVTransferRefused as exc:
        logger.warning("request %s: %s; computing the prompt locally", request.request_id, exc)
        return None


@dataclass
class _Watch:
    """A do_remote_decode request whose prompt is not complete yet."""

    num_prompt_tokens: int
    prompt_hash: str
    block_ids: list[int] = field(default_factory=list)


def _cancel_spec(req_id: str, report: bool) -> KVTransferSpec:
    return KVTransferSpec(req_id, [], 0, 0, params={"cancel": True, "report": report})


class ZmqConnectorScheduler:
    """Decides the loads (consumer) and the holds and cancels (producer) of each step."""

    def __init__(self, kv_config: KVTransferConfig, engine_id: str, block_size: int) -> None:
        self.kv_config = kv_config
        self.engine_id = engine_id
        self.block_size = block_size
        self._secret = transfer_secret(kv_config)
        trusted_producers(kv_config)  # a malformed list fails the start, not each request
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
        remote = _remote(self.kv_config, request)
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
        remote = _remote(self.kv_config, request)
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
                self._watched[new.req_id] = _Watch(
                    len(new.prompt_token_ids),
                    prompt_hash(new.prompt_token_ids),
                    list(new.block_ids),
                )
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
                KVTransferSpec(
                    req_id,
                    watch.block_ids[:num_blocks],
                    0,
                    watch.num_prompt_tokens,
                    params={"prompt_hash": watch.prompt_hash},
                )
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
        hash_ = prompt_hash(request.prompt_token_ids)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": kv.kv_ip,
            "remote_port": kv.kv_port,
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": hash_,
        }
        if self._secret is not None:
            params["remote_tag"] = sign(self._secret, self.engine_id, kv.kv_ip, kv.kv_port,
                                        req_id, request.num_prompt_tokens, hash_)  # fmt: skip
        return True, params
