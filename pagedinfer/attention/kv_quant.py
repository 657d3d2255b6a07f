"""The int8 KV cache: rows of int8 codes with their own scale, in the cache's block layout.

`kv_cache_dtype="int8"` stores each (token, kv head) row of K and of V as head_dim int8 codes
followed by that row's float32 scale (4 bytes), so a layer's cache is one int8 tensor
[2, num_blocks, block_size, num_kv_heads, head_dim + 4] and everything that moves blocks
(prefix caching, the KV connectors, the block table) moves rows as before. Symmetric, per
row: scale = max |x| / 127, code = round(x * 127 / max |x|) (halves to even), x ~ code * scale;
an all-zero row has scale 0. A float32 row of 64 values (256 bytes) becomes 68 bytes, a
bfloat16 one (128) the same 68: 3.8x / 1.9x the tokens in the same memory, and that many
fewer bytes for decode attention to read.

Why per row and symmetric: a row's scale follows that token's magnitude (keys differ
widely from token to token; one scale per tensor, as vLLM's fp8 cache has, needs
calibration we cannot do for the random-weight checkpoints), and int8 keeps 7 bits of
mantissa against fp8 e4m3's 3. The C++ kernels (kernels/csrc/paged_attention_cpu.cpp)
quantise with the same float32 arithmetic, so both writers store the same bytes, and read
the codes in place, folding the scale into the score and into the softmax weight.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_SCALE_BYTES",
    "cache_row_dim",
    "dequantize_rows",
    "is_quantized_cache",
    "quantize_rows",
    "read_rows",
    "resolve_kv_cache_dtype",
]

KV_SCALE_BYTES = 4
"""The float32 scale after each int8 row's codes."""


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `CacheConfig.kv_cache_dtype`: "auto" (the model's dtype)
    or "int8"."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype {name!r} is not supported: use 'auto' or 'int8'")


def cache_row_dim(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row in a cache of this dtype."""
    return head_dim + KV_SCALE_BYTES if cache_dtype == torch.int8 else head_dim


def is_quantized_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float rows -> int8 [..., head_dim + 4]: codes, then the scale's bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # A true division (`127.0 / amax` would be torch's reciprocal-then-multiply, an ulp
    # off at times): the C++ writer divides the same way and must store the same codes.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv).to(torch.int8)
    scale = (amax / 127.0).contiguous()
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim + 4] -> [..., head_dim] in `dtype` (code * scale, in float32)."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def read_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at `slots` (a gather of [num_slots, kv_heads, row]), as `dtype` values."""
    rows = cache[slots]
    return dequantize_rows(rows, dtype) if is_quantized_cache(cache) else rows.to(dtype)
