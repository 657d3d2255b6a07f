"""`ZmqConnectorWorker`: the worker side of the ZmqConnector, called through the
`ZmqConnector` facade (`connector.py`) by the model runner, once per step, on the worker's
main thread.

Invariants:
- `register_kv_caches` starts the threads: a producer's `KVServer` (its ROUTER bound
  there, so a port in use fails the start) and a consumer's `KVPuller` load threads; both
  for "kv_both". One ZeroMQ context serves them, destroyed at `shutdown` after the threads
  closed their sockets.
- Per step: `start_load_kv` (before the forward pass) applies the step's cancels first —
  a preempted request's blocks were freed in this step's schedule and may be written by
  this very forward pass — then queues the loads; `wait_for_save` (after the forward pass
  wrote the prompts' KV) makes the step's holds pullable for `lease_timeout_s`.
- `get_finished` reports expired and served holds in `finished_sending`, and scatters the
  pulled KV into the paged cache (here, never while a forward pass runs) before reporting
  the request in `finished_recving`; a failed pull also reports the request's blocks of
  `[start, start + n)` in `invalid_block_ids` (the scheduler applies
  `kv_load_failure_policy`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch
import zmq

from pagedinfer.attention.backend import flat_kv_cache
from pagedinfer.core.kv_transfer_metadata import KVConnectorOutput
from pagedinfer.distributed.kv_transfer.storage import token_slots
from pagedinfer.distributed.kv_transfer.zmq.puller import KVPuller
from pagedinfer.distributed.kv_transfer.zmq.server import KVServer
from pagedinfer.distributed.kv_transfer.zmq.wire import tcp_address

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig
    from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVTransferSpec

logger = logging.getLogger(__name__)

__all__ = ["ZmqConnectorWorker"]


class ZmqConnectorWorker:
    """Holds a producer's prompt KV for pulls; pulls a consumer's prompt KV."""

    def __init__(self, kv_config: KVTransferConfig, engine_id: str, block_size: int) -> None:
        self.kv_config = kv_config
        self.engine_id = engine_id
        self.block_size = block_size
        self.lease_timeout_s = float(kv_config.get_from_extra_config("lease_timeout_s", 120.0))
        transfer_timeout_s = float(kv_config.get_from_extra_config("transfer_timeout_s", 30.0))
        self.num_load_threads = max(1, int(kv_config.get_from_extra_config("load_threads", 2)))
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._threads: list[threading.Thread] = []
        self._server = KVServer(engine_id, block_size, self._stop)
        self._puller = KVPuller(transfer_timeout_s, self._stop)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self._ctx = zmq.Context()
        kv = self.kv_config
        if kv.is_kv_producer:
            address = tcp_address(kv.kv_ip, kv.kv_port)
            try:
                self._threads.append(self._server.start(self._ctx, address, kv_caches))
            except ValueError:
                self._ctx.term()
                self._ctx = None
                raise
            logger.info("ZmqConnector serving KV on %s (engine %s)", address, self.engine_id)
        if kv.is_kv_consumer:
            self._threads += self._puller.start(self._ctx, kv_caches, self.num_load_threads)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        cancels = [spec for spec in meta.holds if spec.params.get("cancel")]
        if cancels:
            # Before the forward pass: a preempted request's blocks were freed in this
            # step's schedule and may be written by this very forward pass.
            self._server.cancel(cancels)
        for spec in meta.loads:
            self._puller.submit(spec)

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        holds = [s for s in meta.holds if not s.params.get("cancel")]
        if not holds:
            return
        # The forward pass wrote the prompts' KV: the holds become pullable now.
        self._server.add_holds(holds, time.monotonic() + self.lease_timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        out.finished_sending.extend(self._server.take_finished())
        for result in self._puller.take_results():
            spec = result.spec
            if result.error is None:
                assert result.layers is not None
                try:
                    self._scatter(spec, result.layers)
                except Exception as exc:  # a device error: the blocks are not usable
                    result.error = f"{type(exc).__name__}: {exc}"
            if result.error is None:
                out.stats.num_loaded_tokens += spec.num_tokens
                out.stats.num_loaded_bytes += result.num_bytes
                out.stats.load_time_s += result.elapsed_s
            else:
                first = spec.start // self.block_size
                last = -(-(spec.start + spec.num_tokens) // self.block_size)
                out.invalid_block_ids.extend(spec.block_ids[first:last])
                logger.warning("KV pull of request %s failed: %s", spec.req_id, result.error)
            out.finished_recving.append(spec.req_id)
        return out

    def _scatter(self, spec: KVTransferSpec, layers: dict[str, torch.Tensor]) -> None:
        slots = token_slots(spec.block_ids, spec.start, spec.num_tokens, self.block_size)
        for name, kv_cache in self.kv_caches.items():
            part = layers[name].to(kv_cache.device)  # [2, n, kv_heads, head_dim]
            key_cache, value_cache = flat_kv_cache(kv_cache)
            slots_here = slots.to(kv_cache.device)
            key_cache.index_copy_(0, slots_here, part[0])
            value_cache.index_copy_(0, slots_here, part[1])

    def shutdown(self) -> None:
        self._stop.set()
        self._puller.wake_threads()
        for thread in self._threads:
            thread.join(timeout=10)
            if thread.is_alive():
                logger.warning("ZmqConnector thread %s did not stop", thread.name)
        self._threads = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # the threads closed their sockets
            self._ctx = None
        self._server.clear()
        self._puller.clear()
