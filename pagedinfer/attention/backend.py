"""Attention over a flattened batch with a paged KV cache: the backend interface.

One engine step is one forward pass over all scheduled tokens of all requests, laid end to
end with no padding (`num_actual_tokens`). Request r owns query rows
`[query_start_loc[r], query_start_loc[r + 1])` and attends to its first `seq_lens[r]` cached
tokens (`seq_lens = num_computed_tokens + num_scheduled_tokens`), causally, with the offset
`seq_lens[r] - query_len[r]`. A prefill, a prefill chunk over a cached prefix and a decode
are all that one case.

KV layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V), in
the model's dtype; an int8 cache (`kv_cache_dtype="int8"`, attention/kv_quant.py) has rows of
head_dim + 4: the codes, then the row's float32 scale.
Token at position p of request r lives in slot
`block_table[r, p // block_size] * block_size + p % block_size`; `slot_mapping` holds that
slot for every new token, and the backend writes the new K/V there before attending.

A layer may narrow what its queries see (`AttentionOptions`, passed with each call): a sliding
window (query at position i sees keys j with i - window < j <= i, Hugging Face's mask) and a
soft cap on the scores (Gemma 2). The KV cache keeps every position either way; the window
is a mask over it.

`CommonAttentionMetadata` is built once per step by the model runner; each backend turns it
into its own metadata with `build()` (also once per step), and every layer then calls
`forward()`. The per-step metadata reaches the layers through `ForwardContext`, a context
manager that refuses to nest, not through a global that is reassigned each step.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedinfer.attention.kv_quant import is_quantized_cache, quantize_rows

__all__ = [
    "FULL_ATTENTION",
    "AttentionBackend",
    "AttentionOptions",
    "CommonAttentionMetadata",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
    "write_kv_cache",
    "flat_kv_cache",
]


@dataclass
class CommonAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: exclusive cumulative sum of scheduled tokens per request."""
    query_start_loc_cpu: list[int]
    seq_lens: torch.Tensor
    """[num_reqs] int32: context length each request's query attends to (incl. itself)."""
    seq_lens_cpu: list[int]
    num_computed_tokens_cpu: list[int]
    """Tokens already in the cache before this step, per request."""
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks_per_req] int32 physical block ids (padded with 0)."""
    slot_mapping: torch.Tensor
    """[num_actual_tokens] int64 cache slot for each new token."""
    block_size: int


@dataclass(frozen=True)
class AttentionOptions:
    """What one layer's queries attend to, beyond causality; the default is plain causal
    attention. Set per layer by the model (e.g. Gemma 3's five sliding layers per global
    one), the same for every step."""

    sliding_window: int | None = None
    """The query at position i sees only keys at positions j with i - window < j <= i
    (itself and the window - 1 before it); None: every earlier position."""
    logits_soft_cap: float | None = None
    """Scores (already scaled) become cap * tanh(score / cap) before the mask and the
    softmax (Gemma 2's `attn_logit_softcapping`); None: no cap."""

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {self.logits_soft_cap}")

    @property
    def is_plain(self) -> bool:
        """Plain causal attention (no window, no cap): every fast path takes it."""
        return self.sliding_window is None and self.logits_soft_cap is None


FULL_ATTENTION = AttentionOptions()


class AttentionBackend(ABC):
    """One attention implementation; stateless apart from configuration."""

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend-specific per-step metadata; default: the common metadata itself."""
        return common

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        """Write key/value into `kv_cache` at the step's slots, then attend (narrowed by
        the layer's `options`).

        query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads,
        head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (int8:
        head_dim + 4, see attention/kv_quant.py).
        Returns [num_tokens, num_heads, head_dim].
        """


def flat_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches of one layer viewed per slot: [num_slots, kv_heads, head_dim]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    return kv_cache[0].view(-1, num_kv_heads, head_dim), kv_cache[1].view(
        -1, num_kv_heads, head_dim
    )


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the new tokens' K/V into their cache slots (quantised for an int8 cache)."""
    key_cache, value_cache = flat_kv_cache(kv_cache)  # [num_slots, kv_heads, row]
    if is_quantized_cache(kv_cache):
        key, value = quantize_rows(key), quantize_rows(value)
    # Padding slots (-1) never occur in our batches (no CUDA-graph padding on CPU); callers
    # that pad must drop those rows first. index_copy_ raises on a negative index.
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


@dataclass
class ForwardContext:
    """Everything a layer needs for the current step besides its own inputs."""

    attn_metadata: Any
    kv_caches: list[torch.Tensor]
    kv_connector: Any = None
    """The worker's KV connector (distributed/kv_transfer/), whose per-layer hooks each
    attention layer calls; None without one."""


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context does not nest: a forward pass is running.")
    _forward_context = ctx
    try:
        yield ctx
    finally:
        _forward_context = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("No forward context: call the model inside set_forward_context().")
    return _forward_context
