"""`MultiProcExecutor`: one worker process per rank behind shared-memory queues.

Start-up, as seed 004 describes it:

1. create `rpc_broadcast_mq` (one writer: this process; one reader per rank);
2. for each rank, a one-way ready pipe and a daemon-like worker process
   (`worker_proc.py`, a fresh interpreter in its own process group) given the queue's
   handle, its rank and the torch.distributed address;
3. each child builds its worker, creates its own `worker_response_mq` and sends that
   queue's handle back through its ready pipe; once every rank's handle is in, the parent
   completes the queues' handshakes (broadcast first, then each response queue, the
   order the children use) and starts a monitor thread on the children's pidfds.

Per step the engine's `execute_model` enqueues the call once for every rank (no
blocking), and waits on the output rank's response queue only (TP rank 0 of the last
pipeline stage). From the engine's side nothing differs from `UniProcExecutor`.

Failure: when any child exits, the monitor marks the executor failed, cancels the pending
queue waits and kills the other ranks (they would block in their next collective), so
the engine's current call raises `ExecutorFailed` within about a second and the engine
fails its requests. `shutdown` asks the workers to leave, then SIGTERMs and finally
SIGKILLs the stragglers, and unlinks every shared-memory segment, a killed writer's
included.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from pagedinfer.config import EngineConfig, config_to_json
from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedinfer.distributed.serial import MsgpackDecoder, MsgpackEncoder
from pagedinfer.distributed.shm_mq import Handle, MessageQueue
from pagedinfer.executor.base import Executor, ExecutorFailed, ModelInfo
from pagedinfer.executor.messages import (
    AnyReply,
    ExecuteModel,
    InitializeCache,
    LoadModel,
    ModelInfoReply,
    RunnerOutputReply,
    SampleTokens,
    Shutdown,
    Utility,
    WorkerCall,
    WorkerReady,
    WorkerReply,
)

logger = logging.getLogger("pagedinfer")

__all__ = ["MultiProcExecutor"]

# How often a waiting call looks at the failure flag (the monitor also cancels waits).
_POLL_S = 0.5
_STARTUP_TIMEOUT_S = 600.0
_SHUTDOWN_GRACE_S = 4.0


def wait_spin_s(world_size: int) -> float:
    """How long queue waits spin before sleeping. A reply takes a whole forward pass, and
    where the workers' threads already take every core a spinning waiter steals one of
    them (measured, 2 cores, batch-1 decode, one worker: 50 ms of spin made a step 4.6x
    slower, 5 ms 1.56x, 0.5 ms 1.03x). With a core to spare (the engine's plus one per
    worker) spinning is free and saves the ~0.3 ms wake-up of a sleeper."""
    spare = (os.cpu_count() or 1) > world_size + 1
    return 0.05 if spare else 0.0005


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _WorkerHandle:
    def __init__(self, rank: int, proc: subprocess.Popen, ready_fd: int) -> None:
        self.rank = rank
        self.proc = proc
        self.ready_fd = ready_fd
        self.response: MessageQueue | None = None
        self.response_shm: str | None = None


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        par = config.parallel_config
        self.world_size = par.world_size
        self.output_rank = self.world_size - par.tensor_parallel_size
        self._encoder = MsgpackEncoder()
        self._decoders: dict[type, MsgpackDecoder] = {}
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        # Pipelined steps: one thread reads the output rank's replies in call order.
        self._reply_pool: ThreadPoolExecutor | None = None
        self.broadcast = MessageQueue(n_reader=self.world_size)
        self.workers: list[_WorkerHandle] = []
        try:
            self._start_workers(config)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._watch_workers, name="executor-monitor", daemon=True
        )
        self._monitor.start()
        # Workers also leave on their own when this process dies; at a normal interpreter
        # exit this stops them (and unlinks the queues) first.
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ start-up

    def _start_workers(self, config: EngineConfig) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        handle = msgspec.msgpack.encode(self.broadcast.export_handle()).hex()
        config_json = config_to_json(config)
        for rank in range(self.world_size):
            read_fd, write_fd = os.pipe()
            setup = {
                "rank": rank,
                "config": config_json,
                "init_method": init_method,
                "broadcast_handle": handle,
                "ready_fd": write_fd,
                "parent_pid": os.getpid(),
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagedinfer.executor.worker_proc"],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                start_new_session=True,  # a Ctrl-C reaches the engine, which stops them
            )
            os.close(write_fd)  # the child holds the only write end: EOF if it dies
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(setup).encode())
            proc.stdin.close()
            self.workers.append(_WorkerHandle(rank, proc, read_fd))
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        for w in self.workers:
            ready = self._read_ready(w, deadline)
            w.response = MessageQueue.create_from_handle(
                msgspec.msgpack.decode(ready.response_handle, type=Handle), 0
            )
            w.response_shm = w.response.export_handle().shm_name
            w.response.spin_s = wait_spin_s(self.world_size)
        self.broadcast.wait_until_ready(timeout=_STARTUP_TIMEOUT_S)
        for w in self.workers:
            assert w.response is not None
            w.response.wait_until_ready(timeout=_STARTUP_TIMEOUT_S)
        logger.info(
            "MultiProcExecutor: %d workers (tensor parallel %d x pipeline parallel %d), pids %s.",
            self.world_size,
            self.config.parallel_config.tensor_parallel_size,
            self.config.parallel_config.pipeline_parallel_size,
            [w.proc.pid for w in self.workers],
        )

    @staticmethod
    def _read_ready(w: _WorkerHandle, deadline: float) -> WorkerReady:
        data = b""
        with os.fdopen(w.ready_fd, "rb") as pipe:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"worker {w.rank} did not start in time")
                readable, _, _ = select.select([pipe], [], [], min(remaining, 1.0))
                if not readable:
                    continue
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    break
                data += chunk
        if not data:
            code = w.proc.wait(timeout=5)
            raise ExecutorFailed(f"worker {w.rank} exited during start-up (exit code {code})")
        return msgspec.msgpack.decode(data, type=WorkerReady)

    # ------------------------------------------------------------------ monitoring

    def _watch_workers(self) -> None:
        """Wait on the children's pidfds; the first exit that is not a shutdown fails the
        executor."""
        fds = {os.pidfd_open(w.proc.pid): w for w in self.workers}
        try:
            while not self._closed:
                readable, _, _ = select.select(list(fds), [], [], 1.0)
                if not readable or self._closed:
                    continue
                dead = [fds[fd] for fd in readable]
                for w in dead:
                    w.proc.wait()
                # Several at once: a rank killed by a signal is the cause; the others
                # exited because their collective lost it.
                w = min(dead, key=lambda d: (d.proc.returncode >= 0, d.rank))
                code = w.proc.returncode
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                self._fail(f"worker rank {w.rank} (pid {w.proc.pid}) died ({how})")
                return
        finally:
            for fd in fds:
                os.close(fd)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = reason
        logger.error("MultiProcExecutor failed: %s", reason)
        # The other ranks would wait forever in their next collective.
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
        self.broadcast.cancel()
        for w in self.workers:
            if w.response is not None:
                w.response.cancel()

    def check_health(self) -> None:
        if self._failure is not None:
            raise ExecutorFailed(self._failure)

    # ------------------------------------------------------------------ RPC

    def _decoder(self, reply_type: type) -> MsgpackDecoder:
        decoder = self._decoders.get(reply_type)
        if decoder is None:
            decoder = self._decoders[reply_type] = MsgpackDecoder(reply_type)
        return decoder

    def _broadcast(self, call: WorkerCall) -> None:
        self.check_health()
        try:
            self.broadcast.enqueue(self._encoder.encode(call))
        except Exception as exc:
            self.check_health()  # a death explains the error better
            raise ExecutorFailed(f"broadcast failed: {exc}") from exc

    def _reply(self, rank: int, reply_type: type) -> Any:
        queue = self.workers[rank].response
        assert queue is not None
        while True:
            self.check_health()
            try:
                buffers = queue.dequeue(timeout=_POLL_S)
                break
            except TimeoutError:
                continue
            except Exception as exc:
                self.check_health()
                raise ExecutorFailed(f"worker {rank}: {exc}") from exc
        reply: WorkerReply = self._decoder(reply_type).decode(buffers)
        if reply.error is not None:
            # A rank's error is often the echo of another rank's death (its collective
            # lost the peer): give the monitor a moment, and name the death if there is one.
            deadline = time.monotonic() + 1.0
            while self._failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._failure is not None:
                raise ExecutorFailed(f"{self._failure}; then {reply.error.splitlines()[0]}")
            raise ExecutorFailed(reply.error)
        return reply.result

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """A whitelisted worker method on every rank; their results in rank order."""
        self._broadcast(Utility(method, list(args)))
        return [self._reply(r, AnyReply) for r in range(self.world_size)]

    def load_model(self) -> ModelInfo:
        self._broadcast(LoadModel())
        infos: list[ModelInfo] = [self._reply(r, ModelInfoReply) for r in range(self.world_size)]
        # Every rank allocates the same number of blocks: the smallest any can hold.
        num_blocks = min(i.num_kv_blocks for i in infos)
        first = infos[0]
        return ModelInfo(
            vocab_size=first.vocab_size,
            max_position_embeddings=first.max_position_embeddings,
            num_kv_blocks=num_blocks,
            dtype=first.dtype,
            load_time_s=max(i.load_time_s for i in infos),
            kv_bytes_per_block=sum(i.kv_bytes_per_block for i in infos),
        )

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._broadcast(InitializeCache(num_blocks, max_model_len))
        for r in range(self.world_size):
            self._reply(r, AnyReply)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._broadcast(ExecuteModel(scheduler_output))
        if scheduler_output.total_num_scheduled_tokens == 0:
            # No forward pass: the output rank answers with the step's output at once.
            return self._reply(self.output_rank, RunnerOutputReply)
        return None  # the engine computes the grammar bitmask, then sample_tokens()

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        self._broadcast(SampleTokens(grammar_output))
        return self._reply(self.output_rank, RunnerOutputReply)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> Future[ModelRunnerOutput]:
        """Forward and sample as one call; the reply is collected by a single thread, so
        replies are matched to calls in order."""
        self._broadcast(ExecuteModel(scheduler_output, True, grammar_output))
        if self._reply_pool is None:
            self._reply_pool = ThreadPoolExecutor(1, thread_name_prefix="executor-replies")
        return self._reply_pool.submit(self._reply, self.output_rank, RunnerOutputReply)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._failure is None and self.workers:
            try:
                self.broadcast.enqueue(self._encoder.encode(Shutdown()), timeout=1.0)
            except Exception:  # a full ring or a dead reader: the signals below suffice
                pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline + 2.0 - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        if self._reply_pool is not None:
            self._reply_pool.shutdown(wait=False, cancel_futures=True)
        atexit.unregister(self.shutdown)
        for w in self.workers:
            if w.response is not None:
                w.response.close()
            if w.response_shm is not None:
                _unlink_shm(w.response_shm)  # its writer may have been killed
        self.broadcast.close()


def _unlink_shm(name: str) -> None:
    path = os.path.join("/dev/shm", name.lstrip("/"))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
