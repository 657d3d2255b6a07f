"""The scheduler's side of KV transfer (disaggregated prefill, distributed/kv_transfer/).

`KVTransferTracker` keeps what the scheduler must remember about transfers between steps:
the scheduler-side connector, the requests whose asynchronous load has finished, the
finished requests whose blocks are held for a remote reader, and the transfer counters of
the current stats interval. The scheduler owns the queues and decides what a request does
next; this class answers its questions (how many tokens the connector provides, whether a
load arrived, which requests loaded invalid blocks) and frees or holds the blocks the
connector is done with. Section 2 of the vLLM reference describes the protocol.

Pure Python, no torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.messages import KVTransferStats
from pagedinfer.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections.abc import Container, Iterable

    from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
    from pagedinfer.distributed.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)

__all__ = ["KVTransferTracker", "restart_without_loaded_kv"]


class KVTransferTracker:
    def __init__(
        self,
        connector: KVConnectorBase,
        kv_cache_manager: KVCacheManager,
        failure_policy: str = "recompute",
    ) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.failure_policy = failure_policy
        """`kv_load_failure_policy`: "recompute" the prompt locally, or "fail" the request."""
        self.finished_recving: set[str] = set()
        """Live requests whose asynchronous load the workers reported finished."""
        self.held_requests: dict[str, Request] = {}
        """Finished requests whose blocks the connector holds for a remote reader."""
        self._stats = KVTransferStats()

    def has_pending(self, waiting: Iterable[Request]) -> bool:
        """Blocks held for a remote reader, or loads in flight."""
        return bool(self.held_requests) or any(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in waiting
        )

    def num_external_tokens(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """(tokens the connector provides after the local prefix hit, whether it loads them
        asynchronously); None while it cannot tell yet. At least the last prompt token is
        left to compute (its logits are needed). A request whose load failed gets none."""
        if request.kv_load_failed:
            return 0, False
        num_ext, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_ext is None:
            return None
        num_external = min(num_ext, request.num_tokens - 1 - num_local)
        if load_async and num_external <= 0:
            return 0, False
        return num_external, load_async

    def after_alloc(self, request: Request, num_external: int) -> None:
        """The request's slots are allocated: the connector may plan its load or save."""
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_block_ids(request.request_id), num_external
        )
        if num_external:
            request.num_external_computed_tokens = num_external

    def load_arrived(self, request: Request) -> bool:
        """Whether the asynchronous load of a waiting request has finished; if so, its
        loaded blocks enter the prefix cache and it becomes schedulable, or after a failed
        load (`find_failed_loads`) it starts over and computes its prompt."""
        if request.request_id not in self.finished_recving:
            return False
        self.finished_recving.discard(request.request_id)
        if request.kv_load_failed:
            restart_without_loaded_kv(self.kv_cache_manager, request)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.status = (
                RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            )
        return True

    def find_failed_loads(
        self, requests: Iterable[Request], invalid_block_ids: set[int]
    ) -> list[Request]:
        """The requests that loaded one of `invalid_block_ids` (missing, partial or
        corrupted KV), marked `kv_load_failed`; the scheduler decides what each does next
        by `failure_policy`."""
        failed: list[Request] = []
        for request in requests:
            if request.num_external_computed_tokens == 0 or request.kv_load_failed:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            if invalid_block_ids.isdisjoint(block_ids):
                continue
            request.kv_load_failed = True
            self._stats.num_failed_loads += 1
            logger.warning(
                "KV load failed for request %s (%d external tokens): %s.", request.request_id,
                request.num_external_computed_tokens,
                "finishing it with an error" if self.failure_policy == "fail"
                else "recomputing its prompt",
            )  # fmt: skip
            failed.append(request)
        return failed

    def request_finished(self, request: Request) -> dict[str, object] | None:
        """A finished request's blocks: freed, or held while the connector sends them (it
        returns the `kv_transfer_params` for the client)."""
        hold, params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id)
        )
        if hold:
            self.held_requests[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        self.finished_recving.discard(request.request_id)
        return params

    def update_from_output(self, kv_output: KVConnectorOutput, live: Container[str]) -> None:
        """Finished loads make their (`live`) requests schedulable; finished sends release
        held blocks. A request finished (aborted) while its load was in flight is held by
        its connector until the load ends: its blocks are still being written."""
        for req_id in kv_output.finished_recving:
            if req_id in live:
                self.finished_recving.add(req_id)
            elif (request := self.held_requests.pop(req_id, None)) is not None:
                self.kv_cache_manager.free(request)
        for req_id in kv_output.finished_sending:
            request = self.held_requests.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        self._stats.add(kv_output.stats)
        self.connector.update_connector_output(kv_output)

    def take_stats(self) -> KVTransferStats | None:
        """The transfers since the last call (and start counting anew)."""
        stats = self._stats
        if stats.is_empty():
            return None
        self._stats = KVTransferStats()
        return stats


def restart_without_loaded_kv(kv_cache_manager: KVCacheManager, request: Request) -> None:
    """Drop a request's blocks after a failed load (the bad ones were never entered in the
    prefix cache; its good local hits are found again) and make it compute its prompt from
    the start. The caller puts it in the waiting queue if it is not."""
    kv_cache_manager.free(request)
    request.num_computed_tokens = 0
    request.num_external_computed_tokens = 0
    request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
