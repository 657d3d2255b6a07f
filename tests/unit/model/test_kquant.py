"""The quantised decode path for Q5_0, Q4_K, Q5_K and Q6_K (what Q4_K_M files mix): the
file's raw blocks, their unpacking and "planes" packing, and the C++ kernel.

The file reader's dequantisation (tests/unit/model/test_gguf.py: equal to the gguf
package's) is the reference: unpacked fields rebuild it exactly, and float32 activations
give the dense product up to summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedinfer.gguf_metadata import find_gemma3_270m
from pagedinfer.kernels.cpu import load_cpu_kernels
from pagedinfer.model.gguf import GGUFFile
from pagedinfer.model.linear import Linear
from pagedinfer.model.quant import (
    RAW_FORMATS,
    QuantBlocks,
    QuantizedParts,
    QuantizedWeight,
    RawBlocks,
    concat_blocks,
)
from tests.unit.model.test_quant import assert_rows_batch_invariant

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="C++ kernels not buildable here")

KINDS = list(RAW_FORMATS)
# Where each format keeps its float16 d (and dmin): random bytes there could be inf/NaN.
_HALVES = {"Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_raw(kind: str, rows: int, cols: int, seed: int = 0) -> RawBlocks:
    """Random blocks of `kind` with finite, model-sized scales (codes, sub-block scales and
    mins take every bit pattern)."""
    fmt = RAW_FORMATS[kind]
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    data = rng.integers(0, 256, (rows, nb, fmt.type_size), dtype=np.uint8)
    for at in _HALVES[kind]:
        half = rng.uniform(2e-4, 2e-3 if kind != "Q5_0" else 2e-2, (rows, nb)).astype(np.float16)
        data[..., at : at + 2] = half[..., None].view(np.uint8).reshape(rows, nb, 2)
    return RawBlocks(kind, data)


@pytest.mark.parametrize("kind", KINDS)
def test_unpacked_fields_rebuild_the_dequantised_weights(kind: str) -> None:
    blocks = random_raw(kind, 5, 512 if kind != "Q5_0" else 96)
    fmt = blocks.format
    codes, d, dmin, scales, mins = blocks.unpack()
    assert codes.max() < 2**fmt.bits
    assert codes.shape == (5, blocks.cols // fmt.block_size, fmt.block_size)
    zero = {"Q5_0": 16, "Q6_K": 32}.get(kind, 0)
    sub = scales.astype(np.float32).repeat(fmt.sub, axis=2)  # [rows, blocks, block_size]
    w = d.astype(np.float32)[..., None] * sub * (codes.astype(np.float32) - zero)
    if mins is not None:
        assert dmin is not None
        w -= dmin.astype(np.float32)[..., None] * mins.astype(np.float32).repeat(fmt.sub, axis=2)
    np.testing.assert_allclose(w.reshape(5, -1), blocks.dequantize(), rtol=1e-6, atol=1e-9)


def test_gemma_file_blocks_are_the_file_values() -> None:
    f = GGUFFile(find_gemma3_270m())
    seen = set()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight",
                 "blk.0.attn_v.weight"):  # fmt: skip
        blocks = f.load_quant_blocks(name)
        assert blocks is not None
        seen.add(blocks.kind)
        np.testing.assert_array_equal(blocks.dequantize(), f.load_tensor(name), err_msg=name)
    assert seen == {"Q5_0", "Q4_K", "Q6_K", "Q8"}


def test_rows_and_columns_of_raw_blocks() -> None:
    blocks = random_raw("Q4_K", 6, 768)
    dense = blocks.dequantize()
    np.testing.assert_array_equal(blocks.take_rows(np.array([4, 0])).dequantize(), dense[[4, 0]])
    np.testing.assert_array_equal(blocks.take_cols(256, 768).dequantize(), dense[:, 256:])
    with pytest.raises(ValueError, match="Q4_K blocks of 256"):
        blocks.take_cols(0, 384)
    joined = concat_blocks([blocks, blocks.take_rows(np.array([1]))])
    assert isinstance(joined, RawBlocks) and joined.rows == 7
    assert concat_blocks([blocks, random_raw("Q6_K", 2, 768)]) is None
    q8 = QuantBlocks("Q8", np.zeros((2, 768), np.int8), np.ones((2, 24), np.float32), None)
    assert concat_blocks([blocks, q8]) is None and concat_blocks([q8, blocks]) is None


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(40, 512), (17, 256)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11])
def test_float32_activations_equal_the_dense_product(kind: str, shape, rows: int) -> None:
    """Exact codes, float32 sums: only summation order differs from the dense product.
    40 and 17 features pad to blocks of 16; 11 rows cross the kernel's 8-row passes, 5
    switches it to one accumulator chain per row."""
    blocks = random_raw(kind, *shape, seed=rows)
    weight = QuantizedWeight(blocks, kernels)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    out = weight(x)
    assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
    ref = x.double() @ torch.from_numpy(blocks.dequantize()).double().T
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6 * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations(kind: str, dtype: torch.dtype) -> None:
    """16-bit activations taken as float32 widen exactly: the same sums, one final rounding.
    By default ("auto") they are rounded to int8 where the build has the integer path."""
    blocks = random_raw(kind, 48, 512, seed=3)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = QuantizedWeight(blocks, kernels, "float32")(x)
    assert out.dtype == dtype
    ref = x.double() @ torch.from_numpy(blocks.dequantize()).double().T
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=eps, atol=1e-5 * ref.abs().max().item())
    auto = QuantizedWeight(blocks, kernels)(x)
    if kernels.kquant_linear_uses_int8_activations():
        ref = int8_path_reference(x, blocks)
    torch.testing.assert_close(auto.double(), ref, rtol=eps, atol=1e-5 * ref.abs().max().item())


def int8_path_reference(x: torch.Tensor, blocks: RawBlocks) -> torch.Tensor:
    """What the int8 path computes: per group of 32, x codes = round-half-even(x * 127 /
    max|x|); per sub-block, the exact integer dot product of those codes with the weight
    codes less the zero point, times the sub-block scale and the group's x scale; less the
    sub-block min times the group's float sum of x."""
    fmt = blocks.format
    codes, d, dmin, scales, mins = blocks.unpack()
    zero = {"Q5_0": 16, "Q6_K": 32}.get(blocks.kind, 0)
    n, nb, size = codes.shape
    xf = x.float().numpy()
    rows, cols = xf.shape
    g = xf.reshape(rows, cols // 32, 32)
    amax = np.abs(g).max(axis=2, keepdims=True)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(g * inv).astype(np.int64)
    xscale = (amax / np.float32(127.0)).astype(np.float64)[..., 0]  # [rows, groups]
    per_sub = size // fmt.sub
    q = (codes.astype(np.int64) - zero).reshape(n, nb, per_sub, fmt.sub)
    dots = np.einsum("rbsk,nbsk->rnbs", xq.reshape(rows, nb, per_sub, fmt.sub), q)
    sub_scale = d.astype(np.float64)[..., None] * scales.astype(np.float64)  # [n, nb, subs]
    x_scale = np.repeat(xscale, 32 // fmt.sub, axis=1).reshape(rows, nb, per_sub)
    out = np.einsum("rnbs,nbs,rbs->rn", dots.astype(np.float64), sub_scale, x_scale)
    if mins is not None:
        assert dmin is not None and fmt.sub == 32
        sub_min = dmin.astype(np.float64)[..., None] * mins.astype(np.float64)
        sums = g.astype(np.float64).sum(axis=2).reshape(rows, nb, per_sub)
        out -= np.einsum("nbs,rbs->rn", sub_min, sums)
    return torch.from_numpy(out)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 29])
def test_int8_activations_are_the_integer_path(kind: str, rows: int) -> None:
    """quant_activations="int8": exactly the integer arithmetic above (float32 sums of the
    sub-blocks' terms), within int8 rounding of the dense product; without the integer
    path, the float32 one."""
    blocks = random_raw(kind, 40, 768, seed=10 + rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    out = QuantizedWeight(blocks, kernels, "int8")(x)
    exact = QuantizedWeight(blocks, kernels, "float32")(x)
    if not kernels.kquant_linear_uses_int8_activations():
        assert torch.equal(out, exact)
        return
    ref = int8_path_reference(x, blocks)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5 * ref.abs().max().item())
    assert not torch.equal(out, exact)
    dense = x.double() @ torch.from_numpy(blocks.dequantize()).double().T
    assert ((out.double() - dense).abs().max() / dense.abs().max()).item() < 2e-2


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "rows"), [((40, 512), 9), ((40, 512), 34), ((96, 768), 61)])
def test_a_row_gives_the_same_result_in_any_batch(kind: str, dtype, shape, rows: int) -> None:
    """From 32 rows the int8 path runs as a register-blocked GEMM (tiles of 6 rows, pairs of
    16-feature blocks; AVX512-VNNI): each output must be bit-identical to that row's product
    alone (the few-row kernel; 9 rows: its passes of 8 rows and of 1). 40 features end in
    an unpaired, padded block; 34 and 61 rows in a partial tile, across several work
    items."""
    assert_rows_batch_invariant(random_raw(kind, *shape, seed=rows), rows, dtype)


@needs_kernels
def test_mixed_formats_of_one_fused_projection() -> None:
    """Gemma 3's q/k (Q5_0) and v (Q8_0): one kernel per part, outputs side by side."""
    parts = [random_raw("Q5_0", 32, 640), random_raw("Q5_0", 16, 640, seed=1)]
    rng = np.random.default_rng(2)
    scale = rng.uniform(1e-3, 2e-2, (16, 20)).astype(np.float16).astype(np.float32)
    parts.append(QuantBlocks("Q8", rng.integers(-127, 128, (16, 640), dtype=np.int8), scale, None))
    assert concat_blocks(parts) is None
    fused = QuantizedParts([QuantizedWeight(p, kernels) for p in parts])
    assert (fused.out_features, fused.in_features, fused.kind) == (64, 640, "Q5_0+Q5_0+Q8")
    layer = Linear(640, 64)
    layer.set_quant(fused, max_rows=4)
    x = torch.randn(3, 640)
    dense = np.concatenate([p.dequantize() for p in parts])
    ref = x.double() @ torch.from_numpy(dense).double().T
    out = layer(x)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6 * ref.abs().max().item())


@needs_kernels
def test_bad_inputs_are_rejected() -> None:
    weight = QuantizedWeight(random_raw("Q6_K", 16, 256), kernels)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        weight(torch.zeros(1, 288))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        weight(torch.zeros(1, 256, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="unknown K-quant format 7"):
        kernels.kquant_linear(torch.zeros(1, 256), weight.packed, 7, 16, False)
