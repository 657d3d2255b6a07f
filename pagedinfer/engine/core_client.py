"""Clients through which an asyncio front end (`AsyncLLM`) drives the engine core.

All have the same interface:
- `add_request(EngineCoreRequest)`, `abort_requests(ids)`: fire and forget (they never block
  the event loop, so an abort can be sent from a generator's cleanup);
- `await get_output()`: the next `EngineCoreOutputs`; raises `EngineDeadError` once the
  engine is gone;
- `await call_utility(method, *args)`: one of `protocol.UTILITY_METHODS`;
- `info` (`EngineCoreReady`), `is_dead`, `shutdown()`.

`AsyncMPClient` (the default, vLLM's design): the engine core runs in its own process
(`python -m pagedinfer.engine.core_proc`), a fresh interpreter (no fork of a process with
torch threads, nothing pickled),
over two ZMQ IPC sockets bound here. A monitor thread waits on the process's sentinel: when
the process dies, `get_output` raises `EngineDeadError` at once (with the engine's last
FATAL message, if it sent one), so every waiting request fails fast instead of hanging.

`AsyncMPClient` is a `SocketClient`, which holds the sockets, the output reader and the
dead/alive state; the subclass starts the engine's process, watches it and stops it. The
other subclass is `ray_client.RayMPClient` (data-parallel replicas with
`data_parallel_backend="ray"`): the same engine core in a Ray actor, over TCP sockets.

`InprocClient`: the same engine core in this process, each step run in a worker thread (for
tests and debugging: one process, a debugger sees everything). Inputs are applied between
steps, never while one runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

import msgspec

from pagedinfer.config import EngineConfig, config_to_json
from pagedinfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedinfer.engine.protocol import (
    UTILITY_METHODS,
    EngineCoreReady,
    InputKind,
    OutputKind,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("pagedinfer")

__all__ = [
    "AsyncMPClient",
    "EngineCoreClient",
    "EngineDeadError",
    "InprocClient",
    "SocketClient",
]


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died or a step failed); nothing more will come."""


class EngineCoreClient:
    info: EngineCoreReady

    @property
    def is_dead(self) -> bool:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class SocketClient(EngineCoreClient):
    """An engine core in another process, driven over two ZMQ sockets bound here (the wire
    protocol in `protocol.py`). A subclass says where the sockets are bound (`_bind`) and
    starts, watches and stops the engine's process (`_start_engine`, `_startup_failure`,
    `_wait_engine_gone`, `_stop_engine`)."""

    engine_location: str
    """Where the engine core runs, for logs: "pid 1234"."""
    _send_timeout_ms = -1
    """SNDTIMEO of the input socket; -1: a send blocks until the engine takes the message."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float) -> None:
        import zmq

        self._sync_context = zmq.Context()
        # Sends go through a plain (sync) socket guarded by a lock: callable from any
        # thread or from a generator's cleanup, never awaiting.
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
        input_address = self._bind(self._input, "input")
        self._send_lock = threading.Lock()
        self._output_sync = self._sync_context.socket(zmq.PULL)
        output_address = self._bind(self._output_sync, "output")
        self._dead_reason: str | None = None
        self._closed = False
        self._output: Any = None
        self._outputs: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: threading.Thread | None = None

        self._start_engine(config_to_json(config), input_address, output_address)
        try:
            self.info = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        # From here on the output socket is read by the asyncio side only, through an
        # asyncio shadow of the same socket (made in _ensure_reader, inside the loop).
        self._utility_ids = itertools.count()
        self._utility_waiters: dict[int, asyncio.Future] = {}
        self._monitor = threading.Thread(
            target=self._watch_engine, name="engine-monitor", daemon=True
        )
        self._monitor.start()

    # --------------------------------------------------------------- subclass hooks

    def _bind(self, socket: Any, name: str) -> str:
        """Bind `socket` (the engine's `name` socket: "input" or "output"); its address."""
        raise NotImplementedError

    def _start_engine(self, config_json: str, input_address: str, output_address: str) -> None:
        """Start `core_proc.run_engine_core` in another process (it connects to both)."""
        raise NotImplementedError

    def _startup_failure(self) -> str | None:
        """Why the engine is gone already, if it is (asked while waiting for READY)."""
        raise NotImplementedError

    def _wait_engine_gone(self) -> str:
        """Block until the engine's process is gone (or this client closed); why."""
        raise NotImplementedError

    def _stop_engine(self) -> None:
        """Make the engine's process exit (a SHUTDOWN message first), killing it if need be."""
        raise NotImplementedError

    # ------------------------------------------------------------------------ start-up

    def _wait_ready(self, timeout_s: float) -> EngineCoreReady:
        import zmq

        poller = zmq.Poller()
        poller.register(self._output_sync, zmq.POLLIN)
        waited = 0.0
        while waited < timeout_s:
            if poller.poll(500):
                kind, payload = self._output_sync.recv_multipart()
                if kind == OutputKind.READY.value:
                    return msgspec.msgpack.decode(payload, type=EngineCoreReady)
                if kind == OutputKind.FATAL.value:
                    raise RuntimeError(f"Engine core failed to start: {payload.decode()}")
                raise RuntimeError(f"Unexpected first message from the engine: {kind!r}")
            waited += 0.5
            if (failure := self._startup_failure()) is not None:
                raise RuntimeError(failure)
        raise RuntimeError(f"Engine core not ready after {timeout_s:.0f} s.")

    # ------------------------------------------------------------------ engine liveness

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def _watch_engine(self) -> None:
        """The monitor thread: the engine's end, unless we ended it, kills this client."""
        reason = self._wait_engine_gone()
        if not self._closed:
            self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error("%s", reason)
        loop, outputs = self._loop, self._outputs
        if loop is not None and outputs is not None and not loop.is_closed():
            loop.call_soon_threadsafe(outputs.put_nowait, EngineDeadError(self._dead_reason))

    # ------------------------------------------------------------------------- inputs

    def _send(self, kind: InputKind, payload: bytes) -> None:
        import zmq

        if self.is_dead:
            raise EngineDeadError(self._dead_reason)
        with self._send_lock:
            while True:
                try:
                    self._input.send_multipart([kind.value, payload])
                    return
                except zmq.Again:  # only with a send timeout (see ray_client.RayMPClient)
                    if self.is_dead or self._closed:
                        raise EngineDeadError(
                            self._dead_reason or "The engine core client is shut down."
                        ) from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(InputKind.ADD, msgspec.msgpack.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._send(InputKind.ABORT, msgspec.msgpack.encode(list(request_ids)))

    async def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        self._ensure_reader()
        call_id = next(self._utility_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_waiters[call_id] = future
        self._send(
            InputKind.UTILITY, msgspec.msgpack.encode(UtilityCall(call_id, method, list(args)))
        )
        return await future

    # ------------------------------------------------------------------------ outputs

    def _ensure_reader(self) -> None:
        if self._reader is not None:
            return
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._output = zmq.asyncio.Socket.shadow(self._output_sync.underlying)
        self._reader = self._loop.create_task(self._read_outputs(), name="engine-outputs")
        if self.is_dead:
            self._outputs.put_nowait(EngineDeadError(self._dead_reason))

    async def _read_outputs(self) -> None:
        assert self._outputs is not None and self._output is not None
        decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        decode_result = msgspec.msgpack.Decoder(UtilityResult)
        while True:
            kind, payload = await self._output.recv_multipart()
            if kind == OutputKind.OUTPUTS.value:
                self._outputs.put_nowait(decode_outputs.decode(payload))
            elif kind == OutputKind.UTILITY.value:
                result = decode_result.decode(payload)
                future = self._utility_waiters.pop(result.call_id, None)
                if future is not None and not future.done():
                    if result.error is not None:
                        future.set_exception(RuntimeError(result.error))
                    else:
                        future.set_result(result.result)
            elif kind == OutputKind.FATAL.value:
                self._mark_dead(f"Engine core failed: {payload.decode()}")

    async def get_output(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)  # every later call fails the same way
            for future in self._utility_waiters.values():
                if not future.done():
                    future.set_exception(item)
            self._utility_waiters.clear()
            raise item
        return item

    def _send_shutdown(self) -> None:
        with self._send_lock:
            self._input.send_multipart([InputKind.SHUTDOWN.value, b""])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_engine()
        if self._reader is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._reader.cancel)
        for sock in (self._input, self._output_sync):
            if not sock.closed:
                sock.close(linger=0)


class AsyncMPClient(SocketClient):
    """The engine core in a child process, over ipc sockets; see the module docstring."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 900.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedinfer-")
        super().__init__(config, startup_timeout_s)

    def _bind(self, socket: Any, name: str) -> str:
        address = f"ipc://{os.path.join(self._dir, name)}"
        socket.bind(address)
        return address

    def _start_engine(self, config_json: str, input_address: str, output_address: str) -> None:
        # A fresh interpreter running `python -m pagedinfer.engine.core_proc` (not a
        # multiprocessing spawn: nothing is pickled, and the caller's __main__ is not
        # re-imported); the config goes in as JSON on stdin.
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedinfer.engine.core_proc",
                input_address,
                output_address,
                str(os.getpid()),
            ],
            stdin=subprocess.PIPE,
        )
        self.engine_location = f"pid {self.process.pid}"
        assert self.process.stdin is not None
        self.process.stdin.write(config_json.encode())
        self.process.stdin.close()

    def _startup_failure(self) -> str | None:
        if self.process.poll() is None:
            return None
        return f"Engine core process exited during startup (code {self.process.returncode})."

    def _wait_engine_gone(self) -> str:
        code = self.process.wait()
        return f"Engine core process died (exit code {code})."

    def _stop_engine(self) -> None:
        try:
            if self.process.poll() is None:
                self._send_shutdown()
                self.process.wait(timeout=10)
        except Exception:  # best effort: the process is killed below if still there
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def shutdown(self) -> None:
        super().shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


class InprocClient(EngineCoreClient):
    """The engine core in this process; steps run in a worker thread."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedinfer.engine.core import EngineCore

        self.core = EngineCore(config)
        info = self.core.model_info
        self.info = EngineCoreReady(
            max_model_len=self.core.max_model_len,
            vocab_size=info.vocab_size,
            num_kv_blocks=info.num_kv_blocks,
            block_size=config.cache_config.block_size,
            dtype=info.dtype,
            load_time_s=info.load_time_s,
        )
        self._inputs: queue.SimpleQueue[tuple[InputKind, Any]] = queue.SimpleQueue()
        self._wakeup: asyncio.Event | None = None
        self._dead_reason: str | None = None

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def _put(self, kind: InputKind, payload: Any) -> None:
        if self.is_dead:
            raise EngineDeadError(self._dead_reason)
        self._inputs.put((kind, payload))
        if self._wakeup is not None:
            self._wakeup.set()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._put(InputKind.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._put(InputKind.ABORT, list(request_ids))

    def _apply_inputs(self) -> None:
        while True:
            try:
                kind, payload = self._inputs.get_nowait()
            except queue.Empty:
                return
            if kind is InputKind.ADD:
                self.core.add_request(payload)
            elif kind is InputKind.ABORT:
                self.core.abort_requests(payload)

    async def get_output(self) -> EngineCoreOutputs:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        while True:
            if self.is_dead:
                raise EngineDeadError(self._dead_reason)
            self._apply_inputs()
            if self.core.has_unfinished_requests() or self.core.has_pending_kv_transfers():
                try:
                    outputs, progressed = await asyncio.to_thread(self.core.step)
                except Exception as exc:
                    self._dead_reason = f"Engine core step failed: {type(exc).__name__}: {exc}"
                    logger.exception("Engine core step failed.")
                    raise EngineDeadError(self._dead_reason) from exc
                if not progressed:  # a grammar compile or a KV transfer pending
                    await asyncio.sleep(self.core.poll_interval_s())
                if outputs.outputs or outputs.scheduler_stats is not None:
                    return outputs
                continue
            if (idle := self.core.idle_outputs()) is not None:
                return idle
            self._wakeup.clear()
            if self._inputs.empty():
                await self._wakeup.wait()

    async def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()
