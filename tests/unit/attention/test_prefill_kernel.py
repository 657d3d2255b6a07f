"""The bfloat16 paged prefill kernel (kernels/csrc/prefill_attention_cpu.cpp: AMX tiles, or
AVX-512-BF16 without them) against a float32 dense reference, and the paged backend's choice
between it and SDPA.

Skipped where the CPU has neither AVX-512-BF16 nor AMX-BF16 (the backend then keeps its
paged-kernel and SDPA paths, which test_attention.py covers)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedinfer.attention.backend import CommonAttentionMetadata
from pagedinfer.attention.cpu_sdpa import CpuPagedBackend
from pagedinfer.attention.torch_ref import TorchRefBackend
from pagedinfer.kernels.cpu import load_cpu_kernels

_kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(
    _kernels is None or not _kernels.prefill_attention_available(),
    reason="no AVX-512-BF16 here: the paged prefill kernel is not built in",
)


def _dense_reference(q, key_cache, value_cache, block_table, q_start, q_end, seq_lens, scale):
    """float32 causal attention, request by request, over contexts gathered densely."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    out = {}
    for r in range(len(q_start)):
        pos = torch.arange(seq_lens[r])
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        k = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        v = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, 1)
        v = v.repeat_interleave(num_heads // num_kv_heads, 1)
        query = q[q_start[r] : q_end[r]].float()
        q_pos = torch.arange(seq_lens[r] - len(query), seq_lens[r])
        s = torch.einsum("thd,shd->hts", query, k) * scale
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[r] = torch.einsum("hts,shd->thd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_kernel_matches_dense_reference(seed: int) -> None:
    """Random shapes: GQA groups 1-8, head_dim 64/128, block sizes that do and do not divide
    the 32-key steps, query lengths from 1 row to many tiles, contexts from none cached to
    hundreds of cached positions, scattered blocks, rows of other requests left alone."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads = rng.choice([(9, 3), (6, 2), (4, 4), (8, 1), (12, 3)])
    head_dim = rng.choice([64, 128])
    block_size = rng.choice([1, 4, 5, 16, 32])
    query_lens = [
        rng.choice([1, 2, rng.randint(3, 40), rng.randint(30, 200)])
        for _ in range(rng.randint(1, 4))
    ]
    seq_lens = [q + rng.choice([0, rng.randint(1, 20), rng.randint(20, 400)]) for q in query_lens]
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
    num_blocks = max_blocks * len(query_lens) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    block_table = torch.randperm(num_blocks)[: max_blocks * len(query_lens)]
    block_table = block_table.view(len(query_lens), max_blocks).int()
    # One row before, two after the requests' rows: they must come back untouched.
    q = (
        torch.randn(sum(query_lens) + 3, num_heads, head_dim) * rng.choice([0.5, 1.0, 3.0])
    ).bfloat16()
    q_start, q_end, row = [], [], 1
    for n in query_lens:
        q_start.append(row)
        q_end.append(row + n)
        row += n
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    _kernels.paged_prefill_attention(
        out,
        q,
        key_cache,
        value_cache,
        block_table,
        torch.tensor(q_start, dtype=torch.int32),
        torch.tensor(q_end, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
    )
    ref = _dense_reference(q, key_cache, value_cache, block_table, q_start, q_end, seq_lens, scale)
    for r, expected in ref.items():
        # Output rounded to bfloat16 (|x| < ~4: 2^-7 relative) plus P rounded to bfloat16.
        torch.testing.assert_close(out[q_start[r] : q_end[r]].float(), expected, atol=3e-2, rtol=0)
    assert bool((out[0] == 7).all()) and bool((out[-2:] == 7).all())


def test_kernel_reads_strided_queries() -> None:
    """The model passes q as a view into the fused qkv output (a stride between tokens)."""
    torch.manual_seed(0)
    qkv = torch.randn(20, 9 * 64 + 2 * 3 * 64).bfloat16()
    q = qkv[:, : 9 * 64].view(20, 9, 64)
    key_cache = torch.randn(4, 16, 3, 64).bfloat16()
    value_cache = torch.randn(4, 16, 3, 64).bfloat16()
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    args = (torch.tensor([0], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    lens = torch.tensor([25], dtype=torch.int32)
    out_strided, out_contig = torch.empty(20, 9, 64).bfloat16(), torch.empty(20, 9, 64).bfloat16()
    _kernels.paged_prefill_attention(
        out_strided, q, key_cache, value_cache, table, *args, lens, 0.125
    )
    _kernels.paged_prefill_attention(
        out_contig, q.contiguous(), key_cache, value_cache, table, *args, lens, 0.125
    )
    assert torch.equal(out_strided, out_contig)


def test_kernel_rejects_bad_inputs() -> None:
    q = torch.randn(4, 9, 64).bfloat16()
    cache = torch.randn(2, 16, 3, 64).bfloat16()
    table = torch.zeros(1, 2, dtype=torch.int32)

    def call(q=q, start=0, end=4, seq_len=4, cache=cache):
        _kernels.paged_prefill_attention(
            torch.empty_like(q), q, cache, cache, table,
            torch.tensor([start], dtype=torch.int32), torch.tensor([end], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32), 0.125,
        )  # fmt: skip

    call()  # valid
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(q=q.float())
    with pytest.raises(RuntimeError, match="out of range"):
        call(end=5)
    with pytest.raises(RuntimeError, match="more query rows"):
        call(seq_len=3)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        call(seq_len=33)
    with pytest.raises(RuntimeError, match="head_dim"):
        call(q=torch.randn(4, 9, 32).bfloat16(), cache=torch.randn(2, 16, 3, 32).bfloat16())


def _mixed_batch(dtype: torch.dtype):
    """A fresh prefill, a chunk over 37 cached positions, two decodes; block size 16."""
    query_lens, seq_lens = [23, 9, 1, 1], [23, 46, 30, 7]
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    max_blocks = 3
    block_table = torch.arange(4 * max_blocks, dtype=torch.int32).flip(0).view(4, max_blocks)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for r, (n, s) in enumerate(zip(query_lens, seq_lens)):
        for p in range(s - n, s):
            slots.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    common = CommonAttentionMetadata(
        num_reqs=4,
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=[s - n for n, s in zip(query_lens, seq_lens)],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size,
    )
    torch.manual_seed(1)
    n = qsl[-1]
    q = torch.randn(n, num_heads, head_dim, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    cache = torch.randn(2, 12, block_size, num_kv_heads, head_dim, dtype=dtype)
    return common, q, k, v, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_uses_the_kernel_for_bf16_and_the_paged_kernel_otherwise(
    dtype: torch.dtype,
) -> None:
    """bfloat16: every multi-row request through the bfloat16 kernel, the decodes through the
    paged kernel; float32: fresh prefills on SDPA, the rest through the paged kernel."""
    common, q, k, v, cache = _mixed_batch(dtype)
    scale = 64**-0.5
    paged = CpuPagedBackend(9, 3, 64, scale)
    ref = TorchRefBackend(9, 3, 64, scale)
    metadata = paged.build(common)
    assert metadata.paged_prefills is not None
    out = paged.forward(q, k, v, cache.clone(), metadata)
    expected = ref.forward(q, k, v, cache.clone(), ref.build(common))
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=0)
    else:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
