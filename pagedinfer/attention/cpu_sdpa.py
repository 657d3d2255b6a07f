"""Fast CPU attention built on `torch.nn.functional.scaled_dot_product_attention`.

The batch is split, once per step in `build()`, into three kinds of request:
- decodes (query length 1): all of them in ONE padded SDPA call per layer; their contexts
  are gathered from the paged cache with a precomputed [num_decodes, max_seq_len] slot
  index and a key-padding mask (index and mask are shared by every layer);
- fresh prefills (nothing cached yet): SDPA straight on this step's K/V with
  `is_causal=True`, no cache read at all;
- prefill chunks over a cached prefix: gather the request's context, SDPA with a causal
  mask shifted by the cached length.
Results equal `TorchRefBackend` within float tolerance (tests/unit/attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedinfer.attention.backend import AttentionBackend, CommonAttentionMetadata, write_kv_cache

__all__ = ["CpuSdpaBackend", "CpuSdpaMetadata"]


@dataclass
class _Chunk:
    q_start: int
    q_end: int
    slots: torch.Tensor | None
    """[seq_len] int64 context slots; None for a fresh prefill (attend to this step's K/V)."""
    mask: torch.Tensor | None
    """[query_len, seq_len] bool (True = attend) for a chunk over a cached prefix."""


@dataclass
class CpuSdpaMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64"""
    decode_token_idx: torch.Tensor | None
    """[num_decodes] int64 rows of the flattened batch that are decodes."""
    decode_slots: torch.Tensor | None
    """[num_decodes, max_decode_seq_len] int64 cache slots (padded with slot 0)."""
    decode_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_decode_seq_len] bool, True where the key is real."""
    chunks: list[_Chunk]
    all_decodes_contiguous: bool
    """The decodes are exactly rows 0..num_decodes-1 (lets forward skip a gather)."""


class CpuSdpaBackend(AttentionBackend):
    name = "cpu_sdpa"

    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        bs = common.block_size
        qsl = common.query_start_loc_cpu
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        chunks: list[_Chunk] = []
        for r in range(common.num_reqs):
            q_start, q_end = qsl[r], qsl[r + 1]
            query_len = q_end - q_start
            seq_len = common.seq_lens_cpu[r]
            if query_len == 1:
                decode_rows.append(q_start)
                decode_reqs.append(r)
            elif seq_len == query_len:
                chunks.append(_Chunk(q_start, q_end, None, None))
            else:
                positions = torch.arange(seq_len)
                slots = common.block_table[r, positions // bs].long() * bs + positions % bs
                q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
                mask = positions[None, :] <= q_pos  # [query_len, seq_len]
                chunks.append(_Chunk(q_start, q_end, slots, mask))

        decode_idx = decode_slots = decode_mask = None
        if decode_reqs:
            reqs = torch.tensor(decode_reqs)
            seq_lens = common.seq_lens[reqs].long()  # [num_decodes]
            max_len = int(seq_lens.max())
            positions = torch.arange(max_len)
            valid = positions[None, :] < seq_lens[:, None]  # [num_decodes, max_len]
            block_idx = (positions // bs).expand(len(decode_reqs), -1)
            blocks = torch.gather(common.block_table[reqs].long(), 1, block_idx)
            decode_slots = torch.where(valid, blocks * bs + positions % bs, 0)
            decode_mask = valid[:, None, None, :]
            decode_idx = torch.tensor(decode_rows)
        contiguous = decode_rows == list(range(len(decode_rows)))
        return CpuSdpaMetadata(
            slot_mapping=common.slot_mapping,
            decode_token_idx=decode_idx,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            chunks=chunks,
            all_decodes_contiguous=contiguous,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]

        for chunk in metadata.chunks:
            q = query[chunk.q_start : chunk.q_end].transpose(0, 1)  # [heads, q_len, dim]
            if chunk.slots is None:
                k = key[chunk.q_start : chunk.q_end].transpose(0, 1)  # [kv_heads, q_len, dim]
                v = value[chunk.q_start : chunk.q_end].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                k = key_cache[chunk.slots].transpose(0, 1)  # [kv_heads, seq_len, dim]
                v = value_cache[chunk.slots].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=chunk.mask, scale=self.scale, enable_gqa=True
                )
            out[chunk.q_start : chunk.q_end] = o.transpose(0, 1)

        if metadata.decode_slots is not None:
            assert metadata.decode_token_idx is not None
            num_decodes = metadata.decode_slots.shape[0]
            if metadata.all_decodes_contiguous:
                q = query[:num_decodes]
            else:
                q = query[metadata.decode_token_idx]
            q = q.unsqueeze(2)  # [num_decodes, heads, 1, dim]
            k = key_cache[metadata.decode_slots].transpose(1, 2)  # [n, kv_heads, seq, dim]
            v = value_cache[metadata.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=metadata.decode_mask, scale=self.scale, enable_gqa=True
            )  # [num_decodes, heads, 1, dim]
            if metadata.all_decodes_contiguous:
                out[:num_decodes] = o.squeeze(2)
            else:
                out[metadata.decode_token_idx] = o.squeeze(2)
        return out
