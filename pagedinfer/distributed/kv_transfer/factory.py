"""`create_connector`: the connector class `kv_transfer_config.kv_connector` names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig

__all__ = ["create_connector", "CONNECTORS"]

CONNECTORS: dict[str, str] = {
    # name -> module (imported only when used: Redis and ZMQ clients stay unloaded).
    "SharedStorageConnector": "pagedinfer.distributed.kv_transfer.shared_storage",
    "ExampleConnector": "pagedinfer.distributed.kv_transfer.shared_storage",  # vLLM's new name
    "RedisConnector": "pagedinfer.distributed.kv_transfer.redis_connector",
    "ZmqConnector": "pagedinfer.distributed.kv_transfer.zmq.connector",
}


def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    """The connector for `role`, or None without `kv_transfer_config`."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    module_name = kv.kv_connector_module_path or CONNECTORS.get(kv.kv_connector)
    if module_name is None:
        raise ValueError(
            f"Unknown kv_connector {kv.kv_connector!r}: one of {sorted(CONNECTORS)}, or set "
            "kv_connector_module_path"
        )
    name = "SharedStorageConnector" if kv.kv_connector == "ExampleConnector" else kv.kv_connector
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"{module_name}.{name} is not a KVConnectorBase subclass")
    return cls(config, role)
