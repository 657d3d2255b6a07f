"""`StorageConnector`: the `KVConnectorBase` facade of the store-backed connectors
(`storage.py` describes them). A `RoleSplitConnector`: by its `KVConnectorRole` it holds
either the scheduler side (`StorageConnectorScheduler`) or the worker side
(`StorageConnectorWorker`) and forwards each method of the interface to it. The side gets
its store object from `make_store`, which the subclasses (`SharedStorageConnector`,
`RedisConnector`) implement; the store is closed at `shutdown`, after the worker's threads
finished.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from pagedinfer.distributed.kv_transfer.base import RoleSplitConnector
from pagedinfer.distributed.kv_transfer.storage_scheduler import StorageConnectorScheduler
from pagedinfer.distributed.kv_transfer.storage_worker import StorageConnectorWorker

if TYPE_CHECKING:
    import torch

    from pagedinfer.distributed.kv_transfer.storage import KVStore

__all__ = ["StorageConnector"]


class StorageConnector(RoleSplitConnector[StorageConnectorScheduler, StorageConnectorWorker]):
    """A connector whose producer and consumer meet in a `KVStore`."""

    @abstractmethod
    def make_store(self) -> KVStore:
        """The store, configured from `self.kv_config`."""

    def make_scheduler_side(self) -> StorageConnectorScheduler:
        return StorageConnectorScheduler(self.config, self.make_store())

    def make_worker_side(self) -> StorageConnectorWorker:
        return StorageConnectorWorker(self.block_size, self.make_store())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side().wait_for_layer_load(self.get_connector_metadata(), layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.worker_side().save_kv_layer(self.get_connector_metadata(), layer_name, kv_layer)

    def shutdown(self) -> None:
        super().shutdown()  # the worker's threads first: they use the store
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        side.store.close()
