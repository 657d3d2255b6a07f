"""The C++ layer kernels (kernels/csrc/layer_ops_cpu.cpp) equal torch's ops in float32
arithmetic, rounded once to the activation dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.kernels.cpu import load_cpu_kernels
from pagedinfer.model.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One rounding of a float32 result to the dtype (relative), with a little slack; the
# absolute floor covers cancellation (a*c - b*s near zero, fused multiply-adds).
RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-6}
ATOL = {torch.bfloat16: 1e-4, torch.float16: 1e-5, torch.float32: 1e-6}


@pytest.fixture(scope="module")
def ops():
    module = load_cpu_kernels()
    if module is None:
        pytest.skip("no C++ toolchain here")
    return module


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the float32 result up to one rounding to `dtype`."""
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 100)])  # 100: a non-vector tail
def test_rms_norm(ops, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[1]).to(dtype)
    expected = F.rms_norm(x.float(), (shape[1],), w.float(), eps=1e-5)
    _close(ops.rms_norm(x, w, 1e-5), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_in_place(ops, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(40, 576).to(dtype), torch.randn(40, 576).to(dtype)
    w = torch.randn(576).to(dtype)
    summed = (x.float() + residual.float()).to(dtype)  # the residual stream is rounded
    expected = F.rms_norm(summed.float(), (576,), w.float(), eps=1e-6)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, summed)
    _close(x, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 40])
def test_silu_and_mul(ops, dtype: torch.dtype, d: int) -> None:
    torch.manual_seed(2)
    x = (torch.randn(17, 2 * d) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = x.float().split(d, dim=-1)
    _close(ops.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_on_the_fused_qkv_rows(ops, dtype: torch.dtype) -> None:
    """Rotates the first 12 heads of each [q | k | v] row in place, leaves v alone."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, n = 9, 3, 64, 21
    rotary = RotaryEmbedding(head_dim, 2048, 100000.0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2047] + list(range(500, 518)), dtype=torch.int64)
    rotated = (heads + kv_heads) * head_dim
    cos, sin = rotary.tables(positions, torch.float32)
    qk = qkv[:, :rotated].float().view(n, heads + kv_heads, head_dim)
    expected = apply_rotary(qk, cos, sin).view(n, rotated)
    before_v = qkv[:, rotated:].clone()
    ops.rotary_embedding(qkv, positions, rotary.cos, rotary.sin, heads + kv_heads, head_dim)
    _close(qkv[:, :rotated], expected, dtype)
    assert torch.equal(qkv[:, rotated:], before_v)


def test_rotary_rejects_positions_outside_the_table(ops) -> None:
    rotary = RotaryEmbedding(64, 16, 10000.0)
    qkv = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_embedding(qkv, torch.tensor([16]), rotary.cos, rotary.sin, 1, 64)
