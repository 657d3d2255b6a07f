"""One worker rank in its own process (`python -m pagedinfer.executor.worker_proc`).

Started by `MultiProcExecutor` as a fresh interpreter (not a multiprocessing fork or
spawn: nothing is pickled, and the parent's `__main__` is not re-imported). Its start-up,
as the seed describes:

1. read its setup from stdin (JSON: the engine config, its rank, the torch.distributed
   init address, the broadcast queue's handle, the ready pipe's file descriptor);
2. build the `Worker` (joining the process groups), attach to `rpc_broadcast_mq` as reader
   `rank`, create its own `worker_response_mq` (one reader: the executor);
3. send `WorkerReady` with that queue's handle on the ready pipe, then complete both
   queues' handshakes in the same order as the parent (broadcast first, then response);
4. busy-loop: dequeue a call, run it, reply when the call expects one from this rank.

It exits on `Shutdown`, on SIGTERM/SIGINT, when the broadcast queue's writer (the
executor's process) dies, or after an exception: a rank that failed mid-step cannot take
part in the next collective, so it reports the error and leaves; the executor's monitor
turns the exit into an engine error.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec

from pagedinfer.logging_utils import setup_worker_logging

logger = logging.getLogger("pagedinfer")

__all__ = ["handle_call", "main"]


def _watch_parent(parent_pid: int) -> None:
    """Exit if the executor's process is gone (re-parented to init or a subreaper)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            logger.error("worker: the executor's process %d is gone; exiting", parent_pid)
            os._exit(1)


def main() -> None:
    setup = json.loads(sys.stdin.read())
    rank: int = setup["rank"]
    setup_worker_logging(rank)

    def _terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    threading.Thread(
        target=_watch_parent, args=(setup["parent_pid"],), daemon=True, name="parent-watch"
    ).start()

    # Heavy imports after the signal handlers: a shutdown during import still exits.
    from pagedinfer.config import config_from_json
    from pagedinfer.distributed.shm_mq import Handle, MessageQueue
    from pagedinfer.executor.messages import WorkerReady
    from pagedinfer.executor.multiproc import wait_spin_s
    from pagedinfer.worker.worker import Worker

    config = config_from_json(setup["config"])
    ready_fd: int = setup["ready_fd"]
    if config.model_config.num_threads is None:
        # The ranks share this machine's cores; more threads than cores only contend.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.world_size))
    worker = Worker(config, rank, setup["init_method"])
    broadcast = MessageQueue.create_from_handle(
        msgspec.msgpack.decode(bytes.fromhex(setup["broadcast_handle"]), type=Handle), rank
    )
    broadcast.spin_s = wait_spin_s(config.parallel_config.world_size)
    response = MessageQueue(n_reader=1)
    ready = WorkerReady(rank, os.getpid(), msgspec.msgpack.encode(response.export_handle()))
    with os.fdopen(ready_fd, "wb") as pipe:
        pipe.write(msgspec.msgpack.encode(ready))
    broadcast.wait_until_ready()
    response.wait_until_ready()
    try:
        _busy_loop(worker, broadcast, response, rank, config.parallel_config)
    finally:
        worker.shutdown()
        broadcast.close()
        response.close()


def handle_call(worker: Any, call: Any, rank: int, output_rank: int) -> tuple[bool, Any]:
    """Run one decoded `WorkerCall` (not `Shutdown`) on `worker`: whether the executor
    expects a reply from this rank, and the result. Exceptions propagate; the caller reports
    them. Shared by this process's busy loop and the Ray actor (`ray_worker.py`), so both
    executors dispatch a call the same way."""
    from pagedinfer.executor.messages import (
        WORKER_UTILITY_METHODS,
        ExecuteModel,
        InitializeCache,
        LoadModel,
        SampleTokens,
        Utility,
    )
    from pagedinfer.executor.uniproc import model_info

    if isinstance(call, LoadModel):
        worker.load_model()
        return True, model_info(worker)
    if isinstance(call, InitializeCache):
        return True, worker.initialize_cache(call.num_blocks, call.max_model_len)
    if isinstance(call, ExecuteModel):
        result = worker.execute_model(call.scheduler_output)
        if result is None and call.sample:
            result = worker.sample_tokens(call.grammar_output)
        # Only the output rank answers for a step, once it has the step's output: after
        # sampling, or at once for a step without tokens (`Executor.execute_model`).
        return (call.sample or result is not None) and rank == output_rank, result
    if isinstance(call, SampleTokens):
        return rank == output_rank, worker.sample_tokens(call.grammar_output)
    if isinstance(call, Utility):
        if call.method not in WORKER_UTILITY_METHODS:
            raise ValueError(f"unknown worker method {call.method!r}")
        return True, getattr(worker, call.method)(*call.args)
    # The decoder admits only the union's types; Shutdown is the caller's to handle.
    raise TypeError(f"unexpected call {call!r}")  # pragma: no cover


def _busy_loop(worker: Any, broadcast: Any, response: Any, rank: int, parallel: Any) -> None:
    from pagedinfer.distributed.serial import MsgpackDecoder, MsgpackEncoder
    from pagedinfer.executor.messages import Shutdown, WorkerCall, WorkerReply

    decoder = MsgpackDecoder(WorkerCall)
    encoder = MsgpackEncoder()
    # TP rank 0 of the last pipeline stage answers for the step (vLLM's output rank).
    output_rank = parallel.world_size - parallel.tensor_parallel_size
    while True:
        call = decoder.decode(broadcast.dequeue())
        if isinstance(call, Shutdown):
            return
        try:
            reply_wanted, result = handle_call(worker, call, rank, output_rank)
        except Exception as exc:
            logger.error("worker %d failed:\n%s", rank, traceback.format_exc())
            response.enqueue(
                encoder.encode(WorkerReply(error=f"worker {rank}: {type(exc).__name__}: {exc}"))
            )
            # This rank's state (and any collective it was in) is now undefined.
            raise SystemExit(1) from exc
        if reply_wanted:
            response.enqueue(encoder.encode(WorkerReply(result=result)))


if __name__ == "__main__":
    main()
