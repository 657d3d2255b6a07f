"""`KVPuller`: the consumer worker's load threads, which pull prompt KV from producers.
Created by `ZmqConnectorWorker` (`worker.py`), which submits the step's load specs and
collects the results from the worker's main thread.

Invariants:
- `load_threads` threads take specs from one queue; each keeps its own DEALER per
  producer address (at most `_MAX_PEERS`, least recently used closed), so a socket is
  used by one thread only. A socket monitor tells a refused or dropped connection at once
  (ZeroMQ itself retries silently); a socket whose connection failed or timed out is
  closed, not reused (a late reply may still arrive on it).
- Each pull has a fresh xfer id; a reply with another id (late, to a pull that timed out)
  is discarded. A reply is checked whole (`wire.check_reply`, `wire.receive_layers`)
  before its KV is handed over; every failure becomes a result with `error` set, never
  an exception in the thread.
- The threads never touch the paged cache: the main thread scatters the results
  (`take_results`) between forward passes. A pull of 0 tokens only releases the remote
  hold and yields no result.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedinfer.distributed.kv_transfer.storage import KVLoadError
from pagedinfer.distributed.kv_transfer.zmq.wire import (
    ENCODER,
    REPLY_DECODER,
    PullError,
    PullReply,
    PullRequest,
    check_reply,
    discard_rest,
    receive_layers,
    tcp_address,
)

if TYPE_CHECKING:
    from pagedinfer.core.kv_transfer_metadata import KVTransferSpec

logger = logging.getLogger(__name__)

__all__ = ["KVPuller", "LoadResult"]

_POLL_MS = 100  # how often the threads look at the stop flag
_MAX_PEERS = 64  # DEALER sockets one load thread keeps open (least recently used closed)


@dataclass
class LoadResult:
    """One finished pull: the KV per layer, or the error that made it fail."""

    spec: KVTransferSpec
    layers: dict[str, torch.Tensor] | None  # [2, n, kv_heads, head_dim], the local dtype
    num_bytes: int
    elapsed_s: float
    error: str | None = None


class _Peer:
    """One DEALER connected to a producer, with a monitor that tells a refused or dropped
    connection at once (ZeroMQ itself retries silently)."""

    _EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(self._EVENTS)
        self.sock.connect(address)
        self.used = False

    def drain_events(self) -> None:
        """Forget events of earlier pulls (a reconnect after a drop is fine)."""
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)

    def check_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECT_RETRIED:
                raise PullError(f"cannot connect to {self.address} (refused or unreachable)")
            if event == zmq.EVENT_DISCONNECTED:
                raise PullError(f"{self.address} closed the connection")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class KVPuller:
    """The load threads of a consumer worker and their results."""

    def __init__(self, transfer_timeout_s: float, stop: threading.Event) -> None:
        self.transfer_timeout_s = transfer_timeout_s
        self._stop = stop
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._ctx: zmq.Context | None = None
        self._threads: list[threading.Thread] = []
        self._queue: queue.Queue[KVTransferSpec | None] = queue.Queue()
        self._lock = threading.Lock()  # guards `_loaded`
        self._loaded: list[LoadResult] = []
        self._xfer_ids = itertools.count(1)

    def start(
        self, ctx: zmq.Context, kv_caches: dict[str, torch.Tensor], num_threads: int
    ) -> list[threading.Thread]:
        self._ctx = ctx
        self.kv_caches = kv_caches
        for i in range(num_threads):
            thread = threading.Thread(target=self._load_loop, name=f"kv-zmq-load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self._threads

    # ------------------------------------------------------------ main thread

    def submit(self, spec: KVTransferSpec) -> None:
        self._queue.put(spec)

    def take_results(self) -> list[LoadResult]:
        """The pulls finished since the last call."""
        with self._lock:
            loaded, self._loaded = self._loaded, []
        return loaded

    def wake_threads(self) -> None:
        """Let each thread leave its wait on the queue (after the stop flag is set)."""
        for _ in self._threads:
            self._queue.put(None)

    def clear(self) -> None:
        """Forget the results (at shutdown, after the threads stopped)."""
        self._threads = []
        with self._lock:
            self._loaded = []

    # ----------------------------------------------------------- load threads

    def _load_loop(self) -> None:
        peers: dict[str, _Peer] = {}  # this thread's sockets, most recently used last
        try:
            while not self._stop.is_set():
                spec = self._queue.get()
                if spec is None:
                    break
                start = time.perf_counter()
                layers: dict[str, torch.Tensor] | None = None
                num_bytes, error = 0, None
                try:
                    layers, num_bytes = self._pull(spec, peers)
                except KVLoadError as exc:
                    error = str(exc)
                except Exception as exc:  # a bug or a ZeroMQ error: still a failed load
                    logger.exception("KV pull of request %s failed", spec.req_id)
                    error = f"{type(exc).__name__}: {exc}"
                if spec.num_tokens == 0:
                    continue  # only released the remote hold
                result = LoadResult(spec, layers, num_bytes, time.perf_counter() - start, error)
                with self._lock:
                    self._loaded.append(result)
        finally:
            for peer in peers.values():
                peer.close()

    def _peer(self, peers: dict[str, _Peer], address: str) -> _Peer:
        peer = peers.pop(address, None)
        if peer is None:
            assert self._ctx is not None
            peer = _Peer(self._ctx, address)
            if len(peers) >= _MAX_PEERS:
                peers.pop(next(iter(peers))).close()
        peers[address] = peer  # most recently used last
        return peer

    def _pull(
        self, spec: KVTransferSpec, peers: dict[str, _Peer]
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Tokens `[start, start + num_tokens)` of the remote request, per local layer in
        the local dtype, and the bytes received."""
        address = tcp_address(spec.params["host"], spec.params["port"])
        peer = self._peer(peers, address)
        try:
            return self._pull_from(peer, spec)
        except Exception as exc:
            if isinstance(exc, KVLoadError) and not isinstance(exc, PullError):
                raise  # a bad reply, read whole: the socket is fine
            # Refused, dropped, timed out (a late reply may still come) or a ZeroMQ error:
            # a new socket next time.
            peers.pop(address, None)
            peer.close()
            raise

    def _pull_from(self, peer: _Peer, spec: KVTransferSpec) -> tuple[dict[str, torch.Tensor], int]:
        xfer_id = next(self._xfer_ids)
        request = PullRequest(
            xfer_id, spec.params["engine_id"], spec.params["request_id"], spec.start,
            spec.num_tokens, spec.params["prompt_hash"],
        )  # fmt: skip
        if peer.used:
            peer.drain_events()  # a fresh peer's first events tell whether it connects
        peer.used = True
        peer.sock.send(ENCODER.encode(request), copy=True)
        deadline = time.monotonic() + self.transfer_timeout_s
        header = self._receive_header(peer, xfer_id, deadline)
        try:
            if header.error:
                raise KVLoadError(f"{peer.address}: {header.error}")
            if spec.num_tokens == 0:
                return {}, 0
            check_reply(header, spec.num_tokens, self.kv_caches)
            return receive_layers(peer.sock, peer.address, header, self.kv_caches)
        finally:
            discard_rest(peer.sock)

    def _receive_header(self, peer: _Peer, xfer_id: int, deadline: float) -> PullReply:
        poller = zmq.Poller()
        poller.register(peer.sock, zmq.POLLIN)
        poller.register(peer.monitor, zmq.POLLIN)
        while True:
            if self._stop.is_set():
                raise PullError("the connector is shutting down")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise PullError(
                    f"no reply from {peer.address} within {self.transfer_timeout_s:g} s"
                )
            ready = dict(poller.poll(min(remaining_ms, _POLL_MS)))
            if peer.sock in ready:
                try:
                    header = REPLY_DECODER.decode(peer.sock.recv())
                except msgspec.DecodeError as exc:
                    discard_rest(peer.sock)
                    raise KVLoadError(f"{peer.address}: malformed reply: {exc}") from exc
                if header.xfer_id == xfer_id:
                    return header
                discard_rest(peer.sock)  # a late reply to a pull that timed out
            elif peer.monitor in ready:
                peer.check_events()
