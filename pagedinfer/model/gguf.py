"""A small GGUF (v2/v3) reader with vectorised numpy dequantisation.

Role: parse a GGUF file's header, metadata key/values and tensor table, and hand out tensors as
dequantised float32 numpy arrays. Written from the GGUF specification (ggml `docs/gguf.md`); the
`gguf` pip package is not used at runtime.

File layout (little-endian)::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32) | tensor data (each tensor at data_start + offset)

where a string is `u64 length + UTF-8 bytes` and an array is `u32 item_type, u64 count, items`.

Invariants:
- The file is opened once as a read-only `np.memmap`; nothing is read eagerly except the header.
- ggml lists dims innermost first (`ne[0]` = columns). We expose torch order (reversed), so a
  weight of `ne = [in, out]` has `tensor_shape == (out, in)`, matching `nn.Linear.weight`.
- `load_tensor` always returns a fresh, writable float32 array; it never aliases the memmap.
- Quantised blocks run along `ne[0]`, so flat dequantisation then reshape is exact.

The header and metadata are parsed by `pagedinfer.gguf_metadata` (shared with the tokenizer,
which needs no tensors); this module adds the tensor table and dequantisation.

Callers: `pagedinfer.model.loader` (weights and config; the tokenizer is built from the same
`GGUFFile`'s metadata).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedinfer.gguf_metadata import DEFAULT_ALIGNMENT, read_header
from pagedinfer.model.quant import RAW_FORMATS, QuantBlocks, QuantMatrix, RawBlocks

__all__ = [
    "GGML_TYPE_NAMES",
    "GGUFFile",
    "GGUFTensorInfo",
    "dequantize",
]

# GGML tensor types by id. Only some are dequantisable here; the names exist so that an
# unsupported tensor produces an error that says what it is.
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Dequantisation. Each function maps raw bytes of whole blocks to a flat float32 array.
# --------------------------------------------------------------------------------------------

_F16 = "<f2"


def _blocks(raw: np.ndarray, fields: list[tuple[Any, ...]]) -> np.ndarray:
    """View raw bytes as an array of packed block structs (zero-copy)."""
    return raw.view(np.dtype(fields))


def _deq_q8_0(raw: np.ndarray) -> np.ndarray:
    # block: f16 d, 32 x int8 q; value = d * q
    blk = _blocks(raw, [("d", _F16), ("qs", "i1", (32,))])
    out = blk["qs"].astype(np.float32)  # [num_blocks, 32]
    out *= blk["d"].astype(np.float32)[:, None]
    return out.reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Unpack [num_blocks, 16] bytes into [num_blocks, 32] float32: low nibbles then high."""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _deq_q4_0(raw: np.ndarray) -> np.ndarray:
    # block: f16 d, 16 bytes of nibbles; value = d * (q - 8)
    blk = _blocks(raw, [("d", _F16), ("qs", "u1", (16,))])
    out = _nibbles(blk["qs"])  # [num_blocks, 32]
    out -= 8.0
    out *= blk["d"].astype(np.float32)[:, None]
    return out.reshape(-1)


def _deq_q4_1(raw: np.ndarray) -> np.ndarray:
    # block: f16 d, f16 m, 16 bytes of nibbles; value = d * q + m
    blk = _blocks(raw, [("d", _F16), ("m", _F16), ("qs", "u1", (16,))])
    out = _nibbles(blk["qs"])  # [num_blocks, 32]
    out *= blk["d"].astype(np.float32)[:, None]
    out += blk["m"].astype(np.float32)[:, None]
    return out.reshape(-1)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values: nibbles from `qs`, bit 4 of element j is bit j of the u32 `qh`."""
    out = _nibbles(qs)  # [num_blocks, 32]
    high = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # [num_blocks, 32]
    out += (high * 16).astype(np.float32)
    return out


def _deq_q5_0(raw: np.ndarray) -> np.ndarray:
    # block: f16 d, u32 qh, 16 bytes of nibbles; value = d * (q - 16)
    blk = _blocks(raw, [("d", _F16), ("qh", "<u4"), ("qs", "u1", (16,))])
    out = _q5_values(blk["qh"], blk["qs"])
    out -= 16.0
    out *= blk["d"].astype(np.float32)[:, None]
    return out.reshape(-1)


def _deq_q5_1(raw: np.ndarray) -> np.ndarray:
    # block: f16 d, f16 m, u32 qh, 16 bytes of nibbles; value = d * q + m
    blk = _blocks(raw, [("d", _F16), ("m", _F16), ("qh", "<u4"), ("qs", "u1", (16,))])
    out = _q5_values(blk["qh"], blk["qs"])
    out *= blk["d"].astype(np.float32)[:, None]
    out += blk["m"].astype(np.float32)[:, None]
    return out.reshape(-1)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte field of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; sub-blocks 4-7 take their low
    4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
    """
    s = scales.astype(np.uint8)  # [num_blocks, 12]
    sc = np.empty((s.shape[0], 8), dtype=np.float32)
    mn = np.empty((s.shape[0], 8), dtype=np.float32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[num_blocks, 128] bytes -> [num_blocks, 8, 32]: 4 groups of 32 bytes, low then high."""
    q = qs.reshape(qs.shape[0], 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(qs.shape[0], 8, 32)


def _deq_q4_k(raw: np.ndarray) -> np.ndarray:
    # super-block of 256: f16 d, f16 dmin, 12 bytes packed scales/mins, 128 bytes nibbles;
    # sub-block k (32 values): value = d * scale_k * q - dmin * min_k
    blk = _blocks(raw, [("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
    sc, mn = k_scales_mins(blk["scales"])  # [num_blocks, 8] each
    q = _k_nibbles(blk["qs"]).astype(np.float32)  # [num_blocks, 8, 32]
    q *= (blk["d"].astype(np.float32)[:, None] * sc)[:, :, None]
    q -= (blk["dmin"].astype(np.float32)[:, None] * mn)[:, :, None]
    return q.reshape(-1)


def _deq_q5_k(raw: np.ndarray) -> np.ndarray:
    # like Q4_K plus 32 bytes qh: bit k of qh[l] is bit 4 of value l of sub-block k
    blk = _blocks(
        raw,
        [("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
         ("qs", "u1", (128,))],
    )  # fmt: skip
    sc, mn = k_scales_mins(blk["scales"])
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    high = (blk["qh"][:, None, :] >> shifts) & 1  # [num_blocks, 8, 32]
    q = (_k_nibbles(blk["qs"]) | (high << 4)).astype(np.float32)  # [num_blocks, 8, 32]
    q *= (blk["d"].astype(np.float32)[:, None] * sc)[:, :, None]
    q -= (blk["dmin"].astype(np.float32)[:, None] * mn)[:, :, None]
    return q.reshape(-1)


def _deq_q6_k(raw: np.ndarray) -> np.ndarray:
    # super-block of 256: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, f16 d.
    # Two halves of 128 values; in half h, quarter k (32 values): low nibble from
    # ql[64h + 32*(k%2) + l] (low nibble for k<2, high for k>=2), high bits (qh[32h+l] >> 2k) & 3.
    # Value e of the block uses scale e // 16; value = d * scale * (q - 32).
    blk = _blocks(
        raw, [("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", _F16)]
    )
    nb = blk.shape[0]
    ql = blk["ql"].reshape(nb, 2, 2, 32)  # [num_blocks, half, k%2, 32]
    qh = blk["qh"].reshape(nb, 2, 1, 32)  # [num_blocks, half, 1, 32]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [num_blocks, half, 4, 32]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    q = (low | (((qh >> shifts) & 3) << 4)).astype(np.float32).reshape(nb, 16, 16)
    q -= 32.0
    q *= (blk["d"].astype(np.float32)[:, None] * blk["scales"].astype(np.float32))[:, :, None]
    return q.reshape(-1)


def _deq_bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _plain(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    def convert(raw: np.ndarray) -> np.ndarray:
        return raw.view(dtype).astype(np.float32)  # astype always copies

    return convert


@dataclass(frozen=True, slots=True)
class _TypeTraits:
    block_size: int  # elements per block
    type_size: int  # bytes per block
    dequant: Callable[[np.ndarray], np.ndarray]


_TRAITS: dict[int, _TypeTraits] = {
    0: _TypeTraits(1, 4, _plain("<f4")),
    1: _TypeTraits(1, 2, _plain("<f2")),
    2: _TypeTraits(32, 18, _deq_q4_0),
    3: _TypeTraits(32, 20, _deq_q4_1),
    6: _TypeTraits(32, 22, _deq_q5_0),
    7: _TypeTraits(32, 24, _deq_q5_1),
    8: _TypeTraits(32, 34, _deq_q8_0),
    12: _TypeTraits(256, 144, _deq_q4_k),
    13: _TypeTraits(256, 176, _deq_q5_k),
    14: _TypeTraits(256, 210, _deq_q6_k),
    24: _TypeTraits(1, 1, _plain("<i1")),
    25: _TypeTraits(1, 2, _plain("<i2")),
    26: _TypeTraits(1, 4, _plain("<i4")),
    28: _TypeTraits(1, 8, _plain("<f8")),
    30: _TypeTraits(1, 2, _deq_bf16),
}


def _traits(ggml_type: int) -> _TypeTraits:
    traits = _TRAITS.get(ggml_type)
    if traits is None:
        name = GGML_TYPE_NAMES.get(ggml_type, f"unknown type id {ggml_type}")
        supported = ", ".join(GGML_TYPE_NAMES[t] for t in _TRAITS)
        raise ValueError(
            f"GGUF tensor type {name} is not supported by pagedinfer's reader "
            f"(supported: {supported})"
        )
    return traits


def dequantize(raw: np.ndarray, ggml_type: int, num_elements: int) -> np.ndarray:
    """Dequantise `raw` (uint8 bytes of whole blocks) of `ggml_type` into float32 [num_elements].

    Raises ValueError for unsupported types or a byte count that does not match.
    """
    traits = _traits(ggml_type)
    if num_elements % traits.block_size:
        raise ValueError(
            f"{GGML_TYPE_NAMES[ggml_type]}: {num_elements} elements is not a multiple of the "
            f"block size {traits.block_size}"
        )
    num_bytes = num_elements // traits.block_size * traits.type_size
    if raw.size != num_bytes:
        raise ValueError(f"expected {num_bytes} bytes for {num_elements} elements, got {raw.size}")
    # Every dequant function allocates its output, so the result never aliases `raw`.
    return traits.dequant(np.ascontiguousarray(raw, dtype=np.uint8))


# --------------------------------------------------------------------------------------------
# File parsing.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One entry of the tensor table; `shape` is in torch order (ggml dims reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.ggml_type, f"unknown({self.ggml_type})")


class GGUFFile:
    """A parsed GGUF file. Tensor data stays on disk (memmap) until `load_tensor`.

    Attributes:
        path: the file path.
        version: GGUF format version (2 or 3).
        metadata: every key/value of the file; arrays become Python lists.
        alignment: data alignment in bytes (`general.alignment`, default 32).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")  # [file_bytes]
        header = read_header(memoryview(self._data), self.path)
        cur = header.cursor
        self.version: int = header.version
        num_tensors = header.num_tensors
        self.metadata: dict[str, Any] = header.metadata
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment % 8:
            raise ValueError(f"invalid general.alignment {self.alignment}")

        raw_infos = []
        for _ in range(num_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            ne = [cur.unpack("<Q") for _ in range(n_dims)]
            raw_infos.append((name, ne, cur.unpack("<I"), cur.unpack("<Q")))
        data_start = -(-cur.pos // self.alignment) * self.alignment

        self._tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, ggml_type, rel_offset in raw_infos:
            num_elements = int(np.prod(ne, dtype=np.int64)) if ne else 1
            traits = _TRAITS.get(ggml_type)
            # Unsupported types still get an entry; the error comes when the tensor is loaded.
            num_bytes = (
                num_elements // traits.block_size * traits.type_size if traits is not None else -1
            )
            info = GGUFTensorInfo(
                name, tuple(reversed(ne)), ggml_type, data_start + rel_offset, num_bytes
            )
            if traits is not None and info.offset + num_bytes > self._data.size:
                raise ValueError(f"tensor {name!r} runs past the end of {self.path}")
            self._tensors[name] = info

    # ---- tensor table ------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._tensors)

    def tensor_info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None

    def tensor_type(self, name: str) -> str:
        """The ggml type name of a tensor, e.g. "Q4_1"."""
        return self.tensor_info(name).type_name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Torch-order shape: reversed ggml dims, e.g. (rows, cols) for a matrix."""
        return self.tensor_info(name).shape

    def load_tensor(self, name: str) -> np.ndarray:
        """Dequantise one tensor to a fresh float32 array of shape `tensor_shape(name)`."""
        info = self.tensor_info(name)
        _traits(info.ggml_type)  # raises the ValueError naming an unsupported type
        raw = self._data[info.offset : info.offset + info.num_bytes]  # [num_bytes] uint8
        flat = dequantize(np.asarray(raw), info.ggml_type, info.num_elements)  # [num_elements]
        return flat.reshape(info.shape)

    def load_tensor_rows(self, name: str, start: int, end: int) -> np.ndarray:
        """Rows [start, end) of a 2-D tensor, dequantised to float32 `[end - start, cols]`.
        A row is a whole number of blocks, so only those rows' bytes are read (a tensor
        parallel rank loads its shard, not the matrix)."""
        info = self.tensor_info(name)
        _traits(info.ggml_type)
        rows, cols = info.shape
        if not 0 <= start <= end <= rows:
            raise ValueError(f"{name}: rows [{start}, {end}) outside [0, {rows})")
        row_bytes = info.num_bytes // rows
        first = info.offset + start * row_bytes
        raw = self._data[first : first + (end - start) * row_bytes]  # [bytes] uint8
        flat = dequantize(np.asarray(raw), info.ggml_type, (end - start) * cols)
        return flat.reshape(end - start, cols)

    def load_quant_blocks(self, name: str) -> QuantMatrix | None:
        """A quantised matrix without dequantising: Q4_0, Q4_1 or Q8_0 as its codes and
        per-group scales (and offsets) (`model/quant.QuantBlocks`), Q5_0/Q4_K/Q5_K/Q6_K as
        the file's blocks (`model/quant.RawBlocks`); None for any other type."""
        info = self.tensor_info(name)
        type_name = info.type_name
        if len(info.shape) != 2:
            return None
        rows, cols = info.shape
        raw = np.asarray(self._data[info.offset : info.offset + info.num_bytes])
        if type_name in RAW_FORMATS:
            fmt = RAW_FORMATS[type_name]
            return RawBlocks(type_name, raw.reshape(rows, cols // fmt.block_size, fmt.type_size))
        if type_name not in ("Q4_0", "Q4_1", "Q8_0"):
            return None
        groups = cols // 32
        if type_name == "Q8_0":
            blk = _blocks(raw, [("d", _F16), ("qs", "i1", (32,))])
            return QuantBlocks(
                "Q8",
                np.ascontiguousarray(blk["qs"]).reshape(rows, cols),
                blk["d"].astype(np.float32).reshape(rows, groups),
                None,
            )
        fields: list[tuple[Any, ...]] = [("d", _F16)]
        if type_name == "Q4_1":
            fields.append(("m", _F16))
        fields.append(("qs", "u1", (16,)))
        blk = _blocks(raw, fields)
        scale = blk["d"].astype(np.float32)  # [num_blocks]
        # Q4_0 is d * (q - 8) = d * q + (-8 d); -8 d is exact in float32.
        offset = blk["m"].astype(np.float32) if type_name == "Q4_1" else -8.0 * scale
        return QuantBlocks(
            "Q4",
            np.ascontiguousarray(blk["qs"]).reshape(rows, cols // 2),
            scale.reshape(rows, groups),
            offset.reshape(rows, groups),
        )

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self._tensors)} tensors)"
