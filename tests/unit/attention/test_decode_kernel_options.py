"""The paged decode kernel's sliding window and logit soft cap (kernels/csrc/
paged_attention_cpu.cpp), and the fused gelu_tanh_and_mul layer op, against plain torch.

The decode reference gathers each request's whole context and masks the keys outside the
window, as Hugging Face does; the kernel instead walks only the window, so the tests also
poison the cache outside it (NaN) to show those rows are never read. Skipped where the C++
kernels cannot be built (callers then keep their torch paths)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.kernels.cpu import load_cpu_kernels

_kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(_kernels is None, reason="the C++ CPU kernels are not built here")

WINDOW = 12


def _paged_case(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, seed: int = 0, q_std: float = 1.0,
):  # fmt: skip
    """Random query and K/V cache, each request's blocks scattered by a shuffled table."""
    torch.manual_seed(seed)
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
    num_blocks = max_blocks * len(seq_lens) + 2  # two blocks nobody owns
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    # [num_reqs, max_blocks]
    block_table = torch.randperm(num_blocks)[: max_blocks * len(seq_lens)]
    block_table = block_table.view(len(seq_lens), max_blocks).int()
    query = (torch.randn(len(seq_lens), num_heads, head_dim) * q_std).to(dtype)
    return query, key_cache, value_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(query, key_cache, value_cache, block_table, seq_lens, scale, window, soft_cap):
    """float32 decode attention request by request: the whole context gathered, scores
    soft-capped, keys with j <= p - window masked (p = seq_len - 1), softmax, weighted sum."""
    num_reqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    keys = key_cache.reshape(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
    values = value_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty(num_reqs, num_heads, head_dim)
    for r in range(num_reqs):
        seq_len = int(seq_lens[r])
        pos = torch.arange(seq_len)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        group = num_heads // num_kv_heads
        k = keys[slots].float().repeat_interleave(group, 1)  # [seq_len, heads, head_dim]
        v = values[slots].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,shd->hs", query[r].float(), k) * scale  # [heads, seq_len]
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        if window > 0:
            s = s.masked_fill(pos[None, :] <= seq_len - 1 - window, float("-inf"))
        out[r] = torch.einsum("hs,shd->hd", s.softmax(-1), v)
    return out


def _decode(query, key_cache, value_cache, block_table, seq_lens, window=0, soft_cap=0.0):
    scale = query.shape[-1] ** -0.5
    return _kernels.paged_decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, soft_cap
    )


def _seq_lens(block_size: int) -> list[int]:
    """Shorter than the window, equal to it, one past it, past it by several blocks, one."""
    return [WINDOW - 5, WINDOW, WINDOW + 1, WINDOW + 3 * block_size + 2, 1, 4 * block_size]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48])  # 48: the generic loops
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (12, 3)], ids=["g1", "g3", "g4"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_window_and_cap_match_reference(dtype, head_dim, heads, block_size) -> None:
    """Every head_dim path (AVX-512 64/128/256, generic 48), GQA groups 1/3/4, block sizes
    that do and do not divide the 16-position chunks (so windows start mid-block)."""
    seq_lens = _seq_lens(block_size)
    case = _paged_case(seq_lens, *heads, head_dim, block_size, dtype, q_std=3.0)
    scale = head_dim**-0.5
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    outs = {}
    for window, soft_cap in [(0, 0.0), (WINDOW, 0.0), (0, 2.0), (WINDOW, 2.0)]:
        out = _decode(*case, window, soft_cap)
        assert out.dtype == dtype and out.shape == case[0].shape
        expected = _reference(*case, scale, window, soft_cap)
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
        outs[window, soft_cap] = out.float()
    # The options must change something: far past the window the outputs differ clearly
    # (one position past it may carry little weight), within it the window is a no-op (the
    # same loops, bit for bit); the cap changes every request with more than one position.
    longer, far = torch.tensor(seq_lens) > WINDOW, torch.tensor(seq_lens) > 2 * WINDOW
    for cap in (0.0, 2.0):
        diff = (outs[WINDOW, cap] - outs[0, cap]).abs().amax(dim=(1, 2))
        assert bool((diff[far] > 1e-2).all())
        if dtype == torch.float32:  # bf16 rounding may hide a small change
            assert bool((diff[longer] > 0).all())
        assert torch.equal(outs[WINDOW, cap][~longer], outs[0, cap][~longer])
    several = torch.tensor(seq_lens) > 1
    diff = (outs[0, 2.0] - outs[0, 0.0]).abs().amax(dim=(1, 2))
    assert bool((diff[several] > 1e-2).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 256, 48])
def test_window_of_one_returns_the_last_value(dtype, head_dim) -> None:
    """A one-position window sees only the query's own position: out = v[p], exactly."""
    seq_lens = [1, 6, 23, 40]
    case = _paged_case(seq_lens, 6, 2, head_dim, 5, dtype)
    _, _, value_cache, block_table, _ = case
    out = _decode(*case, 1, 0.0)
    for r, seq_len in enumerate(seq_lens):
        p = seq_len - 1
        v = value_cache[block_table[r, p // 5], p % 5]  # [kv_heads, head_dim]
        assert torch.equal(out[r], v.repeat_interleave(3, 0))


@pytest.mark.parametrize("head_dim", [64, 128, 256, 48])
@pytest.mark.parametrize("block_size", [16, 5])
def test_window_reads_only_the_window(head_dim, block_size) -> None:
    """NaN in every cached position outside the window (and past seq_len) changes nothing:
    the kernel starts at the window, it does not compute and then mask."""
    seq_lens = [WINDOW + 3 * block_size + 2, WINDOW + 1, 70, WINDOW - 5]
    case = _paged_case(seq_lens, 12, 3, head_dim, block_size, torch.bfloat16)
    query, key_cache, value_cache, block_table, lens = case
    clean = _decode(*case, WINDOW, 2.0)
    poisoned_k, poisoned_v = key_cache.clone(), value_cache.clone()
    for r, seq_len in enumerate(seq_lens):
        for j in range(block_table.shape[1] * block_size):
            if j <= seq_len - 1 - WINDOW or j >= seq_len:
                b, off = int(block_table[r, j // block_size]), j % block_size
                poisoned_k[b, off] = float("nan")
                poisoned_v[b, off] = float("nan")
    out = _decode(query, poisoned_k, poisoned_v, block_table, lens, WINDOW, 2.0)
    assert torch.equal(out, clean)
    # Without the window the same cache poisons every request longer than the window.
    full = _decode(query, poisoned_k, poisoned_v, block_table, lens, 0, 2.0)
    assert [bool(full[r].isnan().any()) for r in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48])
def test_defaults_are_plain_causal_decode(dtype, head_dim) -> None:
    """Window 0 and cap 0 are the old kernel: full-context attention; a window at least as
    long as every request is the same computation, bit for bit."""
    seq_lens = [1, 17, 64, 100]
    case = _paged_case(seq_lens, 9, 3, head_dim, 16, dtype, seed=1)
    out = _decode(*case)
    expected = _reference(*case, head_dim**-0.5, 0, 0.0)
    torch.testing.assert_close(
        out.float(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0
    )
    assert torch.equal(_decode(*case, 100, 0.0), out)
    assert torch.equal(_decode(*case, 1000, 0.0), out)


def test_decode_rejects_negative_options() -> None:
    case = _paged_case([5], 2, 1, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="sliding_window"):
        _decode(*case, -1, 0.0)
    with pytest.raises(RuntimeError, match="soft_cap"):
        _decode(*case, 0, -1.0)


@pytest.mark.parametrize("d", [1, 16, 37, 1024])  # 37: the vector loop plus a scalar tail
def test_gelu_tanh_and_mul_fp32(d: int) -> None:
    torch.manual_seed(d)
    x = torch.randn(7, 2 * d) * 4  # gates out to |g| ~ 15: both tanh branches, saturation
    x[0, :d] = torch.linspace(-12, 12, d)
    out = _kernels.gelu_tanh_and_mul(x)
    gate, up = x[:, :d], x[:, d:]
    expected = F.gelu(gate, approximate="tanh") * up
    assert out.shape == (7, d) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_gelu_tanh_and_mul_bf16() -> None:
    """bfloat16 in, float32 inside, one rounding: within one bf16 step of the float32 result
    rounded once (torch's own bf16 chain rounds twice)."""
    torch.manual_seed(0)
    x = (torch.randn(33, 2 * 200) * 3).bfloat16()
    out = _kernels.gelu_tanh_and_mul(x)
    gate, up = x[:, :200].float(), x[:, 200:].float()
    expected = (F.gelu(gate, approximate="tanh") * up).bfloat16()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)


def test_gelu_tanh_and_mul_rejects_odd_width() -> None:
    with pytest.raises(RuntimeError, match="2 \\* d"):
        _kernels.gelu_tanh_and_mul(torch.randn(2, 5))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_long_contexts_split_into_parts_match_reference(threads, dtype, head_dim) -> None:
    """Few requests with long contexts: each context is split into parts (>= 128 positions)
    so every thread has work, the parts' softmax pieces combined afterwards. Lengths that
    are not whole parts, a request of one part beside split ones, window and cap on a
    split context; the result must not depend on the thread count (the split does)."""
    seq_lens = [1000, 7, 300, 129]
    case = _paged_case(seq_lens, 9, 3, head_dim, 16, dtype, seed=5, q_std=3.0)
    scale = head_dim**-0.5
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window, soft_cap in [(0, 0.0), (700, 0.0), (0, 30.0)]:
            out = _decode(*case, window, soft_cap)
            expected = _reference(*case, scale, window, soft_cap)
            torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
        query, key_cache, value_cache, table, lens = case
        alone = (query[:1], key_cache, value_cache, table[:1], lens[:1])  # the most parts
        expected = _reference(*alone, scale, 0, 0.0)
        torch.testing.assert_close(_decode(*alone).float(), expected, atol=atol, rtol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_writes_the_new_rows_then_attends(dtype: torch.dtype) -> None:
    """paged_decode_step (the steady decode batch's one call per layer) equals writing the
    rows' K/V into their slots, then paged_decode_attention; key/value may be row-strided
    views of a fused projection, as the model passes them."""
    seq_lens = [5, 37, 16]
    query, key_cache, value_cache, table, lens = _paged_case(seq_lens, 6, 2, 32, 16, dtype)
    kv_cache = torch.stack([key_cache, value_cache])
    qkv = torch.randn(3, (6 + 2 + 2) * 32).to(dtype)  # [rows, q | k | v], as qkv_proj makes it
    key = qkv[:, 192:256].view(3, 2, 32)
    value = qkv[:, 256:].view(3, 2, 32)
    # Each request's last position: block seq_len // 16 of its table, offset seq_len % 16.
    last = torch.tensor(seq_lens) - 1
    slots = (table[torch.arange(3), last // 16].long() * 16 + last % 16).contiguous()
    want_cache = kv_cache.clone()
    want_cache[0].view(-1, 2, 32).index_copy_(0, slots, key)
    want_cache[1].view(-1, 2, 32).index_copy_(0, slots, value)
    want = _kernels.paged_decode_attention(
        query, want_cache[0], want_cache[1], table, lens, 32**-0.5, 0, 0.0
    )
    got = _kernels.paged_decode_step(
        query, kv_cache, key, value, slots, table, lens, 32**-0.5, 0, 0.0
    )
    assert torch.equal(kv_cache, want_cache)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = torch.tensor([0, 1, kv_cache.shape[1] * 16])
        _kernels.paged_decode_step(query, kv_cache, key, value, bad, table, lens, 0.1, 0, 0.0)
    with pytest.raises(RuntimeError, match="int64"):
        _kernels.paged_decode_step(
            query, kv_cache, key, value, slots.int(), table, lens, 0.1, 0, 0.0
        )
