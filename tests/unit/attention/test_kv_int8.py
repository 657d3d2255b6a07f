"""The int8 KV cache (attention/kv_quant.py): the row format, the two writers (torch and the
C++ `write_kv`) storing the same bytes, and every reader (the paged kernel, the SDPA
gathers) equal to the reference on the same dequantised rows. Also the paged kernel's
multi-row tiles (prefill chunks over a cached prefix) with their contexts split across
threads, on float and int8 caches."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.attention.backend import AttentionOptions, write_kv_cache
from pagedinfer.attention.cpu_sdpa import CpuSdpaBackend
from pagedinfer.attention.kv_quant import (
    KV_SCALE_BYTES,
    cache_row_dim,
    dequantize_rows,
    quantize_rows,
    resolve_kv_cache_dtype,
)
from pagedinfer.attention.torch_ref import TorchRefBackend
from pagedinfer.kernels.cpu import load_cpu_kernels
from tests.unit.attention.test_attention import _batch_from, _paged_backend

_kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(_kernels is None, reason="the C++ CPU kernels are not built")


def test_rows_hold_codes_then_the_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero row
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + KV_SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]  # [5, 3]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, rtol=0, atol=0)
    assert rows[..., :64].abs().max() == 127  # the largest value of a row uses the full range
    assert int(scale[2, 1]) == 0 and not rows[2, 1].any()
    back = dequantize_rows(rows, torch.float32)
    # Round to nearest: off by at most half a step of the row's scale.
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()
    assert dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


def test_cache_dtype_names() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="fp8"):
        resolve_kv_cache_dtype("fp8", torch.float32)
    assert cache_row_dim(64, torch.int8) == 68 and cache_row_dim(64, torch.float32) == 64


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [3, 100])  # 100: the parallel write
def test_kernel_writer_stores_the_same_bytes(dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    heads, head_dim, blocks, bs = 3, 64, 20, 16
    qkv = torch.randn(n, (6 + 2 * heads) * head_dim).to(dtype)  # a fused projection
    key = qkv[:, 6 * head_dim : (6 + heads) * head_dim].view(n, heads, head_dim)  # row-strided
    value = qkv[:, (6 + heads) * head_dim :].view(n, heads, head_dim)
    slots = torch.randperm(blocks * bs)[:n]
    ours = torch.zeros(2, blocks, bs, heads, head_dim + 4, dtype=torch.int8)
    ref = ours.clone()
    _kernels.write_kv(ours, key, value, slots)
    write_kv_cache(key, value, ref, slots)
    assert torch.equal(ours, ref)
    assert ours.view(2, -1, heads, head_dim + 4)[0, slots].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        _kernels.write_kv(ours, key[:1], value[:1], torch.tensor([blocks * bs]))


def _float_case(query_lens, seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16):
    """A batch on SmolLM2's attention shape (9 query, 3 KV heads, head_dim 64) by default."""
    return _batch_from(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size,
    )  # fmt: skip


def _int8_case(query_lens, seq_lens, **shape):
    common, q, k, v, cache = _float_case(query_lens, seq_lens, **shape)
    return common, q, k, v, quantize_rows(cache)


_OPTIONS = [
    AttentionOptions(),
    AttentionOptions(sliding_window=40),
    AttentionOptions(sliding_window=7, logits_soft_cap=3.0),
]


@needs_kernels
@pytest.mark.parametrize("options", _OPTIONS, ids=repr)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 48)]
)
def test_int8_cache_readers_equal_the_reference(
    options: AttentionOptions, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Decodes and chunks over a cached prefix (no fresh prefill: those attend to the
    step's exact K/V, below) read the int8 rows: the paged kernel and the SDPA gathers equal
    the reference, which dequantises them itself."""
    torch.manual_seed(head_dim)
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    common, q, k, v, cache = _int8_case(
        [1, 1, 7, 1, 20, 1], [1, 300, 60, 33, 250, 17], **shape
    )  # fmt: skip
    scale = head_dim**-0.5
    ref = TorchRefBackend(num_heads, num_kv_heads, head_dim, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common), options)
    for fast in (
        _paged_backend(scale, num_heads, num_kv_heads, head_dim),
        CpuSdpaBackend(num_heads, num_kv_heads, head_dim, scale),
    ):
        written = cache.clone()
        out = fast.forward(q, k, v, written, fast.build(common), options)
        torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=0)
    # The step's own rows were stored quantised, and read back as such.
    rows = written[0].view(-1, num_kv_heads, head_dim + 4)[common.slot_mapping]
    assert torch.equal(rows, quantize_rows(k))


@needs_kernels
def test_fresh_prefill_attends_to_the_exact_step_rows() -> None:
    """With an int8 cache a fresh prefill reads nothing from the cache: it attends to its
    own float K/V (SDPA), then leaves them quantised in the cache. Without
    `quantized_cache` a short one goes through the kernel, reading back the int8 rows."""
    from pagedinfer.attention.cpu_sdpa import CpuPagedBackend

    torch.manual_seed(1)
    common, q, k, v, cache = _int8_case([24], [24])
    scale = 64**-0.5
    float_cache = dequantize_rows(cache, torch.float32)
    expected = TorchRefBackend(9, 3, 64, scale).forward(q, k, v, float_cache, common)
    paged = CpuPagedBackend(9, 3, 64, scale, quantized_cache=True)
    metadata = paged.build(common)
    assert metadata.paged is None and len(metadata.chunks) == 1
    out = paged.forward(q, k, v, cache, metadata)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    reread = TorchRefBackend(9, 3, 64, scale).forward(q, k, v, cache.clone(), common)
    assert 0 < (reread - expected).abs().max() < 0.05  # the cache holds the int8 rows
    plain = CpuPagedBackend(9, 3, 64, scale)
    metadata = plain.build(common)
    assert metadata.paged is not None and not metadata.chunks
    torch.testing.assert_close(plain.forward(q, k, v, cache, metadata), reread, atol=1e-4, rtol=0)


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_long_contexts_take_sdpa(int8: bool) -> None:
    """Past KERNEL_MAX_CONTEXT positions a prefill or a chunk goes to SDPA (measured faster
    there), decodes stay on the kernel; equal to the reference either way."""
    from pagedinfer.attention.cpu_sdpa import KERNEL_MAX_CONTEXT

    torch.manual_seed(3)
    long = KERNEL_MAX_CONTEXT + 40
    make = _int8_case if int8 else _float_case
    common, q, k, v, cache = make([1, 30, 20, 64], [long, long, 100, 64])
    scale = 64**-0.5
    paged = _paged_backend(scale, 9, 3, 64)
    metadata = paged.build(common)
    assert [c.q_start for c in metadata.chunks] == [1]  # the long chunk
    assert metadata.paged is not None and metadata.paged.q_start.tolist() == [0, 31, 51]
    ref = TorchRefBackend(9, 3, 64, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common))
    out = paged.forward(q, k, v, cache.clone(), metadata)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=0)


@pytest.fixture
def two_threads():
    """The kernel splits contexts when it has fewer tiles than 4 per thread: pin 2 threads
    so the split happens on any machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("options", [*_OPTIONS, AttentionOptions(sliding_window=300)], ids=repr)
def test_tiles_over_long_contexts_split_across_threads(
    int8: bool, options: AttentionOptions, two_threads: None
) -> None:
    """Few tiles over long contexts: each tile's context is split into parts, then
    combined. The causal triangle and a long window's start fall inside parts; the 2-row
    chunk over 129 positions gets parts [0, 128) and [128, 129), the second of which its
    first row (position 127) does not see at all. Equal to the reference."""
    torch.manual_seed(2)
    make = _int8_case if int8 else _float_case
    common, q, k, v, cache = make([3, 7, 1, 2], [1500, 900, 700, 129])
    scale = 64**-0.5
    ref = TorchRefBackend(9, 3, 64, scale)
    out_ref = ref.forward(q, k, v, cache.clone(), ref.build(common), options)
    paged = _paged_backend(scale, 9, 3, 64)
    metadata = paged.build(common)
    assert metadata.paged is not None and metadata.paged.q_start.tolist() == [0, 3, 10, 11]
    out = paged.forward(q, k, v, cache.clone(), metadata, options)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=0)


def test_config_names_what_it_does_not_take() -> None:
    """fp8 is not a cache dtype here, and an int8 cache cannot go through a KV connector
    (their wire formats carry float rows): both refused when the config is built."""
    from pagedinfer.config import build_engine_config

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_engine_config(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="KV connector"):
        build_engine_config(
            kv_cache_dtype="int8",
            kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_producer"},
        )
    assert build_engine_config(kv_cache_dtype="int8").cache_config.kv_cache_dtype == "int8"
