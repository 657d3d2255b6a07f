"""Pure-torch paged attention: the readable oracle that every fast path is tested against.

It walks requests one by one, gathers each request's whole context from the paged cache
through its block table, and computes causal softmax attention in float32 with an explicit
mask (causal, and the layer's sliding window), soft-capping the scores first where the layer
asks. An int8 cache's rows are dequantised as they are gathered. Slow and obvious on purpose.
"""

from __future__ import annotations

import torch

from pagedinfer.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionOptions,
    CommonAttentionMetadata,
    flat_kv_cache,
    write_kv_cache,
)
from pagedinfer.attention.kv_quant import read_rows

__all__ = ["TorchRefBackend", "context_slots"]


def context_slots(block_ids: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..seq_len-1 for one request's block table row."""
    positions = torch.arange(seq_len)
    return block_ids[positions // block_size].long() * block_size + positions % block_size


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = flat_kv_cache(kv_cache)  # [num_slots, kv_heads, row]
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        qsl = metadata.query_start_loc_cpu
        for r in range(metadata.num_reqs):
            q_start, q_end = qsl[r], qsl[r + 1]
            query_len = q_end - q_start
            seq_len = metadata.seq_lens_cpu[r]
            slots = context_slots(metadata.block_table[r], seq_len, metadata.block_size)
            k = read_rows(key_cache, slots, torch.float32)  # [seq, kv_heads, dim]
            v = read_rows(value_cache, slots, torch.float32)
            k = k.repeat_interleave(group, dim=1)  # [seq, heads, dim]
            v = v.repeat_interleave(group, dim=1)
            q = query[q_start:q_end].float()  # [query_len, heads, dim]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale  # [heads, q, seq]
            cap = options.logits_soft_cap
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            # Query i sits at absolute position (seq_len - query_len + i).
            q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            hidden = k_pos > q_pos  # [q, seq]
            if options.sliding_window is not None:
                hidden |= k_pos <= q_pos - options.sliding_window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out
