"""The ZmqConnector's pull protocol, shared by the producer's server (`server.py`) and the
consumer's load threads (`puller.py`).

ZMQ DEALER on the decode side, ROUTER bound to `tcp://{kv_ip}:{kv_port}` on the prefill
side; msgspec msgpack structs, never pickle:

- pull: one frame, `PullRequest(xfer_id, engine_id, request_id, start, num_tokens,
  prompt_hash)`. `num_tokens == 0` only releases the hold (the decode side had nothing to
  load). `prompt_hash` is the hash of the decode side's own prompt: the producer serves a
  hold only to a pull naming the hash of the prompt it holds (a mismatch is refused and
  leaves the hold for its own reader).
- reply: `PullReply(xfer_id, error, layer_names, shape, dtype, checksums)`, then one raw
  frame per layer (in `layer_names` order): the `shape = [2, n, kv_heads, head_dim]` K and
  V of the tokens, gathered from the held blocks, in the producer's cache dtype; each with
  a blake2b checksum in `checksums`. A non-empty `error` (unknown or expired request, wrong
  engine id, bad range) comes without layer frames. Frames are sent and received without
  copies (`copy=False`, `recv_into` a preallocated tensor).

A reply is checked whole before its KV is used: the xfer id (by the puller), the layer
names, the shape, the dtype and every layer's checksum. `KVLoadError` is a bad reply read
whole (the socket stays usable); `PullError`, a subclass, is a broken connection (the
socket is closed).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import zmq

from pagedinfer.distributed.kv_transfer.storage import KVLoadError, kv_checksum

__all__ = [
    "DTYPES",
    "ENCODER",
    "PullError",
    "PullReply",
    "PullRequest",
    "REPLY_DECODER",
    "REQUEST_DECODER",
    "check_reply",
    "discard_rest",
    "error_reply",
    "kv_reply",
    "receive_layers",
    "tcp_address",
]

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


class PullRequest(msgspec.Struct, frozen=True):
    """Decode -> prefill: send tokens `[start, start + num_tokens)` of a held request."""

    xfer_id: int
    engine_id: str
    request_id: str
    start: int
    num_tokens: int
    prompt_hash: str


class PullReply(msgspec.Struct):
    """Prefill -> decode, followed by one raw frame per layer unless `error` is set."""

    xfer_id: int
    error: str = ""
    layer_names: list[str] = []
    shape: list[int] = []
    dtype: str = ""
    checksums: list[str] = []


ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODER = msgspec.msgpack.Decoder(PullRequest)
REPLY_DECODER = msgspec.msgpack.Decoder(PullReply)


class PullError(KVLoadError):
    """The connection failed: the peer's socket is not reused."""


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def discard_rest(sock: zmq.Socket) -> None:
    """Skip the remaining frames of the current message."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv_into(bytearray())


def error_reply(xfer_id: int, message: str) -> list[Any]:
    """The frames of a refused pull (a header only)."""
    return [ENCODER.encode(PullReply(xfer_id, message))]


def kv_reply(xfer_id: int, dtype: torch.dtype | None, layers: dict[str, torch.Tensor]) -> list[Any]:
    """The frames of a served pull: the header, then each layer's bytes (no copy).
    `layers`: per layer name, the CPU `[2, n, kv_heads, head_dim]` KV, all of one shape;
    empty for a pull of 0 tokens (which still names the producer's cache dtype)."""
    names, buffers, checksums = [], [], []
    shape: list[int] = []
    for name, kv in layers.items():
        names.append(name)
        checksums.append(kv_checksum(kv))
        buffers.append(kv.view(torch.uint8).numpy())
        shape = list(kv.shape)
    header = PullReply(
        xfer_id,
        layer_names=names,
        shape=shape,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
        checksums=checksums,
    )
    return [ENCODER.encode(header), *buffers]


def check_reply(header: PullReply, num_tokens: int, kv_caches: dict[str, torch.Tensor]) -> None:
    """Raises KVLoadError unless the header announces `num_tokens` tokens of every layer of
    this model, in a dtype we can read."""
    if header.dtype not in DTYPES:
        raise KVLoadError(f"unsupported KV dtype {header.dtype!r}")
    if sorted(header.layer_names) != sorted(kv_caches):
        raise KVLoadError(
            f"the producer sent layers {header.layer_names}, this model has {list(kv_caches)}"
        )
    if len(header.checksums) != len(header.layer_names):
        raise KVLoadError("one checksum per layer expected")
    kv_cache = next(iter(kv_caches.values()))
    expected = [2, num_tokens, *kv_cache.shape[-2:]]
    if list(header.shape) != expected:
        raise KVLoadError(f"the producer sent KV of shape {header.shape}, not {expected}")


def receive_layers(
    sock: zmq.Socket, address: str, header: PullReply, kv_caches: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], int]:
    """The layer frames that follow a checked `header` on `sock`, each verified by its
    checksum and converted to its local cache's dtype, and the bytes received."""
    dtype = DTYPES[header.dtype]
    shape = tuple(header.shape)
    num_bytes = 0
    layers: dict[str, torch.Tensor] = {}
    for name, checksum in zip(header.layer_names, header.checksums, strict=True):
        if not sock.getsockopt(zmq.RCVMORE):
            raise PullError(f"{address}: the reply stops before layer {name}")
        raw = torch.empty(shape, dtype=dtype)  # [2, n, kv_heads, head_dim]
        buffer = raw.view(torch.uint8).numpy().reshape(-1)
        size = sock.recv_into(buffer.data)  # a writable memoryview of `raw`
        if size != buffer.nbytes:
            raise KVLoadError(f"{name}: {size} bytes received, {buffer.nbytes} expected")
        if kv_checksum(raw) != checksum:
            raise KVLoadError(f"{name}: checksum mismatch")
        num_bytes += size
        local_dtype = kv_caches[name].dtype
        layers[name] = raw if raw.dtype == local_dtype else raw.to(local_dtype)
    return layers, num_bytes
