"""A bias-free linear layer with an optional 4-bit weight-only fast path for small batches.

Batch-1 decode is bound by reading the weights: 269 MB per token in bf16, 538 MB in fp32.
A GGUF Q4_0/Q4_1 matrix is already stored as 4-bit codes with one scale and offset per
group of 32 inputs, which is exactly the format of torch's int4 weight-only CPU kernel
(`aten._weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + zero). So the file's own weights,
not a re-quantisation, are used for steps with few rows, reading ~4.5 bits per weight; the
dense matrix (the same values, dequantised) serves large steps, where a dense bf16/fp32
GEMM is compute-bound and faster.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "INT4_GROUP_SIZE"]

INT4_GROUP_SIZE = 32


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.int4_weight: torch.Tensor | None = None
        self.int4_scales_zeros: torch.Tensor | None = None
        self.int4_max_rows = 0

    def set_int4(
        self,
        codes: np.ndarray,
        scale: np.ndarray,
        zero: np.ndarray,
        dtype: torch.dtype,
        max_rows: int,
    ) -> None:
        """Attach 4-bit codes [out, in] with per-group scale/zero [out, in / 32]."""
        if codes.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"int4 codes of shape {codes.shape} for a {tuple(self.weight.shape)} layer"
            )
        q = torch.from_numpy(codes.astype(np.int32))  # [out, in]
        self.int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = np.stack([scale, zero], axis=-1).transpose(1, 0, 2)  # [in / 32, out, 2]
        self.int4_scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(dtype)
        self.int4_max_rows = max_rows

    def prepack(self, batch_hint: int) -> bool:
        """Replace the dense weight by oneDNN's blocked layout for this CPU.

        `F.linear` hands oneDNN a plain row-major weight, which it reorders for its AMX /
        AVX-512 kernels on every call; at decode batch sizes that reorder (of a weight cold
        in cache) costs as much as the product. Reordering once at load removes it (same
        values, same results: the unit tests compare bit for bit). The weight stays a
        parameter (an opaque mkldnn tensor of the same size), so memory does not grow.
        """
        if self.weight.is_mkldnn or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)
        except (RuntimeError, AttributeError):  # a torch build without these ops
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4_weight is not None and x.shape[0] <= self.int4_max_rows:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.int4_weight, INT4_GROUP_SIZE, self.int4_scales_zeros
            )
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)
