"""The fast CPU attention path equals the pure-torch reference on random mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from pagedinfer.attention.backend import AttentionOptions, CommonAttentionMetadata
from pagedinfer.attention.cpu_sdpa import CpuSdpaBackend
from pagedinfer.attention.torch_ref import TorchRefBackend, context_slots

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 96


def _random_batch(rng: random.Random, dtype: torch.dtype):
    """Requests of three kinds: fresh prefills, chunks over a cached prefix, decodes."""
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["prefill", "chunk", "decode"])
        if kind == "prefill":
            q = rng.randint(1, 20)
            s = q
        elif kind == "chunk":
            q = rng.randint(2, 12)
            s = q + rng.randint(1, 20)
        else:
            q = 1
            s = rng.randint(1, 30)
        query_lens.append(q)
        seq_lens.append(s)
    return _batch_from(query_lens, seq_lens, dtype)


@pytest.mark.parametrize("seed", range(25))
def test_fast_path_matches_reference_fp32(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    common, q, k, v, cache = _random_batch(rng, torch.float32)
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    fast = CpuSdpaBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    cache_ref, cache_fast = cache.clone(), cache.clone()
    out_ref = ref.forward(q, k, v, cache_ref, ref.build(common))
    out_fast = fast.forward(q, k, v, cache_fast, fast.build(common))
    assert torch.equal(cache_ref, cache_fast)  # both wrote the same slots
    torch.testing.assert_close(out_fast, out_ref, atol=1e-4, rtol=0)


def test_fast_path_matches_reference_bf16() -> None:
    rng = random.Random(123)
    torch.manual_seed(123)
    common, q, k, v, cache = _random_batch(rng, torch.bfloat16)
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    fast = CpuSdpaBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common))
    out_fast = fast.forward(q, k, v, cache.clone(), fast.build(common))
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=3e-2, rtol=0)


def test_reference_equals_dense_causal_attention() -> None:
    """The oracle itself: one fresh prefill equals plain causal attention."""
    torch.manual_seed(0)
    n = 11
    q = torch.randn(n, NUM_HEADS, HEAD_DIM)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    block_table = torch.tensor([[5, 2, 9]], dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        query_start_loc=torch.tensor([0, n]),
        query_start_loc_cpu=[0, n],
        seq_lens=torch.tensor([n]),
        seq_lens_cpu=[n],
        num_computed_tokens_cpu=[0],
        max_query_len=n,
        max_seq_len=n,
        block_table=block_table,
        slot_mapping=context_slots(block_table[0], n, BLOCK_SIZE),
        block_size=BLOCK_SIZE,
    )
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    out = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale).forward(q, k, v, cache, common)
    kk = k.repeat_interleave(3, dim=1)
    vv = v.repeat_interleave(3, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    scores = scores + torch.full((n, n), float("-inf")).triu(1)
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def _batch_from(
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    *,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
):
    """Build a batch with the given per-request query/context lengths (blocks shuffled)."""
    BLOCK_SIZE = block_size  # noqa: N806 (the module default, overridden)
    rng = random.Random(7)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 4
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    block_table = torch.zeros(len(seq_lens), max(len(t) for t in tables), dtype=torch.int32)
    for r, t in enumerate(tables):
        block_table[r, : len(t)] = torch.tensor(t)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slot_mapping = torch.cat(
        [
            context_slots(block_table[r], s, BLOCK_SIZE)[s - q :]
            for r, (q, s) in enumerate(zip(query_lens, seq_lens))
        ]
    )
    common = CommonAttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=[s - q for q, s in zip(query_lens, seq_lens)],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=BLOCK_SIZE,
    )
    n = qsl[-1]
    q = torch.randn(n, num_heads, head_dim, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    return common, q, k, v, cache


def test_many_decodes_of_varied_lengths_grouped() -> None:
    """40 decodes with contexts from 1 to 300 tokens (several length groups, unsorted),
    with prefills and a chunk between them, equal the reference."""
    torch.manual_seed(3)
    rng = random.Random(3)
    query_lens, seq_lens = [], []
    for i in range(44):
        if i in (5, 17):
            query_lens.append(9)
            seq_lens.append(9)  # fresh prefill
        elif i == 30:
            query_lens.append(6)
            seq_lens.append(40)  # chunk over a cached prefix
        else:
            query_lens.append(1)
            seq_lens.append(rng.randint(1, 300))
    common, q, k, v, cache = _batch_from(query_lens, seq_lens)
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    fast = CpuSdpaBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    metadata = fast.build(common)
    assert len(metadata.decode_groups) > 3  # lengths really were split into groups
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common))
    out_fast = fast.forward(q, k, v, cache.clone(), metadata)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-4, rtol=0)


def _paged_backend(
    scale: float,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
):
    from pagedinfer.attention.cpu_sdpa import CpuPagedBackend

    try:
        return CpuPagedBackend(num_heads, num_kv_heads, head_dim, scale)
    except RuntimeError as exc:  # no C++ compiler here: the torch path is what runs
        pytest.skip(str(exc))


@pytest.mark.parametrize("seed", range(10))
def test_paged_kernel_matches_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 30)):
        if rng.random() < 0.2:
            q = rng.randint(2, 12)
            query_lens.append(q)
            seq_lens.append(q + rng.choice([0, rng.randint(1, 30)]))
        else:
            query_lens.append(1)
            seq_lens.append(rng.randint(1, 200))
    common, q, k, v, cache = _batch_from(query_lens, seq_lens)
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    paged = _paged_backend(scale)
    cache_ref, cache_paged = cache.clone(), cache.clone()
    out_ref = ref.forward(q, k, v, cache_ref, ref.build(common))
    out_paged = paged.forward(q, k, v, cache_paged, paged.build(common))
    assert torch.equal(cache_ref, cache_paged)
    torch.testing.assert_close(out_paged, out_ref, atol=1e-4, rtol=0)


def test_paged_kernel_bf16() -> None:
    torch.manual_seed(0)
    common, q, k, v, cache = _batch_from(
        [1] * 12 + [5], [7, 300, 64, 1, 33] + [90] * 7 + [5], dtype=torch.bfloat16
    )
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common))
    paged = _paged_backend(scale)
    out = paged.forward(q, k, v, cache.clone(), paged.build(common))
    torch.testing.assert_close(out.float(), out_ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2-135M: the kernel's vectorised head_dim-64 path
        (8, 2, 128, 16),  # Llama-style head_dim 128 (the other vectorised path)
        (4, 1, 64, 32),  # blocks longer than the 16-position chunks
        (10, 2, 64, 8),  # group of 5 heads: two sweeps of the weighted sum
        (4, 1, 256, 16),  # Gemma 3's head_dim 256: a sweep of V per head
        (2, 2, 48, 16),  # head_dim without a vector path: the plain loops
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_kernel_on_model_shapes(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """Decodes over contexts of 1..200 positions (partial last blocks, partial 16-position
    chunks) equal the float32 reference on the same (rounded) inputs."""
    rng = random.Random(head_dim + block_size)
    torch.manual_seed(head_dim * block_size)
    seq_lens = [1, 15, 16, 17, 33, 200] + [rng.randint(1, 200) for _ in range(6)]
    query_lens = [1] * len(seq_lens)
    shape = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }
    common, q, k, v, cache = _batch_from(query_lens, seq_lens, dtype, **shape)
    scale = head_dim**-0.5
    ref = TorchRefBackend(num_heads, num_kv_heads, head_dim, scale)
    out_ref = ref.forward(
        q.float(), k.float(), v.float(), cache.float(), ref.build(common)
    )  # float32 oracle on the same values
    paged = _paged_backend(scale, num_heads, num_kv_heads, head_dim)
    out = paged.forward(q, k, v, cache.clone(), paged.build(common))
    assert out.dtype == dtype
    # The kernel computes in float32 and rounds its output once.
    atol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), out_ref, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "seq_lens"),
    [
        # 12 requests of 700-1,500 positions: enough items without dividing the contexts,
        # but each context longer than a part's V bytes allow (several parts, combined).
        (9, 3, [700, 1500, 1023, 1024, 1025, 800, 1400, 900, 1200, 777, 1111, 999]),
        # 3 short decodes over 8 kv heads: too few items with all heads in one, so each
        # item takes a divisor of them (2 kv heads).
        (16, 8, [50, 129, 150]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_parts_and_head_groups(
    num_heads: int, num_kv_heads: int, seq_lens: list[int], dtype: torch.dtype
) -> None:
    """How the decode kernel divides its work (contexts into parts, kv heads among items)
    does not change its result."""
    torch.manual_seed(len(seq_lens))
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": 64}
    common, q, k, v, cache = _batch_from([1] * len(seq_lens), seq_lens, dtype, **shape)
    scale = 64**-0.5
    ref = TorchRefBackend(num_heads, num_kv_heads, 64, scale)
    out_ref = ref.forward(q.float(), k.float(), v.float(), cache.float(), ref.build(common))
    paged = _paged_backend(scale, num_heads, num_kv_heads, 64)
    out = paged.forward(q, k, v, cache.clone(), paged.build(common))
    atol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), out_ref, atol=atol, rtol=0)


def test_reference_with_window_and_soft_cap_equals_dense_attention() -> None:
    """The oracle with options: one fresh prefill equals dense attention with a banded
    causal mask and tanh-capped scores, written out here."""
    torch.manual_seed(1)
    n, window, cap = 13, 4, 2.0
    common, q, k, v, cache = _batch_from([n], [n])
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    options = AttentionOptions(sliding_window=window, logits_soft_cap=cap)
    out = ref.forward(q, k, v, cache, common, options)
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    scores = cap * torch.tanh(scores / cap)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = scores.masked_fill((j > i) | (j <= i - window), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    plain = ref.forward(q, k, v, cache, common)
    assert not torch.allclose(out, plain, atol=1e-3)  # the options changed something


_OPTIONS = [
    AttentionOptions(sliding_window=1),
    AttentionOptions(sliding_window=5),
    AttentionOptions(sliding_window=24),
    AttentionOptions(logits_soft_cap=3.0),
    AttentionOptions(sliding_window=7, logits_soft_cap=3.0),
]


def _mixed_batch_for_windows(dtype: torch.dtype = torch.float32):
    """Fresh prefills, chunks over cached prefixes and decodes, with contexts shorter
    than, equal to and several blocks longer than the windows of `_OPTIONS`."""
    query_lens = [1, 1, 1, 1, 1, 9, 30, 6, 3, 12, 1]
    seq_lens = [1, 5, 6, 40, 120, 9, 30, 40, 80, 12, 25]
    return _batch_from(query_lens, seq_lens, dtype)


@pytest.mark.parametrize("options", _OPTIONS, ids=repr)
@pytest.mark.parametrize("backend", ["cpu_sdpa", "cpu_paged"])
def test_window_and_soft_cap_match_reference(options: AttentionOptions, backend: str) -> None:
    torch.manual_seed(5)
    common, q, k, v, cache = _mixed_batch_for_windows()
    scale = HEAD_DIM**-0.5
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    fast = (
        CpuSdpaBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
        if backend == "cpu_sdpa"
        else _paged_backend(scale)
    )
    metadata = fast.build(common)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common), options)
    # Two layers of one step, windowed then plain, share the metadata (the windowed masks
    # are cached in it): each must still equal its own reference.
    out_fast = fast.forward(q, k, v, cache.clone(), metadata, options)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-4, rtol=0)
    out_plain = fast.forward(q, k, v, cache.clone(), metadata)
    torch.testing.assert_close(
        out_plain, ref.forward(q, k, v, cache.clone(), ref.build(common)), atol=1e-4, rtol=0
    )
    assert not torch.allclose(out_fast, out_plain, atol=1e-3)


def test_window_and_soft_cap_bf16() -> None:
    torch.manual_seed(6)
    common, q, k, v, cache = _mixed_batch_for_windows(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    options = AttentionOptions(sliding_window=7, logits_soft_cap=3.0)
    ref = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common), options)
    for fast in (CpuSdpaBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale), _paged_backend(scale)):
        out = fast.forward(q, k, v, cache.clone(), fast.build(common), options)
        torch.testing.assert_close(out.float(), out_ref.float(), atol=3e-2, rtol=0)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        AttentionOptions(logits_soft_cap=-1.0)
