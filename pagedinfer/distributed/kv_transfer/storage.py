"""Connectors that keep prompt KV in a store keyed by the prompt (a directory, Redis).

A producer stores the KV of each prompt it computes, layer by layer as the forward pass
writes it; a consumer whose prompt is in the store loads it into its paged cache before the
forward pass and computes only the rest. Both sides derive the same key from the prompt
tokens, so no transfer parameters need to travel between them.

- Key: sha256 of the model name, the request's `cache_salt` if any, and the prompt's
  first `aligned` token ids, where
  `aligned = (len(prompt) - 1) // block_size * block_size`: whole blocks, never the last
  prompt token (its logits must be computed), the same bound as the local prefix cache.
  Deviation: vLLM's example connector truncates one token more,
  `((len(prompt) - 1) - 1) // block_size * block_size`, losing a block when the prompt
  length is 1 mod the block size.
- Layout: one entry per layer, `[2, aligned, num_kv_heads, head_dim]` (K then V), each with
  a checksum; an entry becomes visible only once every layer is written (`KVStore.commit`), so a
  reader never sees a partial save.
- Layer by layer, both ways: the producer's attention layers hand their KV to a writer
  thread as they write it (`save_kv_layer`); the consumer's reader thread fetches layers in
  order from `start_load_kv` on, and each attention layer places its own just before it
  runs (`wait_for_layer_load`).
- Checksums (`entry_checksum`) cover the key and the layer name with the bytes, keyed by
  the transfer secret when one is set (`trust.transfer_secret`): an entry copied under
  another prompt's key fails, and without the secret nobody can write one that loads.
- Failures: a missing, truncated or corrupted layer makes the load fail; the request's
  loaded blocks are reported in `invalid_block_ids` and the scheduler applies
  `kv_load_failure_policy`. The entry is discarded (`KVStore.discard`), so the next
  producer computing that prompt stores it anew instead of keeping a bad one.

This module holds what both sides share: the store interface (`KVStore`), the key, the
slot and checksum helpers. The connector is split by role as the ZmqConnector is:
`storage_connector.StorageConnector` (the facade; `SharedStorageConnector`,
`RedisConnector` name their store), `storage_scheduler.StorageConnectorScheduler` (what to
load and save each step) and `storage_worker.StorageConnectorWorker` (the reader and writer
threads and the paged cache). A store object serves one side: the scheduler asks
`exists`, the worker puts, commits and gets.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import numpy as np
import torch

__all__ = [
    "KVLoadError",
    "KVStore",
    "entry_checksum",
    "kv_checksum",
    "prompt_store_key",
    "token_digest",
    "token_slots",
]


class KVLoadError(Exception):
    """Stored KV that cannot be used: missing, truncated, corrupted or mis-shaped."""


def kv_checksum(tensor: torch.Tensor) -> str:
    """A digest of a tensor's bytes (any dtype)."""
    data = tensor.detach().contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


def entry_checksum(kv: torch.Tensor, key: str, layer_name: str, secret: bytes | None) -> str:
    """A stored layer's digest: its bytes bound to its key, layer name, dtype and shape
    (the headers that say how to read the bytes), keyed by the transfer secret when there is
    one (then only its holders can write a loadable entry)."""
    mac_key = hashlib.sha256(secret).digest() if secret else b""
    digest = hashlib.blake2b(key=mac_key, digest_size=16)
    digest.update(f"{key}|{layer_name}|{kv.dtype}|{tuple(kv.shape)}|".encode())
    digest.update(memoryview(kv.detach().contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()


def token_slots(block_ids: list[int], start: int, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of tokens `[start, start + num_tokens)` of a request with these blocks."""
    positions = np.arange(start, start + num_tokens, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    return torch.from_numpy(blocks * block_size + positions % block_size)


def token_digest(token_ids: list[int], tag: str = "") -> str:
    """sha256 (hex) of `tag` and the token ids as int64 bytes."""
    digest = hashlib.sha256(tag.encode())
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


def prompt_store_key(
    model: str | None,
    block_size: int,
    prompt_token_ids: list[int],
    cache_salt: str | None = None,
) -> tuple[str, int]:
    """The store key of a prompt and the number of its tokens stored under it. A salted
    request (`cache_salt`, a tenant's) has keys of its own, as its prefix-cache blocks do."""
    aligned = max((len(prompt_token_ids) - 1) // block_size * block_size, 0)
    tag = f"{model or 'default'}|" if cache_salt is None else f"{model or 'default'}|{cache_salt}|"
    return token_digest(prompt_token_ids[:aligned], tag), aligned


class KVStore(ABC):
    """Where a store-backed connector keeps prompt KV (a directory, a Redis server)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a complete entry (every layer) is stored under `key`."""

    @abstractmethod
    def put_layer(self, key: str, layer_name: str, kv: torch.Tensor) -> None:
        """Store one layer's `[2, num_tokens, num_kv_heads, head_dim]` KV (not yet
        visible). Runs on the writer thread."""

    @abstractmethod
    def commit(self, key: str, layer_names: list[str]) -> None:
        """Make the entry visible, once every layer is stored."""

    @abstractmethod
    def get_layer(self, key: str, layer_name: str) -> torch.Tensor:
        """One layer's stored KV; raises KVLoadError if it is missing or corrupted."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Remove the entry under `key` (one that failed to load), so that the next save of
        that prompt replaces it; a missing entry is not an error."""

    def close(self) -> None:  # noqa: B027
        """Release the store's clients (at shutdown)."""
