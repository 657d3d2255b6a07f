"""The GGUF file's own quantised matrices, repacked for the decode kernels.

A Q4_0/Q4_1 or Q8_0 matrix is stored as groups of 32 inputs with one float16 scale (and,
for Q4_1, an offset) per group. `QuantizedWeight` keeps exactly those values, in the "x16"
layout of `kernels/csrc/quant_linear_cpu.cpp` (one 64-byte vector holds 4 inputs of 16
output features), and multiplies with `q4_linear` / `q8_linear` from the C++ extension.
Steps with few rows use it: they read 5 (Q4) or 8.5 (Q8) bits per weight instead of 16
(bf16) or 32 (fp32). Scales and offsets stay the file's float16 values.

Matrices the file does not store quantised (a Hugging Face directory, an F16 LM head) can
be quantised to Q8_0 here (`quantize_q8_0`), the format llama.cpp uses for such tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["GROUP_SIZE", "QuantizedWeight", "QuantBlocks", "quantize_q8_0"]

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
    """A [out_features, in_features] matrix packed for `quant_linear` (C++), "x16" layout:
    uint8 [feature blocks of 16, groups of 32 inputs, record bytes], where a Q4 record is
    the 16 features' codes (256 bytes) then their float16 scales and offsets, a Q8 record
    the codes (512 bytes) then the scales. See `kernels/csrc/quant_linear_cpu.cpp`."""

    def __init__(self, blocks: QuantBlocks, kernels: Any) -> None:
        if blocks.kind not in ("Q4", "Q8"):
            raise ValueError(f"unknown quantised format {blocks.kind!r}")
        self.kind = blocks.kind
        self.out_features = blocks.rows
        self.in_features = blocks.cols
        self._kernels = kernels
        self._format = 4 if blocks.kind == "Q4" else 8
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
        return self._kernels.quant_linear(x, self.packed, self._format, self.out_features)
