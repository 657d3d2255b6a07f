"""The wire protocol between a front end and an engine core in another process.

Wire protocol (both directions: two-frame ZMQ messages, `[kind, msgpack payload]`, encoded
and decoded by msgspec into the typed structs of this
module; nothing on these sockets is pickled):

    front end -> engine (PUSH -> PULL, `input_address`)
        ADD      EngineCoreRequest
        ABORT    list[str]                     request ids
        UTILITY  UtilityCall                   a whitelisted EngineCore method, by name
        SHUTDOWN (empty)
    engine -> front end (PUSH -> PULL, `output_address`)
        READY    EngineCoreReady               once, after the model and the cache are up
        OUTPUTS  EngineCoreOutputs             after every step that produced something
        UTILITY  UtilityResult
        FATAL    str                           the engine is about to exit: why

`EngineCoreRequest` and `EngineCoreOutputs` are `core/messages.py` (the scheduler makes the
outputs); the kinds, the utility call and result, the ready message and the input decoding
are here, so that both ends (`engine/core_proc.py`, the engine core's process, and the
clients of `engine/core_client.py` and `engine/dp_client.py`) speak from one definition.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import msgspec

from pagedinfer.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

logger = logging.getLogger("pagedinfer")

__all__ = [
    "EngineCoreReady",
    "InputKind",
    "OutputKind",
    "UtilityCall",
    "UtilityResult",
    "UTILITY_METHODS",
    "decode_input",
    "reject_malformed_add",
]


class InputKind(bytes, enum.Enum):
    ADD = b"A"
    ABORT = b"B"
    UTILITY = b"U"
    SHUTDOWN = b"S"


class OutputKind(bytes, enum.Enum):
    READY = b"R"
    OUTPUTS = b"O"
    UTILITY = b"U"
    FATAL = b"F"


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreReady(msgspec.Struct):
    """What the front end needs to know about the engine before serving."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    load_time_s: float


# Utility calls the engine answers; anything else is refused (a message names a method, it
# must not be able to reach arbitrary attributes).
UTILITY_METHODS = frozenset(
    {"reset_prefix_cache", "get_kv_cache_usage", "get_scheduler_stats", "ping"}
)


_INPUT_DECODERS: dict[InputKind, msgspec.msgpack.Decoder[Any]] = {
    InputKind.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    InputKind.ABORT: msgspec.msgpack.Decoder(list[str]),
    InputKind.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
}


def decode_input(frames: list[bytes]) -> tuple[InputKind, Any]:
    """Two frames -> (kind, typed payload); ValueError for anything malformed."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind = InputKind(frames[0])
    if kind is InputKind.SHUTDOWN:
        return kind, None
    try:
        return kind, _INPUT_DECODERS[kind].decode(frames[1])
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad {kind.name} payload: {exc}") from exc


def reject_malformed_add(frames: list[bytes], error: Exception) -> EngineCoreOutputs | None:
    """An ADD the engine cannot decode still names its request (the first field of the
    array): answer it finished with reason "error", so the front end does not wait forever
    for a request the engine never took. None if not even the id can be read."""
    if len(frames) != 2 or frames[0] != InputKind.ADD.value:
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return None
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        return None
    logger.error("Rejected request %s: %s", fields[0], error)
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(fields[0], [], finish_reason=FinishReason.ERROR)]
    )
