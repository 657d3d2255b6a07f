"""`RedisConnector`: prompt KV in a Redis server, the shared KV-cache service of the seed's
disaggregated prefill (prefill instances write, decode instances read).

Keys, under `{prefix}{key}` (prefix "pagedinfer:kv:" by default):
    {prefix}{key}:{layer_name}   one layer: a msgpack header (shape, dtype, checksum) and
                                 the raw `[2, num_tokens, num_kv_heads, head_dim]` bytes
    {prefix}{key}                the commit marker, written last: the number of layers

A reader checks the marker only, so an entry is visible once complete; an entry that failed
to load loses its marker (`discard`), so the next save replaces it. Checksums bind each
layer to its key (`storage.entry_checksum`). Every key gets the
same time to live (`ttl_s`, default one hour; 0 keeps them), so the store does not grow
without bound; Redis' own `maxmemory` policy may evict entries too, and an entry with a
layer evicted fails its load (then the prompt is recomputed, per kv_load_failure_policy).

Options (`kv_connector_extra_config`): "redis_url" (default redis://127.0.0.1:6379/0),
"key_prefix", "ttl_s", "socket_timeout_s" (default 5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from pagedinfer.distributed.kv_transfer.storage import KVLoadError, KVStore, entry_checksum
from pagedinfer.distributed.kv_transfer.storage_connector import StorageConnector
from pagedinfer.distributed.kv_transfer.trust import transfer_secret
from pagedinfer.extras import require_extra

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig

__all__ = ["RedisConnector", "RedisStore"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _LayerHeader(msgspec.Struct, array_like=True):
    shape: list[int]
    dtype: str
    checksum: str


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_LayerHeader)
_LEN = 4  # bytes of the header's length prefix


class RedisConnector(StorageConnector):
    def make_store(self) -> KVStore:
        return RedisStore(self.kv_config)


class RedisStore(KVStore):
    """Entries as Redis keys (the layout above)."""

    def __init__(self, kv_config: KVTransferConfig) -> None:
        require_extra("redis", "redis", feature="kv_connector 'RedisConnector'")
        import redis

        url = str(kv_config.get_from_extra_config("redis_url", "redis://127.0.0.1:6379/0"))
        timeout = float(kv_config.get_from_extra_config("socket_timeout_s", 5.0))
        self.prefix = str(kv_config.get_from_extra_config("key_prefix", "pagedinfer:kv:"))
        self.ttl_s = int(kv_config.get_from_extra_config("ttl_s", 3600))
        self.secret = transfer_secret(kv_config)
        # Thread-safe (a connection pool): the save thread and the step share it.
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def exists(self, key: str) -> bool:
        try:
            return bool(self.client.exists(self.prefix + key))
        except Exception:  # the store is down: behave as a miss, compute the prompt
            return False

    def put_layer(self, key: str, layer_name: str, kv: torch.Tensor) -> None:
        kv = kv.contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        checksum = entry_checksum(kv, key, layer_name, self.secret)
        header = _ENCODER.encode(_LayerHeader(list(kv.shape), dtype, checksum))
        raw = memoryview(kv.view(torch.uint8).numpy())
        payload = b"".join((len(header).to_bytes(_LEN, "little"), header, raw))
        self.client.set(f"{self.prefix}{key}:{layer_name}", payload, ex=self.ttl_s or None)

    def commit(self, key: str, layer_names: list[str]) -> None:
        self.client.set(self.prefix + key, len(layer_names), ex=self.ttl_s or None)

    def get_layer(self, key: str, layer_name: str) -> torch.Tensor:
        payload = self.client.get(f"{self.prefix}{key}:{layer_name}")
        if payload is None:
            raise KVLoadError(f"{layer_name} is missing")
        try:
            size = int.from_bytes(payload[:_LEN], "little")
            header = _DECODER.decode(payload[_LEN : _LEN + size])
            dtype = _DTYPES[header.dtype]
        except (msgspec.DecodeError, KeyError, ValueError) as exc:
            raise KVLoadError(f"{layer_name}: unreadable header ({exc})") from exc
        data = np.frombuffer(payload, dtype=np.uint8, offset=_LEN + size)
        expected = int(np.prod(header.shape)) * torch.empty((), dtype=dtype).element_size()
        if data.size != expected:
            raise KVLoadError(f"{layer_name}: {data.size} bytes stored, {expected} expected")
        kv = torch.from_numpy(data.copy()).view(dtype).view(header.shape)
        if entry_checksum(kv, key, layer_name, self.secret) != header.checksum:
            raise KVLoadError(f"{layer_name} is corrupted (checksum mismatch)")
        return kv

    def discard(self, key: str) -> None:
        # The marker only: without it the entry is a miss, and the next save rewrites
        # every layer (the old ones expire with their time to live meanwhile).
        self.client.delete(self.prefix + key)

    def close(self) -> None:
        self.client.close()
