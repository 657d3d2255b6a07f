"""Clients through which an asyncio front end (`AsyncLLM`) drives the engine core.

Both have the same interface:
- `add_request(EngineCoreRequest)`, `abort_requests(ids)`: fire and forget (they never block
  the event loop, so an abort can be sent from a generator's cleanup);
- `await get_output()`: the next `EngineCoreOutputs`; raises `EngineDeadError` once the
  engine is gone;
- `await call_utility(method, *args)`: one of `core_proc.UTILITY_METHODS`;
- `info` (`EngineCoreReady`), `is_dead`, `shutdown()`.

`AsyncMPClient` (the default, vLLM's design): the engine core runs in its own process
(`python -m pagedinfer.engine.core_proc`), a fresh interpreter (no fork of a process with
torch threads, nothing pickled),
over two ZMQ IPC sockets bound here. A monitor thread waits on the process's sentinel: when
the process dies, `get_output` raises `EngineDeadError` at once (with the engine's last
FATAL message, if it sent one), so every waiting request fails fast instead of hanging.

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

from pagedinfer.config import EngineConfig
from pagedinfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedinfer.engine.core_proc import (
    UTILITY_METHODS,
    EngineCoreReady,
    InputKind,
    OutputKind,
    UtilityCall,
    UtilityResult,
    config_to_json,
)

logger = logging.getLogger("pagedinfer")

__all__ = ["AsyncMPClient", "EngineCoreClient", "EngineDeadError", "InprocClient"]


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


class AsyncMPClient(EngineCoreClient):
    """The engine core in a child process; see the module docstring."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 900.0) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="pagedinfer-")
        input_address = f"ipc://{os.path.join(self._dir, 'input')}"
        output_address = f"ipc://{os.path.join(self._dir, 'output')}"
        self._sync_context = zmq.Context()
        # Sends go through a plain (sync) socket guarded by a lock: callable from any
        # thread or from a generator's cleanup, never awaiting.
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._send_lock = threading.Lock()
        self._output_sync = self._sync_context.socket(zmq.PULL)
        self._output_sync.bind(output_address)
        self._dead_reason: str | None = None
        self._closed = False
        self._output: Any = None
        self._outputs: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
        assert self.process.stdin is not None
        self.process.stdin.write(config_to_json(config).encode())
        self.process.stdin.close()
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
            target=self._watch_process, name="engine-monitor", daemon=True
        )
        self._monitor.start()

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
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"Engine core process exited during startup (code {self.process.returncode})."
                )
        raise RuntimeError(f"Engine core not ready after {timeout_s:.0f} s.")

    # ------------------------------------------------------------------ process liveness

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def _watch_process(self) -> None:
        code = self.process.wait()
        if self._closed:
            return
        reason = f"Engine core process died (exit code {code})."
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
        if self.is_dead:
            raise EngineDeadError(self._dead_reason)
        with self._send_lock:
            self._input.send_multipart([kind.value, payload])

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

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.process.poll() is None:
                with self._send_lock:
                    self._input.send_multipart([InputKind.SHUTDOWN.value, b""])
                self.process.wait(timeout=10)
        except Exception:  # best effort: the process is killed below if still there
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        if self._reader is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._reader.cancel)
        for sock in (self._input, self._output_sync):
            if not sock.closed:
                sock.close(linger=0)
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
            if self.core.has_unfinished_requests():
                try:
                    outputs = await asyncio.to_thread(self.core.step)
                except Exception as exc:
                    self._dead_reason = f"Engine core step failed: {type(exc).__name__}: {exc}"
                    logger.exception("Engine core step failed.")
                    raise EngineDeadError(self._dead_reason) from exc
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
