"""The quantised decode path: the file's own Q4/Q8 blocks, their packing and the C++ kernel.

The float32-activation kernel must equal the dense product up to summation order; the int8
(VNNI) path for 16-bit activations is checked against an exact emulation of what it
computes (per-group int8 activations, integer dot products, float scales).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedinfer.gguf_metadata import find_default_model
from pagedinfer.kernels.cpu import load_cpu_kernels
from pagedinfer.model.gguf import GGUFFile
from pagedinfer.model.linear import Linear
from pagedinfer.model.loader import load_model_weights, load_quant_blocks
from pagedinfer.model.quant import QuantBlocks, QuantizedWeight, QuantMatrix, quantize_q8_0
from tests.unit.model.test_gguf import HI, LO, T_Q4_0, _f16, _nibble_bytes, _write

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="C++ kernels not buildable here")


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> QuantBlocks:
    rng = np.random.default_rng(seed)
    groups = cols // 32
    # float16-representable scales/offsets, as in a file.
    scale = rng.uniform(0.001, 0.02, (rows, groups)).astype(np.float16).astype(np.float32)
    if kind == "Q4":
        codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        offset = rng.uniform(-0.15, 0.0, (rows, groups)).astype(np.float16).astype(np.float32)
        return QuantBlocks("Q4", codes, scale, offset)
    return QuantBlocks("Q8", rng.integers(-127, 128, (rows, cols), dtype=np.int8), scale, None)


# ---- blocks read from files -----------------------------------------------------------------


def test_default_model_blocks_are_the_file_values() -> None:
    f = GGUFFile(find_default_model())
    for name, kind in (("token_embd.weight", "Q8"), ("blk.3.attn_q.weight", "Q4")):
        blocks = f.load_quant_blocks(name)
        assert blocks is not None and blocks.kind == kind
        np.testing.assert_array_equal(blocks.dequantize(), f.load_tensor(name), err_msg=name)
    assert f.load_quant_blocks("blk.0.attn_norm.weight") is None  # F32


def test_q4_0_is_an_offset_of_minus_eight_scales(tmp_path: Path) -> None:
    raw = _f16(2.0) + _nibble_bytes(LO, HI) + _f16(-0.5) + _nibble_bytes(HI, LO)
    f = _write(tmp_path, [], [("w", T_Q4_0, [32, 2], raw)])
    blocks = f.load_quant_blocks("w")
    assert blocks is not None and blocks.kind == "Q4"
    np.testing.assert_array_equal(blocks.offset, -8.0 * blocks.scale)
    np.testing.assert_array_equal(blocks.dequantize(), f.load_tensor("w"))


def test_loader_blocks_undo_the_rope_permutation_like_the_dense_weights() -> None:
    config, dense = load_model_weights(None, torch.float32)
    blocks = load_quant_blocks(None, config)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        np.testing.assert_array_equal(blocks[name].dequantize(), dense[name].numpy(), err_msg=name)


def test_quantize_q8_0_bounds_the_error() -> None:
    w = torch.randn(24, 96) * torch.logspace(-3, 0, 96)  # columns of very different sizes
    blocks = quantize_q8_0(w)
    assert blocks.codes.dtype == np.int8 and np.abs(blocks.codes).max() <= 127
    np.testing.assert_array_equal(blocks.scale.astype(np.float16).astype(np.float32), blocks.scale)
    err = np.abs(blocks.dequantize() - w.numpy()).reshape(24, 3, 32)
    assert (err <= blocks.scale[..., None] * 0.5 + 1e-7).all()


# ---- the kernel ------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4", "Q8"])
@pytest.mark.parametrize("shape", [(40, 64), (960, 576), (16, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
def test_float32_activations_equal_the_dense_product(kind: str, shape, rows: int) -> None:
    """Exact codes, float32 sums: only summation order differs from the dense product.
    40 features pad to 3 blocks of 16; 9 and 17 rows cross the kernel's 8-row passes."""
    blocks = _random_blocks(kind, *shape)
    weight = QuantizedWeight(blocks, kernels)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    out = weight(x)
    assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
    ref = x.double() @ torch.from_numpy(blocks.dequantize()).double().T
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6 * ref.abs().max().item())


def _int8_path_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """What the VNNI path computes: per group of 32, x codes = round-half-even(x * 127 /
    max|x|), integer dot products with the weight codes, then float scales."""
    xf = x.float().numpy().astype(np.float64)
    rows, cols = xf.shape
    g = xf.reshape(rows, cols // 32, 32)
    amax = np.abs(g).max(axis=2, keepdims=True).astype(np.float32)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(g.astype(np.float32) * inv).astype(np.int64)  # [rows, groups, 32]
    xscale = (amax / np.float32(127.0)).astype(np.float64)[..., 0]  # [rows, groups]
    n, groups = blocks.scale.shape
    if blocks.kind == "Q4":
        packed = blocks.codes.reshape(n, groups, 16)
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=2).astype(np.int64)
    else:
        q = blocks.codes.reshape(n, groups, 32).astype(np.int64)
    dots = np.einsum("rgk,ngk->rng", xq, q).astype(np.float64)  # exact integers
    out = np.einsum("rng,ng,rg->rn", dots, blocks.scale.astype(np.float64), xscale)
    if blocks.offset is not None:
        out += np.einsum("ng,rg->rn", blocks.offset.astype(np.float64), g.sum(axis=2))
    return torch.from_numpy(out)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4", "Q8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 8, 11, 16, 23, 100])
def test_16_bit_activations(kind: str, dtype: torch.dtype, rows: int) -> None:
    blocks = _random_blocks(kind, 48, 576, seed=1)
    weight = QuantizedWeight(blocks, kernels)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = weight(x)
    assert out.dtype == dtype and out.shape == (rows, 48)
    dense = x.double() @ torch.from_numpy(blocks.dequantize()).double().T
    # Close to the dense product in any case (int8 activations or not) ...
    assert ((out.double() - dense).abs().max() / dense.abs().max()).item() < 2e-2
    if kernels.quant_linear_uses_int8_activations():
        # ... and exactly what the int8 path defines, up to float32 sums and the final
        # rounding to the 16-bit dtype.
        ref = _int8_path_reference(x, blocks)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.double(), ref, rtol=eps, atol=1e-5 * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4", "Q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "rows"), [((40, 64), 16), ((48, 96), 23), ((960, 576), 100)])
def test_a_row_gives_the_same_result_in_any_batch(kind, dtype, shape, rows: int) -> None:
    """From 16 rows the int8 path runs as a register-blocked GEMM over tiles of 6 rows and
    pairs of 16-feature blocks; each output must still be bit-identical to that row's
    product alone (the few-row kernel): 40 features end in an unpaired, padded block, 23
    and 100 rows in a partial tile, 100 rows span several work items."""
    assert_rows_batch_invariant(_random_blocks(kind, *shape, seed=rows), rows, dtype)


def assert_rows_batch_invariant(blocks: QuantMatrix, rows: int, dtype: torch.dtype) -> None:
    """`rows` random int8-path rows through `blocks` at once equal each row alone, bit for bit."""
    weight = QuantizedWeight(blocks, kernels, "int8")
    x = torch.randn(rows, blocks.cols, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = weight(x)
    alone = torch.cat([weight(x[i : i + 1]) for i in range(rows)])
    assert together.dtype == dtype and torch.equal(together, alone)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4", "Q8"])
def test_activation_modes(kind: str) -> None:
    """ "auto": float32 activations exact, 16-bit ones int8; "int8" rounds float32 ones too
    (exactly the int8 path's arithmetic); "float32" keeps 16-bit ones exact."""
    blocks = _random_blocks(kind, 48, 576, seed=5)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    exact = QuantizedWeight(blocks, kernels, "float32")(x)
    assert torch.equal(QuantizedWeight(blocks, kernels)(x), exact)
    int8 = QuantizedWeight(blocks, kernels, "int8")(x)
    if kernels.quant_linear_uses_int8_activations():
        ref = _int8_path_reference(x, blocks)
        torch.testing.assert_close(
            int8.double(), ref, rtol=1e-6, atol=1e-5 * ref.abs().max().item()
        )
        assert not torch.equal(int8, exact)
    else:
        assert torch.equal(int8, exact)
    xb = x.bfloat16()
    dense = xb.double() @ torch.from_numpy(blocks.dequantize()).double().T
    out = QuantizedWeight(blocks, kernels, "float32")(xb)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.double(), dense, rtol=eps, atol=1e-5 * dense.abs().max().item())
    with pytest.raises(ValueError, match="activations must be one of"):
        QuantizedWeight(blocks, kernels, "int4")


@needs_kernels
def test_bad_inputs_are_rejected() -> None:
    weight = QuantizedWeight(_random_blocks("Q4", 16, 64), kernels)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        weight(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="packed weights"):
        weight(torch.zeros(1, 96))


@needs_kernels
def test_linear_uses_the_quantised_path_for_small_steps_only() -> None:
    blocks = _random_blocks("Q4", 32, 64)
    layer = Linear(64, 32)
    layer.weight.data = torch.from_numpy(blocks.dequantize())
    layer.set_quant(QuantizedWeight(blocks, kernels), max_rows=2)
    small, big = torch.randn(2, 64), torch.randn(3, 64)
    assert torch.equal(layer(small), QuantizedWeight(blocks, kernels)(small))
    assert torch.equal(layer(big), F.linear(big, layer.weight))
    with pytest.raises(ValueError, match="shape"):
        layer.set_quant(QuantizedWeight(_random_blocks("Q4", 16, 64), kernels), max_rows=2)


def test_default_cutoffs_per_tier() -> None:
    """The measured crossovers (worker._QUANT_MAX_TOKENS): with int8 activations on AVX-512
    (the VNNI GEMM) and AVX2 every step of the default token budget; 64 on AVX2 with exact
    float32 activations; 32 elsewhere."""
    from pagedinfer.worker.worker import default_quant_max_tokens

    assert default_quant_max_tokens("avx512", True) == 2048
    assert default_quant_max_tokens("avx2", True) == 2048
    assert default_quant_max_tokens("avx2", False) == 64
    assert default_quant_max_tokens("avx512", False) == 32
    assert default_quant_max_tokens("amx", True) == 32
