"""The typed wire codec between the executor and its workers: msgpack plus raw tensor bytes.

A message is any msgspec-encodable object (msgspec Structs, dataclasses, lists, dicts,
scalars...) that may hold `torch.Tensor` and `numpy.ndarray` values anywhere, e.g.
`SchedulerOutput` or `GrammarOutput` (both in core/sched_output.py). Nothing is pickled: a
message cannot run code on its receiver, and the receiver decodes into a declared type, so a
malformed message fails as a `msgspec.ValidationError` at the boundary instead of deep
inside the model runner.

`MsgpackEncoder.encode(obj)` returns a list of buffers, the shape `MessageQueue.enqueue`
takes: buffer 0 is the msgpack document, and each array becomes a msgpack extension value

    Ext(code=torch|numpy, data = <BBB dtype_id, ndim, is_inline> + ndim x <q dim> + tail)

whose tail is either the array's raw bytes (below `inline_threshold_bytes`, where a separate
buffer costs more than the copy) or `<I index` of a following buffer: a zero-copy memoryview
of the contiguous CPU array. `MsgpackDecoder(type_).decode(buffers)` rebuilds the arrays
(those from separate buffers as views of them, without a copy) and validates the rest against
`type_`. Arrays cross as C-contiguous CPU data; dtypes are those of `_DTYPES` (bfloat16, which
numpy lacks, is sent as its raw 2-byte words).

Neither class is thread-safe: each holds per-call state for its hooks.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

__all__ = ["MsgpackDecoder", "MsgpackEncoder"]

_EXT_TORCH, _EXT_NUMPY = 1, 2
_ARRAY_HEADER = struct.Struct("<BBB")  # dtype id, ndim, is_inline
_INDEX = struct.Struct("<I")

# The wire id of a dtype is its position here; append only, never reorder.
_DTYPES: list[tuple[torch.dtype, np.dtype | None]] = [
    (torch.float32, np.dtype(np.float32)),
    (torch.bfloat16, None),
    (torch.float16, np.dtype(np.float16)),
    (torch.int64, np.dtype(np.int64)),
    (torch.int32, np.dtype(np.int32)),
    (torch.int8, np.dtype(np.int8)),
    (torch.uint8, np.dtype(np.uint8)),
    (torch.bool, np.dtype(np.bool_)),
    (torch.float64, np.dtype(np.float64)),
    (torch.int16, np.dtype(np.int16)),
]
_TORCH_ID = {t: i for i, (t, _) in enumerate(_DTYPES)}
_NUMPY_ID = {n: i for i, (_, n) in enumerate(_DTYPES) if n is not None}


class MsgpackEncoder:
    """Encodes a message into `[msgpack, raw buffer, ...]` (see the module docstring)."""

    def __init__(self, inline_threshold_bytes: int = 256) -> None:
        self.inline_threshold_bytes = inline_threshold_bytes
        """Arrays smaller than this are copied into the msgpack document. A separate buffer
        costs a length in the queue's header, its own copy call and, for the decoder, a
        tensor over a separate allocation; below a few hundred bytes the copy is cheaper."""
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffers: list[bytes | memoryview] = []

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """Buffer 0 is msgpack; the rest alias the message's arrays (keep them unchanged until
        the buffers are sent)."""
        self._buffers = buffers = [b""]
        try:
            buffers[0] = self._encoder.encode(obj)
        finally:
            self._buffers = []
        return buffers

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            if tensor.dtype not in _TORCH_ID:
                raise TypeError(f"cannot encode a tensor of dtype {tensor.dtype}")
            # [numel * itemsize] bytes; .numpy() shares the memory (bfloat16 has no numpy type,
            # hence the byte view first).
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            return self._ext(_EXT_TORCH, _TORCH_ID[tensor.dtype], tensor.shape, raw)
        if isinstance(obj, np.ndarray):
            # (Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.)
            array = obj if obj.flags.c_contiguous else obj.copy(order="C")
            if array.dtype not in _NUMPY_ID:
                raise TypeError(f"cannot encode an array of dtype {array.dtype}")
            raw = memoryview(array.reshape(-1).view(np.uint8))  # [nbytes]
            return self._ext(_EXT_NUMPY, _NUMPY_ID[array.dtype], array.shape, raw)
        raise TypeError(f"cannot encode {type(obj).__name__} (the codec never pickles)")

    def _ext(
        self, code: int, dtype_id: int, shape: Sequence[int], raw: memoryview
    ) -> msgspec.msgpack.Ext:
        is_inline = raw.nbytes < self.inline_threshold_bytes
        header = _ARRAY_HEADER.pack(dtype_id, len(shape), is_inline)
        header += struct.pack(f"<{len(shape)}q", *shape)
        if is_inline:
            return msgspec.msgpack.Ext(code, header + raw.tobytes())
        self._buffers.append(raw)
        return msgspec.msgpack.Ext(code, header + _INDEX.pack(len(self._buffers) - 1))


class MsgpackDecoder:
    """Decodes `[msgpack, raw buffer, ...]` into `type_` (msgspec's typed decoding)."""

    def __init__(self, type_: Any = Any) -> None:
        try:
            self._decoder = msgspec.msgpack.Decoder(
                type_, ext_hook=self._ext_hook, dec_hook=_check_array_type
            )
        except NameError as exc:
            raise TypeError(
                f"cannot decode into {type_!r}: annotation name {exc.name!r} is not defined at "
                "runtime (imported only under TYPE_CHECKING?); msgspec resolves field "
                "annotations in their module's namespace"
            ) from exc
        self._buffers: Sequence[Any] = ()

    def decode(self, buffers: Sequence[bytes | bytearray | memoryview]) -> Any:
        """Arrays that came in separate buffers are views of them: writable ones are used as
        they are (those `MessageQueue.dequeue` returns are), read-only ones are copied."""
        self._buffers = buffers
        try:
            return self._decoder.decode(buffers[0])
        finally:
            self._buffers = ()

    def _ext_hook(self, code: int, data: memoryview) -> torch.Tensor | np.ndarray:
        dtype_id, ndim, is_inline = _ARRAY_HEADER.unpack_from(data)
        shape = struct.unpack_from(f"<{ndim}q", data, _ARRAY_HEADER.size)
        tail = _ARRAY_HEADER.size + 8 * ndim
        if is_inline:
            raw: Any = bytearray(data[tail:])  # `data` aliases buffer 0: copy
        else:
            raw = self._buffers[_INDEX.unpack_from(data, tail)[0]]
            if memoryview(raw).readonly:  # torch and numpy arrays over it would be read-only
                raw = bytearray(raw)
        torch_dtype, numpy_dtype = _DTYPES[dtype_id]
        if code == _EXT_NUMPY:
            assert numpy_dtype is not None
            return np.frombuffer(raw, dtype=numpy_dtype).reshape(shape)
        if code != _EXT_TORCH:
            raise ValueError(f"unknown msgpack extension code {code}")
        if len(raw) == 0:  # torch.frombuffer rejects empty buffers
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(raw, dtype=torch_dtype).reshape(shape)


def _check_array_type(type_: Any, obj: Any) -> Any:
    """msgspec's hook for field types it does not know (torch.Tensor, np.ndarray): by then
    `_ext_hook` has built the object, only its class is left to check. A parameterised
    annotation (`npt.NDArray[np.int32]`) is checked by its class (`np.ndarray`)."""
    cls = typing.get_origin(type_) or type_
    if isinstance(cls, type) and isinstance(obj, cls):
        return obj
    raise TypeError(f"expected {getattr(type_, '__name__', type_)}, got {type(obj).__name__}")
