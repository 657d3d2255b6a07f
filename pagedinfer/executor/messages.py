"""The typed messages between an executor and its worker processes.

The executor broadcasts one `WorkerCall` per RPC on `rpc_broadcast_mq`; a worker answers
on its own `worker_response_mq` with a `WorkerReply`. Both are msgspec structs encoded by
`distributed/serial.py` (tensors and arrays as raw buffers): nothing on these channels is
pickled, so a message can carry data but never code. A call names its kind by its type
(a tagged union), and a utility call names a method from a fixed whitelist.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedinfer.executor.base import ModelInfo

__all__ = [
    "LoadModel",
    "InitializeCache",
    "ExecuteModel",
    "SampleTokens",
    "Utility",
    "Shutdown",
    "WorkerCall",
    "WorkerReady",
    "WorkerReply",
    "WORKER_UTILITY_METHODS",
]

T = TypeVar("T")


class LoadModel(msgspec.Struct, tag=True, array_like=True):
    """Every rank loads its shard and replies with `ModelInfo`."""


class InitializeCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int
    max_model_len: int


class ExecuteModel(msgspec.Struct, tag=True, array_like=True):
    """Forward pass; no reply, except from the output rank for a step without tokens (its
    output, at once: `Executor.execute_model`). With `sample`, the output rank also samples
    (grammar included) and replies: one message per step for pipelined batches."""

    scheduler_output: SchedulerOutput
    sample: bool = False
    grammar_output: GrammarOutput | None = None


class SampleTokens(msgspec.Struct, tag=True, array_like=True):
    """Sample from the last forward pass; the output rank replies `ModelRunnerOutput`."""

    grammar_output: GrammarOutput | None = None


class Utility(msgspec.Struct, tag=True, array_like=True):
    """A whitelisted worker method (`WORKER_UTILITY_METHODS`); every rank replies."""

    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Leave the busy loop and exit."""


WorkerCall = LoadModel | InitializeCache | ExecuteModel | SampleTokens | Utility | Shutdown

WORKER_UTILITY_METHODS = frozenset({"ping", "rank_info"})


class WorkerReady(msgspec.Struct):
    """Sent once on the worker's ready pipe: its response queue's handle (as msgpack bytes,
    so this module need not know the queue's types)."""

    rank: int
    pid: int
    response_handle: bytes


class WorkerReply(msgspec.Struct, Generic[T], omit_defaults=True):
    """A call's result, or the error it raised (as text: `error` set means failure)."""

    result: T | None = None
    error: str | None = None


# The reply types the executor decodes, by call.
ModelInfoReply = WorkerReply[ModelInfo]
RunnerOutputReply = WorkerReply[ModelRunnerOutput]
AnyReply = WorkerReply[Any]
