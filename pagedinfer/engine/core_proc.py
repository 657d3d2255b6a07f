"""The engine core in its own process, driven over ZMQ (vLLM's `EngineCoreProc`).

The wire protocol (message kinds and payload types) is `engine/protocol.py`.

The process runs three threads, as vLLM's does: an input thread decodes messages into
`input_queue`, the main thread busy-loops (apply inputs, `step()`, queue the outputs;
block on the input queue when there is nothing to run, wait `poll_interval_s()` after a
step that made no progress), an output thread encodes and sends. Torch releases the GIL
inside its kernels, so socket work overlaps the forward pass.
The engine exits when told to, when a step raises (after sending FATAL), or, so that it
never outlives the server, when the front end is gone (then it removes the front end's
socket directory, which nobody else is left to remove). How that is seen depends on who
started the process:
- `AsyncMPClient` (a child process, ipc sockets): the input thread checks every second
  that its parent process is still the one that started it;
- `RayMPClient` (a Ray actor, possibly on another machine, tcp sockets): a parent pid
  means nothing there (the actor's parent is Ray's raylet), so there is no such check.
  Ray kills an actor when its owner, the front end's process, dies or disconnects (its
  job ends), however it ends, and with it this engine core.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
import traceback
from typing import Any

import msgspec

from pagedinfer.config import EngineConfig, config_from_json
from pagedinfer.engine.core import EngineCore
from pagedinfer.engine.protocol import (
    UTILITY_METHODS,
    EngineCoreReady,
    InputKind,
    OutputKind,
    UtilityCall,
    UtilityResult,
    decode_input,
    reject_malformed_add,
)
from pagedinfer.logging_utils import setup_logging

logger = logging.getLogger("pagedinfer")

__all__ = ["EngineCoreProc", "run_engine_core"]


class EngineCoreProc(EngineCore):
    """An `EngineCore` fed from a queue of decoded input messages (see the module docstring)."""

    def __init__(self, config: EngineConfig, output_queue: queue.Queue) -> None:
        super().__init__(config)
        self.input_queue: queue.Queue[tuple[InputKind, Any]] = queue.Queue()
        self.output_queue = output_queue
        self._shutdown = False

    def _handle_input(self, kind: InputKind, payload: Any) -> None:
        if kind is InputKind.ADD:
            self.add_request(payload)
        elif kind is InputKind.ABORT:
            self.abort_requests(payload)
        elif kind is InputKind.UTILITY:
            call: UtilityCall = payload
            try:
                if call.method not in UTILITY_METHODS:
                    raise ValueError(f"unknown utility method {call.method!r}")
                result = UtilityResult(call.call_id, getattr(self, call.method)(*call.args))
            except Exception as exc:  # the caller gets the error; the engine keeps going
                result = UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
            self.output_queue.put((OutputKind.UTILITY, result))
        elif kind is InputKind.SHUTDOWN:
            self._shutdown = True

    def run_busy_loop(self) -> None:
        while not self._shutdown:
            if not self.has_unfinished_requests() and not self.has_pending_kv_transfers():
                if (idle := self.idle_outputs()) is not None:
                    self.output_queue.put((OutputKind.OUTPUTS, idle))
                self._handle_input(*self.input_queue.get())  # idle: block for work
            while not self.input_queue.empty():
                self._handle_input(*self.input_queue.get_nowait())
            if self._shutdown:
                break
            outputs, progressed = self.step()
            if outputs.outputs or outputs.scheduler_stats is not None:
                self.output_queue.put((OutputKind.OUTPUTS, outputs))
            if not progressed:
                time.sleep(self.poll_interval_s())  # a grammar compile or a transfer pending


def _input_thread(
    engine: EngineCoreProc, socket: Any, parent_pid: int | None, stop: threading.Event
) -> None:
    """Owns the input socket (closes it on the way out: `Context.term()` waits for every
    socket to be closed). `parent_pid`: exit once this process's parent is no longer that
    process; None: no such check (see the module docstring)."""
    import zmq

    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    try:
        while not stop.is_set():
            if not poller.poll(1000):
                if parent_pid is not None and os.getppid() != parent_pid:
                    # The front end is gone: so are we.
                    stop.set()
                    engine.input_queue.put((InputKind.SHUTDOWN, None))
                    return
                continue
            frames = socket.recv_multipart()
            try:
                kind, payload = decode_input(frames)
            except ValueError as exc:
                if (rejected := reject_malformed_add(frames, exc)) is not None:
                    engine.output_queue.put((OutputKind.OUTPUTS, rejected))
                else:
                    logger.error("Dropped a malformed message from the front end: %s", exc)
                continue
            engine.input_queue.put((kind, payload))
            if kind is InputKind.SHUTDOWN:
                return
    finally:
        socket.close()


def _output_thread(output_queue: queue.Queue, socket: Any, stop: threading.Event) -> None:
    """Owns the output socket; a `(None, None)` item ends it. Sends time out (SNDTIMEO) so
    that a front end that is gone cannot block this thread: once `stop` is set, what
    cannot be sent is dropped."""
    import zmq

    encoder = msgspec.msgpack.Encoder()
    try:
        while True:
            kind, payload = output_queue.get()
            if kind is None:
                return
            data = payload.encode() if kind is OutputKind.FATAL else encoder.encode(payload)
            while True:
                try:
                    socket.send_multipart([kind.value, data])
                    break
                except zmq.Again:
                    if stop.is_set():
                        return
    finally:
        socket.close(linger=0 if stop.is_set() else None)


def _remove_socket_dir(address: str) -> None:
    """Remove the directory of an "ipc://" socket address `AsyncMPClient` made (a
    `pagedinfer-*` temporary directory), whose owner died without removing it."""
    path = os.path.dirname(address.removeprefix("ipc://"))
    if address.startswith("ipc://") and os.path.basename(path).startswith("pagedinfer-"):
        shutil.rmtree(path, ignore_errors=True)


def _connect(socket: Any, address: str) -> None:
    """`socket.connect(address)`; a "tcp://[v6 address]:port" needs ZMQ's IPv6 switch."""
    import zmq

    if address.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    socket.connect(address)


def run_engine_core(
    config_json: str, input_address: str, output_address: str, parent_pid: int | None
) -> None:
    """Body of the engine process: of the child process `AsyncMPClient` starts (see
    `__main__` below, "ipc://" addresses), or of the Ray actor `RayMPClient` starts
    ("tcp://" addresses, `parent_pid` None). The front end has bound both addresses."""
    import zmq

    setup_logging()
    context = zmq.Context()
    out_socket = context.socket(zmq.PUSH)
    out_socket.setsockopt(zmq.LINGER, 5000)
    out_socket.setsockopt(zmq.SNDTIMEO, 500)
    _connect(out_socket, output_address)
    in_socket = context.socket(zmq.PULL)
    in_socket.setsockopt(zmq.LINGER, 0)
    _connect(in_socket, input_address)
    encoder = msgspec.msgpack.Encoder()
    output_queue: queue.Queue = queue.Queue()
    try:
        engine = EngineCoreProc(config_from_json(config_json), output_queue)
    except Exception as exc:
        logger.exception("Engine core failed to start.")
        out_socket.send_multipart([OutputKind.FATAL.value, f"{type(exc).__name__}: {exc}".encode()])
        out_socket.close()
        context.term()
        raise SystemExit(1) from exc
    info = engine.model_info
    ready = EngineCoreReady(
        max_model_len=engine.max_model_len,
        vocab_size=info.vocab_size,
        num_kv_blocks=info.num_kv_blocks,
        block_size=engine.config.cache_config.block_size,
        dtype=info.dtype,
        load_time_s=info.load_time_s,
    )
    out_socket.send_multipart([OutputKind.READY.value, encoder.encode(ready)])
    stop = threading.Event()
    writer = threading.Thread(
        target=_output_thread, args=(output_queue, out_socket, stop), name="engine-out", daemon=True
    )
    reader = threading.Thread(
        target=_input_thread,
        args=(engine, in_socket, parent_pid, stop),
        name="engine-in",
        daemon=True,
    )
    writer.start()
    reader.start()
    code = 0
    try:
        engine.run_busy_loop()
    except Exception as exc:
        code = 1
        logger.exception("Engine core step failed; the engine process exits.")
        # The cause first (clients see the first line), then the traceback.
        reason = f"engine core step failed: {type(exc).__name__}: {exc}\n"
        output_queue.put((OutputKind.FATAL, reason + traceback.format_exc()))
    finally:
        output_queue.put((None, None))
        writer.join(timeout=5)
        stop.set()
        reader.join(timeout=3)
        engine.shutdown()
        if parent_pid is not None and os.getppid() != parent_pid:
            _remove_socket_dir(input_address)  # the front end that made it is gone
        if writer.is_alive() or reader.is_alive():
            # A send stuck on a peer that is gone (the front end died): nobody is left to
            # read what it holds. Exit now rather than wait on a socket forever.
            logging.shutdown()
            os._exit(code)
        context.term()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    import sys

    run_engine_core(sys.stdin.read(), sys.argv[1], sys.argv[2], int(sys.argv[3]))
