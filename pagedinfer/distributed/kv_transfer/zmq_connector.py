"""`ZmqConnector`: prompt KV straight from a prefill instance to a decode instance over TCP
(ZeroMQ), pulled by the decode side as vLLM's NixlConnector does.

    client/proxy            prefill (kv_producer)                 decode (kv_consumer)
    ------------            ---------------------                 --------------------
    request, max_tokens=1,  computes the prompt; its blocks are
    {"do_remote_decode":    held for a remote reader (a lease of
     true}           ---->  `lease_timeout_s`, default 120 s)
                    <----   kv_transfer_params: remote host, port,
                            engine id, request id, prompt length
    same prompt, with those params  ---------------------------->  allocates the blocks,
                                                                   pulls tokens
                            the server thread answers the pull <-- [start, start + n)
                            and releases the hold                  into them, computes
                                                                   the last prompt token

Wire format (ZMQ DEALER on the decode side, ROUTER bound to `tcp://{kv_ip}:{kv_port}` on the
prefill side; msgspec msgpack structs, never pickle):

- pull: one frame, `PullRequest(xfer_id, engine_id, request_id, start, num_tokens)`.
  `num_tokens == 0` only releases the hold (the decode side had nothing to load).
- reply: `PullReply(xfer_id, error, layer_names, shape, dtype, checksums)`, then one raw
  frame per layer (in `layer_names` order): the `shape = [2, n, kv_heads, head_dim]` K and
  V of the tokens, gathered from the held blocks, in the producer's cache dtype; each with
  a blake2b checksum in `checksums`. A non-empty `error` (unknown or expired request, wrong
  engine id, bad range) comes without layer frames. Frames are sent and received without
  copies (`copy=False`, `recv_into` a preallocated tensor).

Threads and sockets:
- producer worker: one server thread owns the ROUTER (bound in `register_kv_caches`, so a
  port in use fails the start). A lock guards the holds shared with the main thread. A hold
  arrives in `KVConnectorMetadata.holds` in the step that completes the prompt and becomes
  pullable at that step's `wait_for_save`, after the forward pass wrote the KV. Served,
  expired and cancelled holds are reported in `finished_sending` by `get_finished`.
- consumer worker: `load_threads` (extra config, default 2) threads take load specs from a
  queue; each keeps one DEALER per producer address (a socket monitor detects a refused or
  dropped connection at once; a socket that failed is closed, not reused), checks each
  reply's xfer id (a late reply to a pull that timed out is discarded), the layer names,
  shapes, token count and checksums, and converts the dtype if the producer's differs. The
  main thread scatters the loaded KV into the paged cache in `get_finished` (never while a
  forward pass runs) and reports the request in `finished_recving`; a failed pull (refused,
  `transfer_timeout_s` passed, error reply, bad shape, checksum mismatch) reports the
  request's blocks of `[start, start + n)` in `invalid_block_ids` as well, and the
  scheduler applies `kv_load_failure_policy`.

The scheduler side of a producer also cancels holds: when a held request is preempted (its
blocks are freed; the hold is set again when its prompt is recomputed), and when it finishes
abnormally (aborted: the blocks are freed at once instead of at the lease's end). A cancel
travels as a hold spec with `num_tokens == 0` and `params["cancel"]`, and is applied before
the step's forward pass; a preemption's cancel also waits for a pull that is reading the
blocks, since the scheduler has freed them. A hold released (read
or expired) while its request still decodes on the producer is remembered, so that the
request's blocks are not held again when it finishes.

The consumer's scheduler side pulls once per request: a preempted request, or one whose
load failed, computes its prompt. When the local prefix cache already covers the remote
tokens, the worker still sends a pull of 0 tokens, which only releases the producer's hold.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedinfer.attention.backend import flat_kv_cache
from pagedinfer.core.kv_transfer_metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferSpec,
)
from pagedinfer.core.request import RequestStatus
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedinfer.distributed.kv_transfer.storage import (
    KVLoadError,
    kv_checksum,
    token_digest,
    token_slots,
)

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput
    from pagedinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["PullReply", "PullRequest", "ZmqConnector"]

_POLL_MS = 100  # how often the threads look at the stop flag
_MAX_PEERS = 64  # DEALER sockets one load thread keeps open (least recently used closed)
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PullRequest(msgspec.Struct, frozen=True):
    """Decode -> prefill: send tokens `[start, start + num_tokens)` of a held request."""

    xfer_id: int
    engine_id: str
    request_id: str
    start: int
    num_tokens: int


class PullReply(msgspec.Struct):
    """Prefill -> decode, followed by one raw frame per layer unless `error` is set."""

    xfer_id: int
    error: str = ""
    layer_names: list[str] = []
    shape: list[int] = []
    dtype: str = ""
    checksums: list[str] = []


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(PullRequest)
_reply_decoder = msgspec.msgpack.Decoder(PullReply)


def _transfer_params(sampling_params: SamplingParams | None) -> dict[str, Any]:
    extra = sampling_params.extra_args if sampling_params is not None else None
    params = extra.get("kv_transfer_params") if extra else None
    return params if isinstance(params, dict) else {}


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of prompt token ids (sent in `kv_transfer_params`)."""
    return token_digest(token_ids)[:32]


@dataclass
class _Remote:
    """Where a decode request's prompt KV is held (its `kv_transfer_params`)."""

    host: str
    port: int
    engine_id: str
    request_id: str
    num_tokens: int
    prompt_hash: str
    """Of the producer's prompt tokens: a decode request only pulls KV computed for its own
    prompt (not another's, through a mismatched or replayed `remote_request_id`)."""

    @classmethod
    def of(cls, request: Request) -> _Remote | None:
        """`request`'s remote prompt KV, if its params name one computed for its prompt."""
        remote = cls.parse(request.kv_transfer_params)
        if remote is None:
            return None
        prompt = request.prompt_token_ids
        if remote.num_tokens > len(prompt) or prompt_hash(prompt[: remote.num_tokens]) != (
            remote.prompt_hash
        ):
            logger.warning(
                "kv_transfer_params of request %s name KV of another prompt: computing the "
                "prompt locally", request.request_id,
            )  # fmt: skip
            return None
        return remote

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> _Remote | None:
        if not params or params.get("do_remote_prefill") is not True:
            return None
        try:
            remote = cls(
                host=params["remote_host"],
                port=params["remote_port"],
                engine_id=params.get("remote_engine_id") or "",
                request_id=params["remote_request_id"],
                num_tokens=params["remote_num_tokens"],
                prompt_hash=params["remote_prompt_hash"],
            )
        except KeyError as exc:
            logger.warning("kv_transfer_params without %s: computing the prompt locally", exc)
            return None
        if not (
            isinstance(remote.host, str)
            and type(remote.port) is int
            and isinstance(remote.engine_id, str)
            and isinstance(remote.request_id, str)
            and type(remote.num_tokens) is int
            and isinstance(remote.prompt_hash, str)
        ):
            logger.warning("malformed kv_transfer_params %s: computing the prompt locally", params)
            return None
        return remote

    def as_params(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "engine_id": self.engine_id,
            "request_id": self.request_id,
        }


@dataclass
class _Hold:
    """A producer's held prompt KV (worker side)."""

    block_ids: list[int]
    num_tokens: int
    deadline: float
    cancelled: bool = False


@dataclass
class _LoadResult:
    spec: KVTransferSpec
    layers: dict[str, torch.Tensor] | None  # [2, n, kv_heads, head_dim], the local dtype
    num_bytes: int
    elapsed_s: float
    error: str | None = None


@dataclass
class _Watch:
    """A do_remote_decode request whose prompt is not complete yet (scheduler side)."""

    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class _PullError(KVLoadError):
    """The connection failed: the peer's socket is not reused."""


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
                raise _PullError(f"cannot connect to {self.address} (refused or unreachable)")
            if event == zmq.EVENT_DISCONNECTED:
                raise _PullError(f"{self.address} closed the connection")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class ZmqConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kv = self.kv_config
        if kv.is_kv_producer and kv.kv_port == 0:
            raise ValueError(
                "ZmqConnector: a producer needs a fixed kv_port (not 0): the port goes into "
                "the kv_transfer_params that tell decode instances where to pull from"
            )
        self.engine_id: str = kv.engine_id or ""
        self.lease_timeout_s = float(kv.get_from_extra_config("lease_timeout_s", 120.0))
        self.transfer_timeout_s = float(kv.get_from_extra_config("transfer_timeout_s", 30.0))
        self.num_load_threads = max(1, int(kv.get_from_extra_config("load_threads", 2)))

        # Scheduler side, consumer: loads for this step, loads in flight.
        self._pending_loads: list[KVTransferSpec] = []
        self._loads_in_flight: set[str] = set()
        # Scheduler side, producer: requests whose prompt is still being computed, requests
        # with a hold on the worker (not finished yet), holds the worker released before
        # their request finished, and cancels for the next step.
        self._watched: dict[str, _Watch] = {}
        self._holding: set[str] = set()
        self._released_early: set[str] = set()
        self._pending_cancels: list[KVTransferSpec] = []

        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        # Signalled when a pull finishes serving (a preemption's cancel waits for it).
        self._served = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._threads: list[threading.Thread] = []
        # Producer: pullable holds, holds being served, released ones not yet reported.
        self._holds: dict[str, _Hold] = {}
        self._serving: dict[str, _Hold] = {}
        self._released: list[str] = []
        self._router: zmq.Socket | None = None
        # Consumer: specs for the load threads, their results.
        self._load_queue: queue.Queue[KVTransferSpec | None] = queue.Queue()
        self._loaded: list[_LoadResult] = []
        self._xfer_ids = itertools.count(1)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.kv_config.is_kv_consumer or request.num_preemptions:
            # A preempted request loaded its KV before (the hold is gone): recompute.
            return 0, False
        remote = _Remote.of(request)
        if remote is None or remote.num_tokens <= num_computed_tokens:
            return 0, False
        return remote.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if (
            not self.kv_config.is_kv_consumer
            or request.num_preemptions
            or request.kv_load_failed
            or request.num_computed_tokens > 0  # admitted again once its load arrived
        ):
            return
        remote = _Remote.of(request)
        if remote is None:
            return
        # The scheduler clamped our count to leave the last prompt token to compute: the
        # external tokens end at min(remote prompt, prompt - 1).
        end = min(remote.num_tokens, request.num_tokens - 1)
        spec = KVTransferSpec(
            req_id=request.request_id,
            block_ids=list(block_ids),
            start=max(end - num_external_tokens, 0),
            num_tokens=max(num_external_tokens, 0),
            params=remote.as_params(),
        )
        if num_external_tokens > 0:
            self._loads_in_flight.add(request.request_id)
        # Else (everything was a local prefix hit) the spec only releases the remote hold.
        self._pending_loads.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads, holds=self._pending_cancels)
        self._pending_loads, self._pending_cancels = [], []
        if not self.kv_config.is_kv_producer:
            return meta
        so = scheduler_output
        for req_id in so.finished_req_ids:
            if req_id in self._holding:
                # Finished without `request_finished` (failed while waiting): the scheduler
                # freed its blocks already.
                meta.holds.append(self._cancel_spec(req_id, report=False))
            self._watched.pop(req_id, None)
            self._holding.discard(req_id)
            self._released_early.discard(req_id)
        for req_id in so.preempted_req_ids:
            self._watched.pop(req_id, None)
            self._released_early.discard(req_id)
            if req_id in self._holding:
                # Its blocks are freed: drop the hold quietly; the recomputed prompt sets a
                # new one (a NewRequestData with the new blocks).
                self._holding.discard(req_id)
                meta.holds.append(self._cancel_spec(req_id, report=False))
        computed_before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if _transfer_params(new.sampling_params).get("do_remote_decode") is True:
                self._watched[new.req_id] = _Watch(len(new.prompt_token_ids), list(new.block_ids))
                computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            watch = self._watched.get(req_id)
            if watch is not None:
                watch.block_ids.extend(cached.new_block_ids[i])
                computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed_before.items():
            watch = self._watched[req_id]
            if before + so.num_scheduled_tokens.get(req_id, 0) < watch.num_prompt_tokens:
                continue  # the prompt's KV is complete only after a later chunk
            del self._watched[req_id]
            num_blocks = -(-watch.num_prompt_tokens // self.block_size)
            meta.holds.append(
                KVTransferSpec(req_id, watch.block_ids[:num_blocks], 0, watch.num_prompt_tokens)
            )
            self._holding.add(req_id)
            self._released_early.discard(req_id)
        return meta

    @staticmethod
    def _cancel_spec(req_id: str, report: bool) -> KVTransferSpec:
        return KVTransferSpec(req_id, [], 0, 0, params={"cancel": True, "report": report})

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            self._loads_in_flight.discard(req_id)
        for req_id in output.finished_sending:
            if req_id in self._holding:
                # Read or expired while its request still runs (it decodes here too): the
                # scheduler must not hold its blocks when it finishes.
                self._holding.discard(req_id)
                self._released_early.add(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._loads_in_flight:
            # Its blocks are being written: freed when the load is reported finished.
            return True, None
        self._watched.pop(req_id, None)
        if req_id in self._released_early:
            self._released_early.discard(req_id)
            return False, None
        if req_id not in self._holding:
            return False, None
        self._holding.discard(req_id)
        if request.status not in _NORMAL_FINISH:
            # Aborted (or failed): nobody will pull; the worker releases the blocks at once
            # (after a pull it may be serving).
            self._pending_cancels.append(self._cancel_spec(req_id, report=True))
            return True, None
        kv = self.kv_config
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": kv.kv_ip,
            "remote_port": kv.kv_port,
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": prompt_hash(request.prompt_token_ids),
        }

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self._ctx = zmq.Context()
        if self.kv_config.is_kv_producer:
            address = _tcp_address(self.kv_config.kv_ip, self.kv_config.kv_port)
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(address)
            except zmq.ZMQError as exc:
                router.close(linger=0)
                self._ctx.term()
                self._ctx = None
                raise ValueError(f"ZmqConnector cannot serve KV on {address}: {exc}") from exc
            self._router = router
            self._start_thread(self._serve, "kv-zmq-server")
            logger.info("ZmqConnector serving KV on %s (engine %s)", address, self.engine_id)
        if self.kv_config.is_kv_consumer:
            for i in range(self.num_load_threads):
                self._start_thread(self._load_loop, f"kv-zmq-load-{i}")

    def _start_thread(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start_load_kv(self) -> None:
        meta = self.get_connector_metadata()
        cancels = [spec for spec in meta.holds if spec.params.get("cancel")]
        if cancels:
            # Before the forward pass: a preempted request's blocks were freed in this
            # step's schedule and may be written by this very forward pass.
            with self._lock:
                for spec in cancels:
                    self._cancel_hold(spec.req_id, bool(spec.params.get("report")))
        for spec in meta.loads:
            self._load_queue.put(spec)

    def wait_for_save(self) -> None:
        holds = [s for s in self.get_connector_metadata().holds if not s.params.get("cancel")]
        if not holds:
            return
        # The forward pass wrote the prompts' KV: the holds become pullable now.
        deadline = time.monotonic() + self.lease_timeout_s
        with self._lock:
            for spec in holds:
                self._holds[spec.req_id] = _Hold(list(spec.block_ids), spec.num_tokens, deadline)

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

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        now = time.monotonic()
        with self._lock:
            for req_id, hold in list(self._holds.items()):
                if now >= hold.deadline:
                    del self._holds[req_id]
                    out.finished_sending.append(req_id)
                    logger.info("KV hold of request %s expired unread", req_id)
            out.finished_sending.extend(self._released)
            self._released = []
            loaded, self._loaded = self._loaded, []
        for result in loaded:
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
            part = layers[name].to(kv_cache.device)
            key_cache, value_cache = flat_kv_cache(kv_cache)
            slots_here = slots.to(kv_cache.device)
            key_cache.index_copy_(0, slots_here, part[0])
            value_cache.index_copy_(0, slots_here, part[1])

    def shutdown(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._load_queue.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
            if thread.is_alive():
                logger.warning("ZmqConnector thread %s did not stop", thread.name)
        self._threads = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # the threads closed their sockets
            self._ctx = None
        with self._lock:
            self._holds.clear()
            self._loaded = []

    # -------------------------------------------------------- the server thread

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
                    request = _request_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    reply = [_encoder.encode(PullReply(-1, f"malformed pull: {exc}"))]
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
            return [_encoder.encode(PullReply(request.xfer_id, message))]

        if request.engine_id and request.engine_id != self.engine_id:
            return error(f"engine {self.engine_id} is not {request.engine_id}")
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None or time.monotonic() >= hold.deadline:
                return error(f"no KV held for request {req_id!r} (unknown or expired)")
            start, num_tokens = request.start, request.num_tokens
            if start < 0 or num_tokens < 0 or start + num_tokens > hold.num_tokens:
                return error(
                    f"tokens [{start}, {start + num_tokens}) are not in the "
                    f"{hold.num_tokens} held for request {req_id!r}"
                )
            del self._holds[req_id]
            self._serving[req_id] = hold
        try:
            names, buffers, checksums = [], [], []
            dtype = next(iter(self.kv_caches.values())).dtype if self.kv_caches else None
            if num_tokens > 0:
                slots = token_slots(hold.block_ids, start, num_tokens, self.block_size)
                for name, kv_cache in self.kv_caches.items():
                    key_cache, value_cache = flat_kv_cache(kv_cache)
                    slots_here = slots.to(kv_cache.device)
                    kv = torch.empty(
                        (2, num_tokens, *kv_cache.shape[-2:]), dtype=kv_cache.dtype,
                        device=kv_cache.device,
                    )  # fmt: skip
                    torch.index_select(key_cache, 0, slots_here, out=kv[0])
                    torch.index_select(value_cache, 0, slots_here, out=kv[1])
                    kv = kv.cpu()
                    names.append(name)
                    checksums.append(kv_checksum(kv))
                    buffers.append(kv.view(torch.uint8).numpy())
                shape = list(kv.shape)
            else:
                shape = []
            header = PullReply(
                request.xfer_id,
                layer_names=names,
                shape=shape,
                dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
                checksums=checksums,
            )
            return [_encoder.encode(header), *buffers]
        except Exception as exc:
            logger.exception("serving the KV of request %s failed", req_id)
            return error(f"the producer failed to read the KV: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._serving.pop(req_id, None)
                self._served.notify_all()
                if not hold.cancelled:
                    self._released.append(req_id)

    # ----------------------------------------------------------- the load threads

    def _load_loop(self) -> None:
        assert self._ctx is not None
        peers: dict[str, _Peer] = {}  # this thread's sockets, most recently used last
        try:
            while not self._stop.is_set():
                spec = self._load_queue.get()
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
                result = _LoadResult(spec, layers, num_bytes, time.perf_counter() - start, error)
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
        address = _tcp_address(spec.params["host"], spec.params["port"])
        peer = self._peer(peers, address)
        try:
            return self._pull_from(peer, spec)
        except Exception as exc:
            if isinstance(exc, KVLoadError) and not isinstance(exc, _PullError):
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
            spec.num_tokens,
        )  # fmt: skip
        if peer.used:
            peer.drain_events()  # a fresh peer's first events tell whether it connects
        peer.used = True
        peer.sock.send(_encoder.encode(request), copy=True)
        deadline = time.monotonic() + self.transfer_timeout_s
        header = self._receive_header(peer, xfer_id, deadline)
        try:
            if header.error:
                raise KVLoadError(f"{peer.address}: {header.error}")
            if spec.num_tokens == 0:
                return {}, 0
            self._check_header(header, spec)
            dtype = _DTYPES[header.dtype]
            shape = tuple(header.shape)
            num_bytes = 0
            layers: dict[str, torch.Tensor] = {}
            for name, checksum in zip(header.layer_names, header.checksums, strict=True):
                if not peer.sock.getsockopt(zmq.RCVMORE):
                    raise _PullError(f"{peer.address}: the reply stops before layer {name}")
                raw = torch.empty(shape, dtype=dtype)
                buffer = raw.view(torch.uint8).numpy().reshape(-1)
                size = peer.sock.recv_into(buffer)
                if size != buffer.nbytes:
                    raise KVLoadError(f"{name}: {size} bytes received, {buffer.nbytes} expected")
                if kv_checksum(raw) != checksum:
                    raise KVLoadError(f"{name}: checksum mismatch")
                num_bytes += size
                local_dtype = self.kv_caches[name].dtype
                layers[name] = raw if raw.dtype == local_dtype else raw.to(local_dtype)
            return layers, num_bytes
        finally:
            _discard_rest(peer.sock)

    def _receive_header(self, peer: _Peer, xfer_id: int, deadline: float) -> PullReply:
        poller = zmq.Poller()
        poller.register(peer.sock, zmq.POLLIN)
        poller.register(peer.monitor, zmq.POLLIN)
        while True:
            if self._stop.is_set():
                raise _PullError("the connector is shutting down")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise _PullError(
                    f"no reply from {peer.address} within {self.transfer_timeout_s:g} s"
                )
            ready = dict(poller.poll(min(remaining_ms, _POLL_MS)))
            if peer.sock in ready:
                try:
                    header = _reply_decoder.decode(peer.sock.recv())
                except msgspec.DecodeError as exc:
                    _discard_rest(peer.sock)
                    raise KVLoadError(f"{peer.address}: malformed reply: {exc}") from exc
                if header.xfer_id == xfer_id:
                    return header
                _discard_rest(peer.sock)  # a late reply to a pull that timed out
            elif peer.monitor in ready:
                peer.check_events()

    def _check_header(self, header: PullReply, spec: KVTransferSpec) -> None:
        if header.dtype not in _DTYPES:
            raise KVLoadError(f"unsupported KV dtype {header.dtype!r}")
        if sorted(header.layer_names) != sorted(self.kv_caches):
            raise KVLoadError(
                f"the producer sent layers {header.layer_names}, this model has "
                f"{list(self.kv_caches)}"
            )
        if len(header.checksums) != len(header.layer_names):
            raise KVLoadError("one checksum per layer expected")
        kv_cache = next(iter(self.kv_caches.values()))
        expected = [2, spec.num_tokens, *kv_cache.shape[-2:]]
        if list(header.shape) != expected:
            raise KVLoadError(f"the producer sent KV of shape {header.shape}, not {expected}")


def _discard_rest(sock: zmq.Socket) -> None:
    """Skip the remaining frames of the current message."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv_into(bytearray())


def _tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
