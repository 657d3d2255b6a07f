"""Connectors that keep prompt KV in a store keyed by the prompt (a directory, Redis).

A producer stores the KV of each prompt it computes, layer by layer as the forward pass
writes it; a consumer whose prompt is in the store loads it into its paged cache before the
forward pass and computes only the rest. Both sides derive the same key from the prompt
tokens, so no transfer parameters need to travel between them.

- Key: sha256 of the model name and the prompt's first `aligned` token ids, where
  `aligned = (len(prompt) - 1) // block_size * block_size`: whole blocks, never the last
  prompt token (its logits must be computed), the same bound as the local prefix cache.
  Deviation: vLLM's example connector truncates one token more,
  `((len(prompt) - 1) - 1) // block_size * block_size`, losing a block when the prompt
  length is 1 mod the block size.
- Layout: one entry per layer, `[2, aligned, num_kv_heads, head_dim]` (K then V), each with
  a checksum; an entry becomes visible only once every layer is written (`_commit`), so a
  reader never sees a partial save.
- Layer by layer, both ways: the producer's attention layers hand their KV to a writer
  thread as they write it (`save_kv_layer`); the consumer's reader thread fetches layers in
  order from `start_load_kv` on, and each attention layer places its own just before it
  runs (`wait_for_layer_load`).
- Failures: a missing, truncated or corrupted layer makes the load fail; the request's
  loaded blocks are reported in `invalid_block_ids` and the scheduler applies
  `kv_load_failure_policy`.

Subclasses implement the store: `_exists`, `_put_layer`, `_commit`, `_get_layer`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from abc import abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedinfer.attention.backend import flat_kv_cache
from pagedinfer.core.kv_transfer_metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferSpec,
)
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = [
    "StorageConnector",
    "KVLoadError",
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
    model: str | None, block_size: int, prompt_token_ids: list[int]
) -> tuple[str, int]:
    """The store key of a prompt and the number of its tokens stored under it."""
    aligned = max((len(prompt_token_ids) - 1) // block_size * block_size, 0)
    return token_digest(prompt_token_ids[:aligned], f"{model or 'default'}|"), aligned


class StorageConnector(KVConnectorBase):
    """The scheduler and worker logic shared by store-backed connectors."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        # Scheduler side.
        self._pending_loads: list[KVTransferSpec] = []
        # Requests whose prompt KV is not saved yet: store key, tokens stored under it
        # and block table (the key hashed once, not at every chunk of the prompt).
        self._unsaved: dict[str, tuple[str, int, list[int]]] = {}
        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        # This step's loads: per layer, the reader's pending result; failed requests.
        self._loading: dict[str, Future[tuple[list[torch.Tensor | KVLoadError], float]]] = {}
        self._load_errors: dict[str, KVLoadError] = {}
        self._writes: list[Future[float]] = []
        self._out = KVConnectorOutput()

    # ----------------------------------------------------------------- the store

    @abstractmethod
    def _exists(self, key: str) -> bool:
        """Whether a complete entry (every layer) is stored under `key`."""

    @abstractmethod
    def _put_layer(self, key: str, layer_name: str, kv: torch.Tensor) -> None:
        """Store one layer's `[2, num_tokens, num_kv_heads, head_dim]` KV (not yet
        visible). Runs on the writer thread."""

    @abstractmethod
    def _commit(self, key: str, layer_names: list[str]) -> None:
        """Make the entry visible, once every layer is stored."""

    @abstractmethod
    def _get_layer(self, key: str, layer_name: str) -> torch.Tensor:
        """One layer's stored KV; raises KVLoadError if it is missing or corrupted."""

    # ------------------------------------------------------------ scheduler side

    def prompt_key(self, prompt_token_ids: list[int]) -> tuple[str, int]:
        return prompt_store_key(self.config.model_config.model, self.block_size, prompt_token_ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.kv_config.is_kv_consumer:
            return 0, False  # a prefill instance computes its prompts
        key, aligned = self.prompt_key(request.prompt_token_ids)
        if aligned <= num_computed_tokens or not self._exists(key):
            return 0, False
        return aligned - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        key, aligned = self.prompt_key(request.prompt_token_ids)
        self._pending_loads.append(
            KVTransferSpec(
                req_id=request.request_id,
                block_ids=list(block_ids),
                start=aligned - num_external_tokens,
                num_tokens=num_external_tokens,
                key=key,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.kv_config.is_kv_producer:
            return meta
        so = scheduler_output
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._unsaved.pop(req_id, None)
        computed_before: dict[str, int] = {}
        loaded = {spec.req_id for spec in meta.loads}
        for new in so.scheduled_new_reqs:
            if new.req_id not in loaded:
                key, aligned = self.prompt_key(new.prompt_token_ids)
                self._unsaved[new.req_id] = (key, aligned, list(new.block_ids))
                computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            entry = self._unsaved.get(req_id)
            if entry is not None:
                entry[2].extend(cached.new_block_ids[i])
                computed_before[req_id] = cached.num_computed_tokens[i]
        keys_this_step: set[str] = set()
        for req_id, start in computed_before.items():
            key, aligned, block_ids = self._unsaved[req_id]
            if start + so.num_scheduled_tokens[req_id] < aligned:
                continue  # the prompt's KV is complete only after a later chunk
            del self._unsaved[req_id]
            if aligned == 0 or key in keys_this_step or self._exists(key):
                continue
            keys_this_step.add(key)
            num_blocks = -(-aligned // self.block_size)
            meta.saves.append(KVTransferSpec(req_id, block_ids[:num_blocks], 0, aligned, key))
        return meta

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self) -> None:
        """Start reading this step's loads on the reader thread, one layer after another:
        `wait_for_layer_load` places layer i in the paged cache just before layer i's
        attention, so reading later layers overlaps the forward pass of earlier ones."""
        meta = self.get_connector_metadata()
        self._loading = {}
        self._load_errors = {}
        if not meta.loads:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        for name in self.kv_caches:
            self._loading[name] = self._reader.submit(self._read_layer, meta.loads, name)

    def _read_layer(
        self, specs: list[KVTransferSpec], name: str
    ) -> tuple[list[torch.Tensor | KVLoadError], float]:
        """One layer of every load (reader thread): the tokens to place, `[2, n, kv_heads,
        head_dim]` in the cache's dtype, or the error; and the time it took."""
        start = time.perf_counter()
        kv_cache = self.kv_caches[name]
        out: list[torch.Tensor | KVLoadError] = []
        for spec in specs:
            end = spec.start + spec.num_tokens
            try:
                stored = self._get_layer(spec.key, name)  # [2, aligned, kv_heads, head_dim]
                expected = (kv_cache.shape[-2], kv_cache.shape[-1])
                if stored.dim() != 4 or stored.shape[0] != 2 or tuple(stored.shape[2:]) != expected:
                    raise KVLoadError(f"{name}: stored shape {tuple(stored.shape)} does not fit")
                if stored.shape[1] < end:
                    raise KVLoadError(f"{name}: {stored.shape[1]} tokens stored, {end} needed")
                out.append(stored[:, spec.start : end].to(kv_cache.dtype))
            except KVLoadError as exc:
                out.append(exc)
            except Exception as exc:  # an unreadable file, a dropped connection, ...
                out.append(KVLoadError(f"{name}: {type(exc).__name__}: {exc}"))
        return out, time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        future = self._loading.pop(layer_name, None)
        if future is None:
            return
        parts, read_time = future.result()
        start = time.perf_counter()
        key_cache, value_cache = flat_kv_cache(self.kv_caches[layer_name])
        for spec, part in zip(self.get_connector_metadata().loads, parts):
            if spec.req_id in self._load_errors:
                continue
            if isinstance(part, KVLoadError):
                self._load_errors[spec.req_id] = part
                continue
            slots = token_slots(spec.block_ids, spec.start, spec.num_tokens, self.block_size)
            key_cache.index_copy_(0, slots, part[0])
            value_cache.index_copy_(0, slots, part[1])
            self._out.stats.num_loaded_bytes += part.numel() * part.element_size()
        self._out.stats.load_time_s += read_time + time.perf_counter() - start

    def _finish_loads(self) -> None:
        """After the forward pass: place any layer it did not wait for, then report each
        load: its tokens, or its blocks as invalid (the scheduler recomputes or fails it;
        this step's output of that request is dropped)."""
        for name in list(self._loading):
            self.wait_for_layer_load(name)
        for spec in self.get_connector_metadata().loads:
            error = self._load_errors.get(spec.req_id)
            if error is None:
                self._out.stats.num_loaded_tokens += spec.num_tokens
                continue
            first = spec.start // self.block_size
            last = -(-(spec.start + spec.num_tokens) // self.block_size)
            self._out.invalid_block_ids.extend(spec.block_ids[first:last])
            logger.warning("KV load of request %s failed: %s", spec.req_id, error)
        self._load_errors = {}

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        meta = self.get_connector_metadata()
        if not meta.saves:
            return
        key_cache, value_cache = flat_kv_cache(kv_layer)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-save")
        for spec in meta.saves:
            slots = token_slots(spec.block_ids, 0, spec.num_tokens, self.block_size)
            # A copy: the paged buffers may be overwritten by later steps.
            kv = torch.stack([key_cache.index_select(0, slots), value_cache.index_select(0, slots)])
            self._writes.append(self._writer.submit(self._timed_put, spec.key, layer_name, kv))
            self._out.stats.num_saved_bytes += kv.numel() * kv.element_size()

    def _timed_put(self, key: str, layer_name: str, kv: torch.Tensor) -> float:
        start = time.perf_counter()
        self._put_layer(key, layer_name, kv)
        return time.perf_counter() - start

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta = self.get_connector_metadata()
        if not meta.saves:
            return
        writes, self._writes = self._writes, []
        failed = False
        for future in writes:
            try:
                self._out.stats.save_time_s += future.result()
            except Exception as exc:  # the store is down or full: this save is lost
                logger.warning("KV save failed: %s", exc)
                failed = True
        if failed:
            return
        names = list(self.kv_caches)
        for spec in meta.saves:
            start = time.perf_counter()
            try:
                self._commit(spec.key, names)
            except Exception as exc:
                logger.warning("KV save of request %s failed: %s", spec.req_id, exc)
                continue
            self._out.stats.num_saved_tokens += spec.num_tokens
            self._out.stats.save_time_s += time.perf_counter() - start

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        return out

    def shutdown(self) -> None:
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._reader = self._writer = None
