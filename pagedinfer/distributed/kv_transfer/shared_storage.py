"""`SharedStorageConnector`: prompt KV in a local or shared directory (vLLM's debugging
connector, renamed `ExampleConnector` there; the seed's walk-through of disaggregated
prefill uses it).

    {shared_storage_path}/{key}/model.layers.{i}.self_attn.safetensors

Each file holds `kv_cache`, `[2, num_tokens, num_kv_heads, head_dim]`, and its checksum in
the safetensors metadata. Layers are written into a hidden temporary directory that is
renamed to `{key}` once all are written: the rename is atomic, so a reader sees either no
entry or a complete one (on a shared filesystem with atomic rename, e.g. NFS v3+ within one
export). Only an entry that failed to load is deleted (renamed aside, then removed, so a
reader never sees half of it); clearing the directory is otherwise the operator's business.
Checksums bind each layer to its key (`storage.entry_checksum`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedinfer.distributed.kv_transfer.storage import KVLoadError, KVStore, entry_checksum
from pagedinfer.distributed.kv_transfer.storage_connector import StorageConnector
from pagedinfer.distributed.kv_transfer.trust import transfer_secret

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig

__all__ = ["SharedStorageConnector", "SharedStorageStore"]


class SharedStorageConnector(StorageConnector):
    def make_store(self) -> KVStore:
        return SharedStorageStore(self.kv_config)


class SharedStorageStore(KVStore):
    """Entries as directories under `shared_storage_path` (extra config, default /tmp)."""

    def __init__(self, kv_config: KVTransferConfig) -> None:
        self.root = str(kv_config.get_from_extra_config("shared_storage_path", "/tmp"))
        os.makedirs(self.root, exist_ok=True)
        self.secret = transfer_secret(kv_config)
        # Worker side: key -> the temporary directory being written.
        self._staging: dict[str, str] = {}

    def _entry(self, key: str) -> str:
        return os.path.join(self.root, key)

    def exists(self, key: str) -> bool:
        return os.path.isdir(self._entry(key))

    def put_layer(self, key: str, layer_name: str, kv: torch.Tensor) -> None:
        staging = self._staging.get(key)
        if staging is None:
            staging = os.path.join(self.root, f".tmp-{key}-{uuid.uuid4().hex[:8]}")
            os.makedirs(staging)
            self._staging[key] = staging
        save_file(
            {"kv_cache": kv.contiguous()},
            os.path.join(staging, f"{layer_name}.safetensors"),
            metadata={"checksum": entry_checksum(kv, key, layer_name, self.secret)},
        )

    def commit(self, key: str, layer_names: list[str]) -> None:
        staging = self._staging.pop(key)
        try:
            os.rename(staging, self._entry(key))
        except OSError:
            # Another instance stored the same prompt first (the entry exists): keep theirs.
            shutil.rmtree(staging, ignore_errors=True)
            if not self.exists(key):
                raise

    def get_layer(self, key: str, layer_name: str) -> torch.Tensor:
        path = os.path.join(self._entry(key), f"{layer_name}.safetensors")
        try:
            with safe_open(path, framework="pt") as f:
                checksum = (f.metadata() or {}).get("checksum")
                kv = f.get_tensor("kv_cache")
        except FileNotFoundError:
            raise KVLoadError(f"{path} is missing") from None
        except Exception as exc:  # a truncated or garbled header
            raise KVLoadError(f"{path} is unreadable: {exc}") from exc
        if checksum != entry_checksum(kv, key, layer_name, self.secret):
            raise KVLoadError(f"{path} is corrupted (checksum mismatch)")
        return kv

    def discard(self, key: str) -> None:
        aside = os.path.join(self.root, f".discard-{key}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self._entry(key), aside)
        except FileNotFoundError:
            return  # gone already (another reader discarded it)
        shutil.rmtree(aside, ignore_errors=True)
