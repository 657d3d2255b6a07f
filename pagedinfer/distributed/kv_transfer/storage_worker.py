"""`StorageConnectorWorker`: the worker side of the store-backed connectors (`storage.py`
describes them), called through the `StorageConnector` facade (`storage_connector.py`) by
the model runner, on the worker's main thread.

Invariants:
- One reader thread and one writer thread (created on first use); the paged cache is
  written only on the main thread.
- Loads: `start_load_kv` queues one read per layer, in layer order; `wait_for_layer_load`
  places a layer's KV just before its attention runs, and `wait_for_save` places any
  layer the forward pass did not wait for. A request with any failed layer stops being
  placed and is reported with its loaded blocks in `invalid_block_ids`.
- Saves: each attention layer's KV of the step's saves is copied out of the paged cache
  (later steps may overwrite it) and put by the writer thread; `wait_for_save` waits for
  every put and commits each entry only if all puts succeeded, so a failed save leaves
  no visible entry.
- `get_finished` reports the counters and failures since the last call (loads are
  synchronous: nothing in `finished_recving`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from pagedinfer.attention.backend import flat_kv_cache
from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
from pagedinfer.distributed.kv_transfer.storage import KVLoadError, token_slots

if TYPE_CHECKING:
    from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVTransferSpec
    from pagedinfer.distributed.kv_transfer.storage import KVStore

logger = logging.getLogger(__name__)

__all__ = ["StorageConnectorWorker"]


class StorageConnectorWorker:
    """Loads prompt KV from the store into the paged cache, and saves it there."""

    def __init__(self, block_size: int, store: KVStore) -> None:
        self.block_size = block_size
        self.store = store
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        # This step's loads: per layer, the reader's pending result; failed requests.
        self._loading: dict[str, Future[tuple[list[torch.Tensor | KVLoadError], float]]] = {}
        self._load_errors: dict[str, KVLoadError] = {}
        self._writes: list[Future[float]] = []
        self._out = KVConnectorOutput()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start reading this step's loads on the reader thread, one layer after another:
        `wait_for_layer_load` places layer i in the paged cache just before layer i's
        attention, so reading later layers overlaps the forward pass of earlier ones."""
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
                stored = self.store.get_layer(spec.key, name)  # [2, aligned, kv_heads, head_dim]
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

    def wait_for_layer_load(self, meta: KVConnectorMetadata, layer_name: str) -> None:
        future = self._loading.pop(layer_name, None)
        if future is None:
            return
        parts, read_time = future.result()
        start = time.perf_counter()
        key_cache, value_cache = flat_kv_cache(self.kv_caches[layer_name])
        for spec, part in zip(meta.loads, parts):
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

    def _finish_loads(self, meta: KVConnectorMetadata) -> None:
        """After the forward pass: place any layer it did not wait for, then report each
        load: its tokens, or its blocks as invalid (the scheduler recomputes or fails it;
        this step's output of that request is dropped)."""
        for name in list(self._loading):
            self.wait_for_layer_load(meta, name)
        for spec in meta.loads:
            error = self._load_errors.get(spec.req_id)
            if error is None:
                self._out.stats.num_loaded_tokens += spec.num_tokens
                continue
            first = spec.start // self.block_size
            last = -(-(spec.start + spec.num_tokens) // self.block_size)
            self._out.invalid_block_ids.extend(spec.block_ids[first:last])
            logger.warning("KV load of request %s failed: %s", spec.req_id, error)
            try:
                # A bad entry is not kept: the next save of the prompt replaces it.
                self.store.discard(spec.key)
            except Exception as exc:  # the store is down: the entry stays, loads keep failing
                logger.warning("could not discard the KV entry %s: %s", spec.key, exc)
        self._load_errors = {}

    def save_kv_layer(
        self, meta: KVConnectorMetadata, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
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
        self.store.put_layer(key, layer_name, kv)
        return time.perf_counter() - start

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        self._finish_loads(meta)
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
                self.store.commit(spec.key, names)
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
