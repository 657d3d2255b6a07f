"""A linear layer (optionally with a bias) with a quantised fast path for small steps.

Decode of a small batch is bound by reading the weights: 269 MB per token in bf16, 538 MB
in fp32. A GGUF file already stores the matrices as 4- to 8-bit codes with scales per group
of inputs, so steps with few rows multiply by the file's own blocks
(`model/quant.QuantizedWeight`, C++ kernels in `kernels/csrc/quant_linear_cpu.cpp` and
`kquant_linear_cpu.cpp`), reading ~4.5-8.5 bits per weight; the dense matrix (the same
values, dequantised) serves larger steps, where a dense GEMM is compute-bound and faster.
Where the quantised kernels take every step the engine schedules (int8 activations with
AVX-512 VNNI or AVX2: `worker.default_quant_max_tokens`), the dense matrix is never read,
and the layer holds none (`set_quant(keep_dense=False)`): 16 bits per weight saved beside
the file's 4.5-8.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.model.quant import QuantizedParts, QuantizedWeight

__all__ = ["Linear"]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.quant: QuantizedWeight | QuantizedParts | None = None
        self.quant_max_rows = 0

    def set_quant(
        self, quant: QuantizedWeight | QuantizedParts, max_rows: int, keep_dense: bool = True
    ) -> None:
        """Use `quant` (the same matrix, quantised) for inputs of <= max_rows rows;
        `keep_dense=False`: for every input, and drop the dense weight (a module on the
        meta device gets none loaded: `model/weights.install_weights`)."""
        if (quant.out_features, quant.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantised weight of shape {(quant.out_features, quant.in_features)} for a "
                f"{(self.out_features, self.in_features)} layer"
            )
        self.quant = quant
        self.quant_max_rows = max_rows
        if not keep_dense:
            self.weight = None

    def prepack(self, batch_hint: int) -> bool:
        """Replace the dense weight by oneDNN's blocked layout for this CPU.

        `F.linear` hands oneDNN a plain row-major weight, which it reorders for its AMX /
        AVX-512 kernels on every call; at decode batch sizes that reorder (of a weight cold
        in cache) costs as much as the product. Reordering once at load removes it (same
        values, same results: the unit tests compare bit for bit). The weight stays a
        parameter (an opaque mkldnn tensor of the same size), so memory does not grow.
        """
        if self.weight is None or self.weight.is_mkldnn or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, batch_hint)
        except (RuntimeError, AttributeError):  # a torch build without these ops
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and (x.shape[0] <= self.quant_max_rows or self.weight is None):
            out = self.quant(x)
            return out if self.bias is None else out.add_(self.bias)
        assert self.weight is not None
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
