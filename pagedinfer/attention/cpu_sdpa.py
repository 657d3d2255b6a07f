"""Fast CPU attention built on `torch.nn.functional.scaled_dot_product_attention`.

The batch is split, once per step in `build()`, into three kinds of request:
- decodes (query length 1): batched into a few padded SDPA calls per layer; their contexts
  are gathered from the paged cache with a precomputed [group_size, max_seq_len] slot
  index and a key-padding mask (shared by every layer). Decodes are grouped by context
  length so that padding stays small (gathering pads every row to the group's longest
  context, and the gathered bytes dominate decode attention at large batches);
- fresh prefills (nothing cached yet): SDPA straight on this step's K/V with
  `is_causal=True`, no cache read at all;
- prefill chunks over a cached prefix: gather the request's context, SDPA with a causal
  mask shifted by the cached length.
When the C++ kernels (`kernels/cpu.py`) are available, `CpuPagedBackend` (the default)
uses them instead for everything that reads the cache: one `paged_attention` call per layer
takes the decodes and the chunks over a cached prefix, reading K/V in place through the
block table (no gathered copy; tiles of query rows share each K/V row read, the context split
across threads when there are few tiles) on every tier, and from an int8 cache as from a
float one; fresh prefills stay on SDPA over this step's K/V (nothing to read from the cache).
On a CPU with AVX-512-BF16 or AMX, bfloat16 layers without options send every multi-row
request through the bfloat16 prefill kernel instead (2-6x faster than gather + masked SDPA
on the chunk shapes of docs/benchmarks.md; 2.3-4.6x the paged kernel on AVX-512-BF16).
A layer with a sliding window or a soft cap (`AttentionOptions`) takes the same paths with its
own masks (built on its first call of the step, then shared by the layers with the same
options): a window masks, and a chunk's context is gathered only from the window's first key
on. SDPA has no soft cap, so capped layers compute the scores explicitly (`_attend`). The
paged kernel takes both options; the bfloat16 prefill kernel takes neither, so such layers
use the paged kernel and SDPA.
An int8 KV cache (attention/kv_quant.py) is read dequantised by the SDPA paths' gathers and
in place by the kernel.
Results equal `TorchRefBackend` within float tolerance (tests/unit/attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedinfer.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionOptions,
    CommonAttentionMetadata,
    flat_kv_cache,
    write_kv_cache,
)
from pagedinfer.attention.kv_quant import read_rows

__all__ = ["CpuPagedBackend", "CpuSdpaBackend", "CpuSdpaMetadata"]


@dataclass
class _Chunk:
    q_start: int
    q_end: int
    slots: torch.Tensor | None
    """[seq_len] int64 context slots; None for a fresh prefill (attend to this step's K/V)."""
    mask: torch.Tensor | None
    """[query_len, seq_len] bool (True = attend) for a chunk over a cached prefix."""

    def windowed(self, window: int) -> _Chunk:
        """The same chunk for a layer with a sliding window: the context cut to the keys
        the first query row can still see, and a mask that hides the rest."""
        query_len = self.q_end - self.q_start
        seq_len = query_len if self.slots is None else self.slots.shape[0]
        first = max(0, seq_len - query_len - window + 1)  # earliest key any row sees
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        k_pos = torch.arange(first, seq_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [query_len, seq_len - first]
        if self.slots is None:  # a fresh prefill still reads only this step's K/V
            assert first == 0
            return _Chunk(self.q_start, self.q_end, None, mask)
        return _Chunk(self.q_start, self.q_end, self.slots[first:], mask)


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor
    """[group_size] int64 rows of the flattened batch."""
    slots: torch.Tensor
    """[group_size, max_seq_len] int64 cache slots (padded with slot 0)."""
    mask: torch.Tensor | None
    """[group_size, 1, 1, max_seq_len] bool, True where the key is real; None if no padding."""
    contiguous_start: int | None
    """If the group's rows are start..start+size-1, `start` (lets forward slice, not gather)."""
    seq_lens: torch.Tensor
    """[group_size] int64 context length of each row."""

    def windowed(self, window: int) -> _DecodeGroup:
        """The same group for a layer with a sliding window: keys before each row's window
        masked too."""
        positions = torch.arange(self.slots.shape[1])
        seen = positions[None, :] < self.seq_lens[:, None]
        seen &= positions[None, :] >= self.seq_lens[:, None] - window  # [size, max_len]
        return _DecodeGroup(
            self.token_idx, self.slots, seen[:, None, None, :], self.contiguous_start,
            self.seq_lens,
        )  # fmt: skip


@dataclass
class _PagedRequests:
    """Requests for the C++ paged kernels (paged_attention, the bfloat16 prefill kernel): their
    query rows [q_start, q_end) of the flattened batch, context lengths and block tables."""

    q_start: torch.Tensor
    """[n] int32 first query row of each request"""
    q_end: torch.Tensor
    """[n] int32"""
    seq_lens: torch.Tensor
    """[n] int32"""
    block_table: torch.Tensor
    """[n, max_blocks] int32"""


@dataclass
class CpuSdpaMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64"""
    decode_groups: list[_DecodeGroup]
    chunks: list[_Chunk]
    paged: _PagedRequests | None = None
    """`CpuPagedBackend`: the requests for the paged kernel (the others are `chunks`)."""
    paged_prefills: _PagedRequests | None = None
    """With the bfloat16 prefill kernel: every multi-row request, for layers it takes..."""
    paged_decodes: _PagedRequests | None = None
    """... and the decodes, for the paged kernel in those layers."""
    decodes_only: bool = False
    """Every row of the step is a decode, in request order (the steady decode batch):
    forward skips the rest."""
    windowed: dict[int, tuple[list[_Chunk], list[_DecodeGroup]]] = field(default_factory=dict)
    """sliding window -> `chunks` and `decode_groups` for layers with that window, made on
    the first such layer's call and shared by the others of the step."""

    def for_window(self, window: int | None) -> tuple[list[_Chunk], list[_DecodeGroup]]:
        """The chunks and decode groups a layer with this sliding window attends over."""
        if window is None:
            return self.chunks, self.decode_groups
        if window not in self.windowed:
            self.windowed[window] = (
                [chunk.windowed(window) for chunk in self.chunks],
                [group.windowed(window) for group in self.decode_groups],
            )
        return self.windowed[window]


def _chunk(common: CommonAttentionMetadata, r: int) -> _Chunk:
    """Multi-row request r for SDPA: a fresh prefill (this step's K/V), or a chunk over a
    cached prefix (its context's slots and the causal mask shifted by the cached length)."""
    q_start, q_end = common.query_start_loc_cpu[r], common.query_start_loc_cpu[r + 1]
    query_len, seq_len, bs = q_end - q_start, common.seq_lens_cpu[r], common.block_size
    if seq_len == query_len:
        return _Chunk(q_start, q_end, None, None)
    positions = torch.arange(seq_len)
    slots = common.block_table[r, positions // bs].long() * bs + positions % bs
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    return _Chunk(q_start, q_end, slots, positions[None, :] <= q_pos)  # mask [query, seq]


def _contiguous_start(rows: list[int]) -> int | None:
    """`rows[0]` if rows are consecutive (slice instead of gather), else None."""
    return rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None


def _take_rows(x: torch.Tensor, start: int | None, idx: torch.Tensor, n: int) -> torch.Tensor:
    return x[start : start + n] if start is not None else x[idx]


def _put_rows(out: torch.Tensor, start: int | None, idx: torch.Tensor, rows: torch.Tensor) -> None:
    if start is not None:
        out[start : start + rows.shape[0]] = rows
    else:
        out[idx] = rows


# A new decode group starts when a context is shorter than this fraction of the group's
# longest one: at most ~1/_GROUP_RATIO padding overhead per group, and only a handful of
# SDPA calls per layer.
_GROUP_RATIO = 0.8


class CpuSdpaBackend(AttentionBackend):
    name = "cpu_sdpa"

    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        qsl = common.query_start_loc_cpu
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        chunks: list[_Chunk] = []
        for r in range(common.num_reqs):
            q_start, q_end = qsl[r], qsl[r + 1]
            query_len = q_end - q_start
            if query_len == 1:
                decode_rows.append(q_start)
                decode_reqs.append(r)
            else:
                chunks.append(_chunk(common, r))

        groups = self._decode_groups(common, decode_rows, decode_reqs)
        return CpuSdpaMetadata(
            slot_mapping=common.slot_mapping, decode_groups=groups, chunks=chunks
        )

    @staticmethod
    def _decode_groups(
        common: CommonAttentionMetadata, rows: list[int], reqs: list[int]
    ) -> list[_DecodeGroup]:
        if not reqs:
            return []
        bs = common.block_size
        seq_lens = common.seq_lens_cpu
        # Keep batch order inside a group when it is already sorted (the common case of a
        # steady decode batch), so rows stay contiguous and need no gather.
        order = sorted(range(len(reqs)), key=lambda i: -seq_lens[reqs[i]])
        grouped: list[list[int]] = []
        for i in order:
            if grouped and seq_lens[reqs[i]] >= _GROUP_RATIO * seq_lens[reqs[grouped[-1][0]]]:
                grouped[-1].append(i)
            else:
                grouped.append([i])
        out = []
        for members in grouped:
            members.sort()
            group_reqs = torch.tensor([reqs[i] for i in members])
            group_rows = [rows[i] for i in members]
            lens = common.seq_lens[group_reqs].long()  # [group_size]
            max_len = int(lens.max())
            positions = torch.arange(max_len)
            valid = positions[None, :] < lens[:, None]  # [group_size, max_len]
            block_idx = (positions // bs).expand(len(members), -1)
            blocks = torch.gather(common.block_table[group_reqs].long(), 1, block_idx)
            slots = torch.where(valid, blocks * bs + positions % bs, 0)
            mask = None if bool(valid.all()) else valid[:, None, None, :]
            out.append(
                _DecodeGroup(
                    token_idx=torch.tensor(group_rows),
                    slots=slots,
                    mask=mask,
                    contiguous_start=_contiguous_start(group_rows),
                    seq_lens=lens,
                )
            )
        return out

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = flat_kv_cache(kv_cache)  # [num_slots, kv_heads, row]
        dtype = query.dtype
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        chunks, decode_groups = metadata.for_window(options.sliding_window)
        cap = options.logits_soft_cap
        self._attend_chunks(query, key, value, kv_cache, chunks, out, cap)

        for group in decode_groups:
            n = group.slots.shape[0]
            q = _take_rows(query, group.contiguous_start, group.token_idx, n)
            q = q.unsqueeze(2)  # [n, heads, 1, dim]
            k = read_rows(key_cache, group.slots, dtype).transpose(1, 2)  # [n, kv_heads, seq, dim]
            v = read_rows(value_cache, group.slots, dtype).transpose(1, 2)
            o = self._attend(q, k, v, group.mask, cap, causal=False).squeeze(2)  # [n, heads, dim]
            _put_rows(out, group.contiguous_start, group.token_idx, o)
        return out

    def _attend_chunks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunks: list[_Chunk],
        out: torch.Tensor,
        cap: float | None,
    ) -> None:
        """SDPA for multi-row requests into `out`: fresh prefills on this step's K/V, chunks
        over a cached prefix on their context gathered (and dequantised) from the cache."""
        key_cache, value_cache = flat_kv_cache(kv_cache)  # [num_slots, kv_heads, row]
        for chunk in chunks:
            # 4-D inputs ([1, heads, len, dim]): torch's fused CPU flash kernel only takes
            # batched inputs; 3-D ones fall back to the unfused math path (~10x slower).
            q = query[chunk.q_start : chunk.q_end].transpose(0, 1)[None]  # [1, heads, q, dim]
            if chunk.slots is None:
                k = key[chunk.q_start : chunk.q_end]  # [q, kv_heads, dim]
                v = value[chunk.q_start : chunk.q_end]
            else:
                k = read_rows(key_cache, chunk.slots, query.dtype)  # [seq, kv_heads, dim]
                v = read_rows(value_cache, chunk.slots, query.dtype)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, len, dim]
            o = self._attend(q, k, v, chunk.mask, cap)
            out[chunk.q_start : chunk.q_end] = o[0].transpose(0, 1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        soft_cap: float | None,
        causal: bool = True,
    ) -> torch.Tensor:
        """Attention of q [b, heads, q_len, dim] over k, v [b, kv_heads, kv_len, dim] with a
        boolean mask (True = attend; broadcast to [b, heads, q_len, kv_len]), or, without
        one, causal (a fresh prefill) unless `causal` is False.

        SDPA, unless the scores are soft-capped: SDPA has no hook between the scores and
        the softmax, so those are computed explicitly, in float32 as Hugging Face does."""
        if soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.scale,
                enable_gqa=True,
            )  # fmt: skip
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [b, heads, kv_len, dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), k.transpose(2, 3)) * self.scale  # [b, heads, q, kv]
        scores = torch.tanh(scores / soft_cap) * soft_cap
        if mask is None and causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)


# Multi-row requests (prefills, chunks over a cached prefix) up to this many positions of
# context go through the paged kernel, longer ones through SDPA: measured on the AVX2 tier
# (benchmarks/bench_prefill_attention.py, float32, docs/benchmarks.md) the kernel is
# 1.3-1.7x gather + SDPA up to ~1,000 positions, even at 1,024 and 0.9x at 2,048, where
# SDPA's GEMM blocking reuses each K/V block over more query rows than the kernel's tiles.
KERNEL_MAX_CONTEXT = 1536


class CpuPagedBackend(CpuSdpaBackend):
    """The C++ paged kernel (K/V read in place, any cache dtype) for decodes and for
    prefills and chunks up to `KERNEL_MAX_CONTEXT` positions; SDPA for longer ones (a fresh
    prefill on this step's K/V, a chunk on its gathered context); on AVX-512-BF16 and AMX
    machines the bfloat16 prefill kernel for bfloat16 prefills.

    `quantized_cache`: the cache is int8. Fresh prefills then always take SDPA over their
    own float K/V (nothing they need is in the cache yet), so a request's first token is the
    one the float cache gives."""

    name = "cpu_paged"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        quantized_cache: bool = False,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from pagedinfer.kernels.cpu import load_cpu_kernels

        self.kernel = load_cpu_kernels()
        if self.kernel is None:
            raise RuntimeError("the paged attention kernel could not be built")
        self.quantized_cache = quantized_cache
        # bfloat16 only; decided per call in forward(), since the model's dtype is not
        # known here.
        self.prefill_kernel = self.kernel.prefill_attention_available() and head_dim in (64, 128)

    def build(self, common: CommonAttentionMetadata) -> CpuSdpaMetadata:
        qsl = common.query_start_loc_cpu
        seq_lens = common.seq_lens_cpu
        decodes, kernel, sdpa = [], [], []
        for r in range(common.num_reqs):
            query_len = qsl[r + 1] - qsl[r]
            if query_len == 1:
                decodes.append(r)
                continue
            fresh = seq_lens[r] == query_len
            if seq_lens[r] <= KERNEL_MAX_CONTEXT and not (fresh and self.quantized_cache):
                kernel.append(r)
            else:
                # SDPA: a fresh prefill on this step's K/V, a chunk on its gathered context
                # (the decode groups stay empty: the kernel takes every decode).
                sdpa.append(r)
        multi = sorted(kernel + sdpa)
        metadata = self._sdpa_chunks(common, sdpa)
        metadata.paged = self._requests(common, sorted(decodes + kernel))
        if self.prefill_kernel and multi:
            metadata.paged_prefills = self._requests(common, multi)
            metadata.paged_decodes = self._requests(common, decodes)
        if decodes and len(decodes) == common.num_reqs:
            metadata.decodes_only = True
        return metadata

    @staticmethod
    def _sdpa_chunks(common: CommonAttentionMetadata, reqs: list[int]) -> CpuSdpaMetadata:
        """SDPA metadata for these multi-row requests only."""
        chunks = [_chunk(common, r) for r in reqs]
        return CpuSdpaMetadata(slot_mapping=common.slot_mapping, decode_groups=[], chunks=chunks)

    @staticmethod
    def _requests(common: CommonAttentionMetadata, reqs: list[int]) -> _PagedRequests | None:
        if not reqs:
            return None
        idx = torch.tensor(reqs)
        return _PagedRequests(
            q_start=common.query_start_loc[idx].to(torch.int32),
            q_end=common.query_start_loc[idx + 1].to(torch.int32),
            seq_lens=common.seq_lens[idx].to(torch.int32).contiguous(),
            block_table=common.block_table[idx].contiguous(),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        window = options.sliding_window or 0  # 0: no window
        cap = options.logits_soft_cap or 0.0  # 0: no cap
        paged = metadata.paged
        if metadata.decodes_only:
            # The steady decode batch: one C++ call writes the new K/V and attends for every
            # row; no output buffer to scatter into (86 -> ~45 us per layer at batch 1).
            assert paged is not None
            return self.kernel.paged_decode_step(
                query, kv_cache, key, value, metadata.slot_mapping, paged.block_table,
                paged.seq_lens, self.scale, window, cap,
            )  # fmt: skip
        self.kernel.write_kv(kv_cache, key, value, metadata.slot_mapping)
        query = query.contiguous()
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        prefills = metadata.paged_prefills
        if (
            prefills is not None
            and query.dtype == torch.bfloat16
            and kv_cache.dtype == torch.bfloat16
            and options.is_plain
        ):
            # bfloat16: every multi-row request through the prefill kernel, decodes through the
            # paged kernel.
            self.kernel.paged_prefill_attention(
                out, query, kv_cache[0], kv_cache[1], prefills.block_table, prefills.q_start,
                prefills.q_end, prefills.seq_lens, self.scale,
            )  # fmt: skip
            paged = metadata.paged_decodes
        else:
            # SDPA for the multi-row requests the kernel does not take.
            chunks, _ = metadata.for_window(options.sliding_window)
            self._attend_chunks(query, key, value, kv_cache, chunks, out, options.logits_soft_cap)
        if paged is not None:
            self.kernel.paged_attention(
                out, query, kv_cache[0], kv_cache[1], paged.block_table, paged.q_start,
                paged.q_end, paged.seq_lens, self.scale, window, cap,
            )  # fmt: skip
        return out
