"""`KVServer`: the producer worker's held prompt KV and the thread that serves it to
decode instances' pulls. Created by `ZmqConnectorWorker` (`worker.py`), which calls the
hold methods from the worker's main thread.

Invariants:
- One server thread owns the ROUTER (bound in `start`, so a port in use fails the
  worker's start) and answers one pull at a time (`wire.py` gives the format).
- A lock guards the holds, shared by the main thread and the server thread. A hold is
  pullable (`add_holds`) only after the forward pass wrote its KV, and is read once: the
  pull moves it from `_holds` to `_serving` under the lock, and the KV is gathered outside
  it; when the reply is built, the request is reported released (unless cancelled).
- A pull is served only if it names the hash of the held prompt; a refused pull leaves the
  hold for its own reader.
- A hold whose lease (`deadline`) passed is refused to a pull and reported, with the
  served ones, by `take_finished` (the scheduler frees the blocks on that report).
- `cancel`: an unread hold is dropped (reported or not, as the spec says). A hold being
  served is reported when served (an aborted request) or never (a preempted one); for a
  preempted request `cancel` also waits until the pull finished reading the blocks, which
  the scheduler has freed and this step's forward pass may write.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from pagedinfer.attention.backend import flat_kv_cache
from pagedinfer.distributed.kv_transfer.storage import token_slots
from pagedinfer.distributed.kv_transfer.zmq.wire import (
    REQUEST_DECODER,
    PullRequest,
    error_reply,
    kv_reply,
)

if TYPE_CHECKING:
    from pagedinfer.core.kv_transfer_metadata import KVTransferSpec

logger = logging.getLogger(__name__)

__all__ = ["KVServer"]

_POLL_MS = 100  # how often the thread looks at the stop flag


@dataclass
class _Hold:
    """A producer's held prompt KV."""

    block_ids: list[int]
    num_tokens: int
    prompt_hash: str
    """Of the held prompt: served only to a pull naming it (`trust.py`)."""
    deadline: float
    cancelled: bool = False


class KVServer:
    """The held prompts of a producer worker and the thread that serves their pulls."""

    def __init__(self, engine_id: str, block_size: int, stop: threading.Event) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self._stop = stop
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        # Signalled when a pull finishes serving (a preemption's cancel waits for it).
        self._served = threading.Condition(self._lock)
        # Pullable holds, holds being served, released ones not yet reported.
        self._holds: dict[str, _Hold] = {}
        self._serving: dict[str, _Hold] = {}
        self._released: list[str] = []
        self._router: zmq.Socket | None = None

    def start(
        self, ctx: zmq.Context, address: str, kv_caches: dict[str, torch.Tensor]
    ) -> threading.Thread:
        """Bind the ROUTER to `address` and start the server thread; ValueError if the
        address cannot be bound."""
        self.kv_caches = kv_caches
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(address)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            raise ValueError(f"ZmqConnector cannot serve KV on {address}: {exc}") from exc
        self._router = router
        thread = threading.Thread(target=self._serve, name="kv-zmq-server", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------ main thread

    def add_holds(self, specs: list[KVTransferSpec], deadline: float) -> None:
        """Make these prompts' KV pullable until `deadline` (monotonic)."""
        with self._lock:
            for spec in specs:
                self._holds[spec.req_id] = _Hold(
                    list(spec.block_ids),
                    spec.num_tokens,
                    str(spec.params.get("prompt_hash", "")),
                    deadline,
                )

    def cancel(self, specs: list[KVTransferSpec]) -> None:
        """Apply cancel specs (`params["report"]`: report the request as released)."""
        with self._lock:
            for spec in specs:
                self._cancel_hold(spec.req_id, bool(spec.params.get("report")))

    def _cancel_hold(self, req_id: str, report: bool) -> None:
        """Under the lock."""
        hold = self._holds.pop(req_id, None)
        serving = self._serving.get(req_id)
        if serving is not None:
            # Reported when served (an aborted request: its blocks stay held until then)
            # or never (a preempted one).
            serving.cancelled = not report
            if not report:
                # The preempted request's blocks are free again: the pull must finish
                # reading them before anything (this step's forward pass) writes them.
                while req_id in self._serving:
                    self._served.wait()
        elif hold is not None and report:
            self._released.append(req_id)

    def take_finished(self) -> list[str]:
        """Requests whose hold expired or was released since the last call, expired first."""
        finished = []
        now = time.monotonic()
        with self._lock:
            for req_id, hold in list(self._holds.items()):
                if now >= hold.deadline:
                    del self._holds[req_id]
                    finished.append(req_id)
                    logger.info("KV hold of request %s expired unread", req_id)
            finished.extend(self._released)
            self._released = []
        return finished

    def clear(self) -> None:
        """Forget the holds (at shutdown, after the thread stopped)."""
        with self._lock:
            self._holds.clear()

    # ---------------------------------------------------------- server thread

    def _serve(self) -> None:
        router = self._router
        assert router is not None
        try:
            while not self._stop.is_set():
                if not router.poll(_POLL_MS):
                    continue
                frames = router.recv_multipart(copy=True)
                if len(frames) != 2:
                    continue  # not a pull (a DEALER sends one frame)
                identity, payload = frames
                try:
                    request = REQUEST_DECODER.decode(payload)
                except msgspec.DecodeError as exc:
                    reply = error_reply(-1, f"malformed pull: {exc}")
                else:
                    reply = self._answer(request)
                router.send_multipart([identity, *reply], copy=False)
        except Exception:
            if not self._stop.is_set():
                logger.exception("ZmqConnector server thread failed")
        finally:
            router.close(linger=0)

    def _answer(self, request: PullRequest) -> list[Any]:
        """The reply frames to one pull; releases the hold it reads."""
        req_id = request.request_id

        def error(message: str) -> list[Any]:
            return error_reply(request.xfer_id, message)

        if request.engine_id and request.engine_id != self.engine_id:
            return error(f"engine {self.engine_id} is not {request.engine_id}")
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None or time.monotonic() >= hold.deadline:
                return error(f"no KV held for request {req_id!r} (unknown or expired)")
            if request.prompt_hash != hold.prompt_hash:
                # Another prompt's pull (a forged or mixed-up request id): the hold stays
                # for its own reader.
                return error(f"request {req_id!r} holds the KV of another prompt")
            start, num_tokens = request.start, request.num_tokens
            if start < 0 or num_tokens < 0 or start + num_tokens > hold.num_tokens:
                return error(
                    f"tokens [{start}, {start + num_tokens}) are not in the "
                    f"{hold.num_tokens} held for request {req_id!r}"
                )
            del self._holds[req_id]
            self._serving[req_id] = hold
        try:
            dtype = next(iter(self.kv_caches.values())).dtype if self.kv_caches else None
            layers = self._gather(hold, start, num_tokens) if num_tokens > 0 else {}
            return kv_reply(request.xfer_id, dtype, layers)
        except Exception as exc:
            logger.exception("serving the KV of request %s failed", req_id)
            return error(f"the producer failed to read the KV: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._serving.pop(req_id, None)
                self._served.notify_all()
                if not hold.cancelled:
                    self._released.append(req_id)

    def _gather(self, hold: _Hold, start: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """Tokens `[start, start + num_tokens)` of a held request, per layer, on the CPU."""
        layers: dict[str, torch.Tensor] = {}
        slots = token_slots(hold.block_ids, start, num_tokens, self.block_size)
        for name, kv_cache in self.kv_caches.items():
            key_cache, value_cache = flat_kv_cache(kv_cache)
            slots_here = slots.to(kv_cache.device)
            kv = torch.empty(
                (2, num_tokens, *kv_cache.shape[-2:]), dtype=kv_cache.dtype, device=kv_cache.device
            )  # [2, num_tokens, kv_heads, head_dim]
            torch.index_select(key_cache, 0, slots_here, out=kv[0])
            torch.index_select(value_cache, 0, slots_here, out=kv[1])
            layers[name] = kv.cpu()
        return layers
