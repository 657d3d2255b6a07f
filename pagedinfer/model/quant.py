"""The GGUF file's own quantised matrices, repacked for the decode kernels.

A Q4_0/Q4_1 or Q8_0 matrix is stored as groups of 32 inputs with one float16 scale (and,
for Q4_1, an offset) per group. `QuantizedWeight` keeps exactly those values, in the "x16"
layout of `kernels/csrc/quant_linear_cpu.cpp` (one 64-byte vector holds 4 inputs of 16
output features), and multiplies with `q4_linear` / `q8_linear` from the C++ extension.
Steps with few rows use it: they read 5 (Q4) or 8.5 (Q8) bits per weight instead of 16
(bf16) or 32 (fp32). Scales and offsets stay the file's float16 values.

The formats with 5- or 6-bit codes or 256-input super-blocks (Q5_0, Q4_K, Q5_K, Q6_K: what
a Q4_K_M file mixes) are kept as the file's raw blocks (`RawBlocks`) and repacked into the
"planes" layout of `kernels/csrc/kquant_linear_cpu.cpp` (codes split into a 4-bit plane and
a high-bit plane, the super-block's scales beside them), multiplied by `kquant_linear`.

Matrices the file does not store quantised (a Hugging Face directory, an F16 LM head) can
be quantised to Q8_0 here (`quantize_q8_0`), the format llama.cpp uses for such tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "GROUP_SIZE",
    "ACTIVATION_MODES",
    "RAW_FORMATS",
    "QuantBlocks",
    "QuantMatrix",
    "QuantizedParts",
    "QuantizedWeight",
    "RawBlocks",
    "concat_blocks",
    "quantize_q8_0",
]

GROUP_SIZE = 32
_LANES = 16  # output features per kernel block


@dataclass
class QuantBlocks:
    """A quantised matrix as the file stores it, unpacked per row.

    - "Q4": `codes` uint8 [rows, cols / 2] in GGUF's byte order (per group of 32, byte t
      holds input t in its low nibble and input 16 + t in its high one); weight =
      `scale` * q + `offset` with `scale`/`offset` float32 [rows, cols / 32]
      (Q4_0: offset = -8 * scale, exact in float32).
    - "Q8": `codes` int8 [rows, cols]; weight = `scale` * q; `offset` is None.
    """

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.scale.shape[1]) * GROUP_SIZE

    def take_rows(self, order: np.ndarray) -> QuantBlocks:
        """The same matrix with its rows reordered (llama.cpp's Q/K permutation)."""
        return QuantBlocks(
            self.kind,
            self.codes[order],
            self.scale[order],
            None if self.offset is None else self.offset[order],
        )

    def take_cols(self, start: int, end: int) -> QuantBlocks:
        """Input features [start, end) (whole groups of 32: a row-parallel shard)."""
        if start % GROUP_SIZE or end % GROUP_SIZE:
            raise ValueError(f"columns [{start}, {end}) do not fall on groups of {GROUP_SIZE}")
        g0, g1 = start // GROUP_SIZE, end // GROUP_SIZE
        per_group = self.codes.shape[1] // self.scale.shape[1]  # code bytes per group
        return QuantBlocks(
            self.kind,
            np.ascontiguousarray(self.codes[:, g0 * per_group : g1 * per_group]),
            np.ascontiguousarray(self.scale[:, g0:g1]),
            None if self.offset is None else np.ascontiguousarray(self.offset[:, g0:g1]),
        )

    @staticmethod
    def concat(parts: Sequence[QuantBlocks]) -> QuantBlocks | None:
        """Row-wise concatenation (fused q/k/v, gate/up); None if the parts' formats differ."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.cols for p in parts}) != 1:
            return None
        offsets = [p.offset for p in parts]
        return QuantBlocks(
            parts[0].kind,
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scale for p in parts]),
            None if offsets[0] is None else np.concatenate(offsets),  # type: ignore[arg-type]
        )

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: the weights these blocks stand for (tests, reference)."""
        rows, groups = self.scale.shape
        if self.kind == "Q4":
            packed = self.codes.reshape(rows, groups, 16)
            q = np.concatenate([packed & 0x0F, packed >> 4], axis=2).astype(np.float32)
            w = q * self.scale[..., None] + self.offset[..., None]  # type: ignore[index]
        else:
            w = self.codes.reshape(rows, groups, GROUP_SIZE).astype(np.float32)
            w = w * self.scale[..., None]
        return w.reshape(rows, groups * GROUP_SIZE)


@dataclass(frozen=True)
class _RawFormat:
    """A GGUF block format the planes kernel takes (`kquant_linear_cpu.cpp`'s Fmt* structs)."""

    type_id: int  # GGUF type id, the kernel's format argument
    block_size: int  # inputs per block (the kernel's super-block)
    type_size: int  # bytes per block
    sub: int  # inputs per sub-block (one scale)
    bits: int
    mins: bool  # a dmin and per-sub-block mins (Q4_K, Q5_K)


RAW_FORMATS: dict[str, _RawFormat] = {
    "Q5_0": _RawFormat(6, 32, 22, 32, 5, False),
    "Q4_K": _RawFormat(12, 256, 144, 32, 4, True),
    "Q5_K": _RawFormat(13, 256, 176, 32, 5, True),
    "Q6_K": _RawFormat(14, 256, 210, 16, 6, False),
}


@dataclass
class RawBlocks:
    """A matrix in one of `RAW_FORMATS`, as the file's own bytes: `data` uint8
    [rows, cols / block_size, type_size] (GGUF's block structs, row by row)."""

    kind: str
    data: np.ndarray

    @property
    def format(self) -> _RawFormat:
        return RAW_FORMATS[self.kind]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def cols(self) -> int:
        return int(self.data.shape[1]) * self.format.block_size

    def take_rows(self, order: np.ndarray) -> RawBlocks:
        return RawBlocks(self.kind, self.data[order])

    def take_cols(self, start: int, end: int) -> RawBlocks:
        """Input features [start, end) (whole blocks: a row-parallel shard)."""
        size = self.format.block_size
        if start % size or end % size:
            raise ValueError(
                f"columns [{start}, {end}) do not fall on {self.kind} blocks of {size}"
            )
        return RawBlocks(self.kind, np.ascontiguousarray(self.data[:, start // size : end // size]))

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols] (the file reader's dequantisation)."""
        from pagedinfer.model.gguf import dequantize  # gguf.py imports this module

        flat = dequantize(self.data.reshape(-1), self.format.type_id, self.rows * self.cols)
        return flat.reshape(self.rows, self.cols)

    def unpack(
        self,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
        """The blocks' fields as the kernel sees them, per row and block:
        codes uint8 [rows, blocks, block_size] (unsigned, `bits` wide), d and dmin float16
        [rows, blocks], sub-block scales [rows, blocks, sub-blocks] (uint8; int8 for Q6_K;
        Q5_0: all 1) and mins (uint8, or None)."""
        raw = self.data
        rows, nb = raw.shape[:2]

        def half(at: int) -> np.ndarray:
            return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0]

        if self.kind == "Q5_0":  # f16 d, u32 qh, 16 bytes of nibbles (value t low, 16 + t high)
            qh = np.ascontiguousarray(raw[..., 2:6]).view("<u4")  # [rows, nb, 1]
            qs = raw[..., 6:22]
            low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
            high = (qh >> np.arange(32, dtype=np.uint32)) & 1
            codes = low | (high.astype(np.uint8) << 4)
            return codes, half(0), None, np.ones((rows, nb, 1), np.uint8), None
        if self.kind in ("Q4_K", "Q5_K"):
            from pagedinfer.model.gguf import k_scales_mins

            sc, mn = k_scales_mins(raw[..., 4:16].reshape(-1, 12))
            qs = raw[..., -128:].reshape(rows, nb, 4, 1, 32)  # sub-block 2c low, 2c + 1 high
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb, 256)
            if self.kind == "Q5_K":  # bit k of qh[l]: bit 4 of value l of sub-block k
                qh = raw[..., 16:48].reshape(rows, nb, 1, 32)
                shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
                codes |= (((qh >> shifts) & 1) << 4).reshape(rows, nb, 256)
            shape = (rows, nb, 8)
            return (codes, half(0), half(2), sc.astype(np.uint8).reshape(shape),
                    mn.astype(np.uint8).reshape(shape))  # fmt: skip
        # Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d. Value 128h + 32k + l: low
        # nibble of ql[64h + 32 (k % 2) + l] (the high nibble for k >= 2), bits 4-5 from
        # (qh[32h + l] >> 2k) & 3.
        ql = raw[..., :128].reshape(rows, nb, 2, 2, 32)
        qh = raw[..., 128:192].reshape(rows, nb, 2, 1, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [rows, nb, half, 4, 32]
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
        codes = (low | (((qh >> shifts) & 3) << 4)).reshape(rows, nb, 256)
        scales = np.ascontiguousarray(raw[..., 192:208]).view(np.int8)
        return codes, half(208), None, scales, None


QuantMatrix = QuantBlocks | RawBlocks

# How `QuantizedWeight` multiplies activations (`ModelConfig.quant_activations`): "float32"
# exact float products; "int8" rounded to int8 per group of 32 where the CPU has an integer
# dot product (AVX512-VNNI or AVX2; Q5_0 and the K-quants: AVX2), every format; "auto"
# int8 for 16-bit activations, float32 for float32 ones (float32 models keep parity with the
# dense path).
ACTIVATION_MODES = ("auto", "float32", "int8")


def concat_blocks(parts: Sequence[QuantMatrix]) -> QuantMatrix | None:
    """Row-wise concatenation (fused q/k/v, gate/up); None if the parts' formats differ."""
    if isinstance(parts[0], RawBlocks):
        kind = parts[0].kind
        if not all(isinstance(p, RawBlocks) and p.kind == kind for p in parts):
            return None
        if len({p.cols for p in parts}) != 1:
            return None
        return RawBlocks(kind, np.concatenate([p.data for p in parts]))  # type: ignore[union-attr]
    if not all(isinstance(p, QuantBlocks) for p in parts):
        return None
    return QuantBlocks.concat(parts)  # type: ignore[arg-type]


def _pack_planes(blocks: RawBlocks) -> np.ndarray:
    """uint8 [feature blocks of 16, cols / block_size, record bytes]: `blocks` in the planes
    layout of `kquant_linear_cpu.cpp`."""
    fmt = blocks.format
    codes, d, dmin, scales, mins = blocks.unpack()
    rows, nb, size = codes.shape
    num_blocks = -(-rows // _LANES)
    pad = num_blocks * _LANES - rows

    def lanes(a: np.ndarray) -> np.ndarray:  # [rows, nb, ...] -> [blocks, nb, ..., 16]
        if pad:
            a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        a = a.reshape(num_blocks, _LANES, *a.shape[1:])
        return np.moveaxis(a, 1, -1)

    def words(plane: np.ndarray) -> np.ndarray:  # bytes [rows, nb, 4 n] -> [blocks, nb, n * 64]
        w = lanes(plane.reshape(rows, nb, -1, 4))  # [blocks, nb, n, 4, 16]
        return np.swapaxes(w, -1, -2).reshape(num_blocks, nb, -1)

    low = codes & 0x0F
    parts = [words(low[..., 0::2] | (low[..., 1::2] << 4))]  # code 8w + k: nibble k of word w
    if fmt.bits == 5:  # bit 4 of code 32v + 8m + 2t + e: bit 8t + 2m + e of word v
        h = (codes >> 4).reshape(rows, nb, size // 32, 4, 4, 2).swapaxes(-3, -2)  # [.., t, m, e]
        parts.append(words(np.packbits(h.reshape(rows, nb, size), axis=-1, bitorder="little")))
    elif fmt.bits == 6:  # bits 4-5 of code 16v + 8m + 2t + e: bits 8t + 4m + 2e, +1 of word v
        h = (codes >> 4).reshape(rows, nb, size // 16, 2, 4, 2).swapaxes(-3, -2)  # [.., t, m, e]
        h = h.reshape(rows, nb, size // 4, 4)
        parts.append(words(h[..., 0] | (h[..., 1] << 2) | (h[..., 2] << 4) | (h[..., 3] << 6)))
    for half in (d, dmin):
        if half is not None:
            parts.append(np.ascontiguousarray(lanes(half)).view(np.uint8))
    if fmt.block_size != fmt.sub:  # per-sub-block scales (and mins), [sub-blocks, 16] bytes
        for values in (scales, mins):
            if values is not None:
                parts.append(lanes(values.view(np.uint8)).reshape(num_blocks, nb, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def quantize_q8_0(weight: torch.Tensor) -> QuantBlocks:
    """Q8_0 blocks of a dense [rows, cols] matrix, as llama.cpp makes them: per group of 32,
    scale = max|w| / 127 rounded to float16, q = round(w / scale)."""
    w = weight.detach().float().cpu().numpy()
    rows, cols = w.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"Q8_0 needs a multiple of {GROUP_SIZE} columns, got {cols}")
    groups = w.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    scale = (np.abs(groups).max(axis=2) / 127.0).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint(groups * inv[..., None]), -127, 127).astype(np.int8)
    return QuantBlocks("Q8", codes.reshape(rows, cols), scale, None)


class QuantizedWeight:
    """A [out_features, in_features] matrix packed for the C++ kernels.

    - Q4/Q8 (`QuantBlocks`), for `quant_linear`, "x16" layout: uint8 [feature blocks of 16,
      groups of 32 inputs, record bytes], where a Q4 record is the 16 features' codes (256
      bytes) then their float16 scales and offsets, a Q8 record the codes (512 bytes) then
      the scales. See `kernels/csrc/quant_linear_cpu.cpp`.
    - Q5_0/Q4_K/Q5_K/Q6_K (`RawBlocks`), for `kquant_linear`, "planes" layout: uint8
      [feature blocks of 16, file blocks per row, record bytes]. See
      `kernels/csrc/kquant_linear_cpu.cpp`.
    """

    def __init__(self, blocks: QuantMatrix, kernels: Any, activations: str = "auto") -> None:
        if activations not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
        self.activations = activations
        self.kind = blocks.kind
        self.out_features = blocks.rows
        self.in_features = blocks.cols
        self._kernels = kernels
        if isinstance(blocks, RawBlocks):
            self._format = blocks.format.type_id
            self._fn = kernels.kquant_linear
            self.packed = torch.from_numpy(_pack_planes(blocks))
            expected = kernels.kquant_record_bytes(self._format)
            if self.packed.shape[2] != expected:  # the two sides of the layout disagree
                raise AssertionError(
                    f"{blocks.kind} record of {self.packed.shape[2]} bytes, kernel: {expected}"
                )
            return
        if blocks.kind not in ("Q4", "Q8"):
            raise ValueError(f"unknown quantised format {blocks.kind!r}")
        self._format = 4 if blocks.kind == "Q4" else 8
        self._fn = kernels.quant_linear
        num_blocks = -(-blocks.rows // _LANES)
        pad = num_blocks * _LANES - blocks.rows
        groups = blocks.cols // GROUP_SIZE

        def per_block(a: np.ndarray) -> np.ndarray:  # [rows, ...] -> [blocks, 16, ...]
            if pad:
                a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
            return a.reshape(num_blocks, _LANES, *a.shape[1:])

        # codes [rows, groups, vectors, 4 bytes] -> [blocks, groups, vectors, 16 lanes, 4]
        vectors = 4 if self.kind == "Q4" else 8
        codes = per_block(blocks.codes.view(np.uint8).reshape(blocks.rows, groups, vectors, 4))
        parts = [codes.transpose(0, 2, 3, 1, 4).reshape(num_blocks, groups, vectors * 64)]
        for values in (blocks.scale, blocks.offset):
            if values is not None:  # [rows, groups] -> float16 bytes [blocks, groups, 32]
                half = per_block(values.astype(np.float16)).transpose(0, 2, 1)
                parts.append(np.ascontiguousarray(half).view(np.uint8))
        self.packed = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)))

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in_features] -> [rows, out_features] in x's dtype."""
        x = x.contiguous()
        int8 = self.activations == "int8" or (
            self.activations == "auto" and x.dtype != torch.float32
        )
        return self._fn(x, self.packed, self._format, self.out_features, int8)


class QuantizedParts:
    """A fused projection whose parts the file stores in different formats (Gemma 3's q/k
    in Q5_0 and v in Q8_0, say): each part's kernel, outputs side by side. Same interface
    as `QuantizedWeight`."""

    def __init__(self, parts: Sequence[QuantizedWeight]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("fused parts must share in_features")
        self.parts = list(parts)
        self.kind = "+".join(p.kind for p in parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        return torch.cat([p(x) for p in self.parts], dim=1)
