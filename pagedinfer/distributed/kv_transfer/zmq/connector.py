"""`ZmqConnector`: the `KVConnectorBase` facade of the ZmqConnector (named in
`factory.CONNECTORS`). By its `KVConnectorRole` it holds either the scheduler side
(`ZmqConnectorScheduler`) or the worker side (`ZmqConnectorWorker`), never both, and
forwards each method of the interface to it; calling a method of the other side is a bug
(an assertion). The package docstring (`__init__.py`) describes the protocol.

Options (`kv_connector_extra_config`): "lease_timeout_s" (default 120), "transfer_timeout_s"
(default 30), "load_threads" (default 2). A producer needs a fixed `kv_port`, checked for
either role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedinfer.distributed.kv_transfer.zmq.scheduler import ZmqConnectorScheduler
from pagedinfer.distributed.kv_transfer.zmq.worker import ZmqConnectorWorker

if TYPE_CHECKING:
    import torch

    from pagedinfer.config import EngineConfig
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput
    from pagedinfer.distributed.kv_transfer.metadata import (
        KVConnectorMetadata,
        KVConnectorOutput,
    )

__all__ = ["ZmqConnector"]


class ZmqConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kv = self.kv_config
        if kv.is_kv_producer and kv.kv_port == 0:
            raise ValueError(
                "ZmqConnector: a producer needs a fixed kv_port (not 0): the port goes into "
                "the kv_transfer_params that tell decode instances where to pull from"
            )
        engine_id = kv.engine_id or ""
        self.connector_scheduler: ZmqConnectorScheduler | None = None
        self.connector_worker: ZmqConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ZmqConnectorScheduler(kv, engine_id, self.block_size)
        else:
            self.connector_worker = ZmqConnectorWorker(kv, engine_id, self.block_size)

    def _scheduler_side(self) -> ZmqConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker"
        return self.connector_scheduler

    def _worker_side(self) -> ZmqConnectorWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._scheduler_side().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self._worker_side().start_load_kv(self.get_connector_metadata())

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save(self.get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self._worker_side().get_finished(finished_req_ids)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
