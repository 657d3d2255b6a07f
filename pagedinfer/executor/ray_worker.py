"""`RayWorkerWrapper`: one rank of `RayDistributedExecutor`, the body of its Ray actor.

The actor holds the rank's `Worker` and the codec. Each call arrives as the msgpack
buffers of a `WorkerCall` (bytes: see `encode_for_ray`); the actor decodes it, dispatches
it through `worker_proc.handle_call`, as a worker process of `MultiProcExecutor` does, and
returns its encoded `WorkerReply` (or None where the executor expects no reply). The calls
run one at a time in submission order, which keeps each rank's execute/sample sequence; a
second concurrency group (`MONITOR_GROUP`) runs the watch call that the executor's monitor
thread waits on. `remote_worker_class` makes the remote class on first use, so that
importing this module does not import Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
from functools import cache
from typing import Any

from pagedinfer.config import config_from_json
from pagedinfer.distributed.serial import MsgpackDecoder, MsgpackEncoder
from pagedinfer.executor.messages import WorkerCall, WorkerReply
from pagedinfer.executor.worker_proc import handle_call
from pagedinfer.logging_utils import setup_worker_logging

logger = logging.getLogger("pagedinfer")

__all__ = ["MONITOR_GROUP", "RayWorkerWrapper", "encode_for_ray", "remote_worker_class"]

# The actors' second concurrency group: the watch call, beside the one running the calls.
MONITOR_GROUP = "monitor"


def encode_for_ray(encoder: MsgpackEncoder, obj: Any) -> list[bytes]:
    """The codec's buffers as bytes: Ray serialises bytes as they are, a memoryview not."""
    return [bytes(b) for b in encoder.encode(obj)]


class RayWorkerWrapper:
    """One rank: the body of a Ray actor (`remote_worker_class` turns it into a remote
    class, so importing this module does not import Ray). It holds the `Worker` and the
    codec."""

    def __init__(self, rank: int, config_json: str) -> None:
        setup_worker_logging(rank)
        self.rank = rank
        self.config = config_from_json(config_json)
        par = self.config.parallel_config
        # TP rank 0 of the last pipeline stage answers for the step (vLLM's output rank).
        self.output_rank = par.world_size - par.tensor_parallel_size
        self.worker: Any = None
        self._decoder = MsgpackDecoder(WorkerCall)
        self._encoder = MsgpackEncoder()

    def node_info(self) -> tuple[str, str, int, int]:
        """(Ray node id, node IP, the node's CPU count, pid)."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return node_id, ray.util.get_node_ip_address(), os.cpu_count() or 1, os.getpid()

    def free_port(self) -> int:
        """A port free on this node now (rank 0 then listens on it for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, init_method: str, num_local_ranks: int) -> int:
        """Build the `Worker` (joins the process groups: every rank must be in this call at
        once); returns its torch thread count."""
        import torch

        from pagedinfer.worker.worker import Worker

        if self.config.model_config.num_threads is None:
            # The ranks on this node share its cores; more threads than cores only contend.
            # (Set here, in the thread that runs every later call: OpenMP's thread count is
            # per calling thread, and Ray gives an actor OMP_NUM_THREADS=1.)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local_ranks))
        self.worker = Worker(self.config, self.rank, init_method)
        return torch.get_num_threads()

    def execute(self, data: list[bytes]) -> list[bytes] | None:
        """One encoded `WorkerCall`: its encoded `WorkerReply`, None where the executor
        expects no reply from this rank. An error is sent back as a reply (the executor then
        kills every rank: this one's state is undefined)."""
        try:
            call = self._decoder.decode(data)
            reply_wanted, result = handle_call(self.worker, call, self.rank, self.output_rank)
        except Exception as exc:
            logger.error("worker %d failed:\n%s", self.rank, traceback.format_exc())
            error = f"worker {self.rank}: {type(exc).__name__}: {exc}"
            return encode_for_ray(self._encoder, WorkerReply(error=error))
        if not reply_wanted:
            return None
        return encode_for_ray(self._encoder, WorkerReply(result=result))

    def watch(self) -> None:
        """Never returns (runs in the monitor concurrency group): the executor holds this
        call's ref, which Ray fails as soon as this actor's process dies."""
        threading.Event().wait()


@cache
def remote_worker_class() -> Any:
    import ray

    # max_concurrency=1: the calls run one at a time, in the order they were submitted.
    # (Ray's type stubs list only the task options of `ray.remote`, not the actor ones.)
    return ray.remote(  # type: ignore[call-overload]
        num_cpus=1, max_concurrency=1, concurrency_groups={MONITOR_GROUP: 1}
    )(RayWorkerWrapper)
