"""`ZmqConnector`: the `KVConnectorBase` facade of the ZmqConnector (named in
`factory.CONNECTORS`). A `RoleSplitConnector`: by its `KVConnectorRole` it holds either
the scheduler side (`ZmqConnectorScheduler`) or the worker side (`ZmqConnectorWorker`) and
forwards each method of the interface to it. The package docstring (`__init__.py`)
describes the protocol.

Options (`kv_connector_extra_config`): "lease_timeout_s" (default 120), "transfer_timeout_s"
(default 30), "load_threads" (default 2). A producer needs a fixed `kv_port`, checked for
either role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedinfer.distributed.kv_transfer.base import RoleSplitConnector
from pagedinfer.distributed.kv_transfer.zmq.scheduler import ZmqConnectorScheduler
from pagedinfer.distributed.kv_transfer.zmq.worker import ZmqConnectorWorker

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig
    from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
    from pagedinfer.core.request import Request
    from pagedinfer.distributed.kv_transfer.base import KVConnectorRole

__all__ = ["ZmqConnector"]


class ZmqConnector(RoleSplitConnector[ZmqConnectorScheduler, ZmqConnectorWorker]):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        kv = config.kv_transfer_config
        if kv is not None and kv.is_kv_producer and kv.kv_port == 0:
            raise ValueError(
                "ZmqConnector: a producer needs a fixed kv_port (not 0): the port goes into "
                "the kv_transfer_params that tell decode instances where to pull from"
            )
        super().__init__(config, role)

    def make_scheduler_side(self) -> ZmqConnectorScheduler:
        return ZmqConnectorScheduler(
            self.kv_config, self.kv_config.engine_id or "", self.block_size
        )

    def make_worker_side(self) -> ZmqConnectorWorker:
        return ZmqConnectorWorker(self.kv_config, self.kv_config.engine_id or "", self.block_size)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler_side().update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side().request_finished(request, block_ids)
