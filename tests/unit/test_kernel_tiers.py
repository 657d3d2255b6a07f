"""The C++ kernels' instruction-set tiers (kernels/cpu.py): every tier below this CPU's own
is built here (`load_cpu_kernels(isa=...)`, as `PAGEDINFER_MAX_CPU_ISA` would choose it)
and each of its entry points gives what this CPU's own build gives, up to summation order
(both are checked against torch elsewhere: tests/unit/model/test_quant.py, test_kquant.py,
test_fused_ops.py, tests/unit/attention/). On the 2-core CI machines (AVX2) that is the
`none` tier: one extra build, about a minute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedinfer.kernels.cpu import ISA_TIERS, cpu_isa, kernel_isa, load_cpu_kernels
from pagedinfer.model.quant import QuantBlocks, QuantizedWeight
from pagedinfer.model.rotary import RotaryEmbedding
from tests.unit.model.test_kquant import KINDS, random_raw

NATIVE = cpu_isa()
LOWER = list(ISA_TIERS[: ISA_TIERS.index(NATIVE)]) if NATIVE in ISA_TIERS else []


def test_the_cap_chooses_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDINFER_MAX_CPU_ISA", raising=False)
    assert kernel_isa() == NATIVE
    monkeypatch.setenv("PAGEDINFER_MAX_CPU_ISA", "AMX")  # above any CPU's: no change
    assert kernel_isa() == NATIVE
    if NATIVE in ISA_TIERS:
        monkeypatch.setenv("PAGEDINFER_MAX_CPU_ISA", "none")
        assert kernel_isa() == "none"
    monkeypatch.setenv("PAGEDINFER_MAX_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="PAGEDINFER_MAX_CPU_ISA='avx3'.*none, avx2, avx512, amx"):
        kernel_isa()
    if NATIVE != "amx":
        with pytest.raises(ValueError, match="cannot run on this CPU"):
            load_cpu_kernels(isa="amx")


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    got, want = got.double(), want.double()
    atol = rtol * max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.skipif(not LOWER, reason=f"no tier below this CPU's ({NATIVE})")
@pytest.mark.parametrize("tier", LOWER)
def test_lower_tier_gives_the_native_results(tier: str) -> None:
    native, lower = load_cpu_kernels(), load_cpu_kernels(isa=tier)
    if native is None or lower is None:
        pytest.skip("the C++ kernels cannot be built here")
    assert lower.__name__.startswith(f"pagedinfer_cpu_kernels_{tier}_")
    assert not lower.prefill_attention_available() or tier in ("amx", "avx512")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        x = torch.randn(7, 576, generator=g).to(dtype)
        w = torch.rand(576, generator=g).to(dtype)
        _close(lower.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), rtol)
        pair = [x.clone(), (x * 2).clone()], [x.clone(), (x * 2).clone()]
        for ops, (a, b) in zip((lower, native), pair):
            ops.fused_add_rms_norm(a, b, w, 1e-6)
        _close(pair[0][0], pair[1][0], rtol)
        _close(pair[0][1], pair[1][1], rtol)
        gu = torch.randn(5, 2 * 1536, generator=g).to(dtype) * 3
        _close(lower.silu_and_mul(gu), native.silu_and_mul(gu), rtol)
        _close(lower.gelu_tanh_and_mul(gu), native.gelu_tanh_and_mul(gu), rtol)
        rotary = RotaryEmbedding(64, 512, 10000.0)
        qkv = [torch.randn(6, 5 * 64, generator=torch.Generator().manual_seed(1)).to(dtype)] * 2
        qkv = [t.clone() for t in qkv]
        positions = torch.tensor([0, 1, 7, 100, 300, 511])
        for ops, t in zip((lower, native), qkv):
            ops.rotary_embedding(t, positions, rotary.cos, rotary.sin, 4, 64)
        _close(qkv[0], qkv[1], rtol)
        # Paged decode attention: 3 requests over shuffled blocks, GQA 9:3, window and cap.
        seq_lens = torch.tensor([5, 40, 77], dtype=torch.int32)
        kc = torch.randn(20, 16, 3, 64, generator=g).to(dtype)
        vc = torch.randn(20, 16, 3, 64, generator=g).to(dtype)
        table = torch.randperm(20, generator=g)[:18].view(3, 6).int()
        q = torch.randn(3, 9, 64, generator=g).to(dtype)
        for window, cap in ((0, 0.0), (24, 30.0)):
            args = (q, kc, vc, table, seq_lens, 0.125, window, cap)
            _close(lower.paged_decode_attention(*args), native.paged_decode_attention(*args), rtol)
        logits = torch.randn(4, 1000, generator=g).to(dtype)
        assert torch.equal(lower.argmax_rows(logits), native.argmax_rows(logits))
    # Quantised products: float32 activations are exact codes and float32 sums in every tier.
    rng = np.random.default_rng(0)
    scale = rng.uniform(1e-3, 2e-2, (40, 18)).astype(np.float16).astype(np.float32)
    q4 = QuantBlocks("Q4", rng.integers(0, 256, (40, 288), dtype=np.uint8), scale, -8 * scale)
    q8 = QuantBlocks("Q8", rng.integers(-127, 128, (40, 576), dtype=np.int8), scale, None)
    x = torch.randn(11, 576, generator=g)
    for blocks in [q4, q8] + [random_raw(kind, 40, 512) for kind in KINDS]:
        xb = x[:, : blocks.cols].contiguous()
        for rows in (1, 4, 11):
            want = QuantizedWeight(blocks, native)(xb[:rows])
            _close(QuantizedWeight(blocks, lower)(xb[:rows]), want)


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in LOWER, reason=f"no avx2 tier below this CPU's ({NATIVE})")
def test_int8_kquant_paths_agree_bit_for_bit_across_tiers() -> None:
    """int8 activations are exact integer sums and the same float operations in every
    kernel (AVX2: few-row kernel below 9 rows, ymm tile GEMM from 9; AVX512-VNNI: zmm
    few-row kernel below 32, tile GEMM from 32), so every tier gives identical bits."""
    native, lower = load_cpu_kernels(), load_cpu_kernels(isa="avx2")
    if native is None or lower is None:
        pytest.skip("the C++ kernels cannot be built here")
    assert native.kquant_linear_uses_int8_activations()
    assert lower.kquant_linear_uses_int8_activations()
    x = torch.randn(45, 1024, generator=torch.Generator().manual_seed(3))
    for kind in KINDS:
        blocks = random_raw(kind, 70, 1024, seed=5)  # 70 features: a partial last block
        for rows in (1, 5, 8, 9, 13, 32, 45):
            for dtype in (torch.float32, torch.bfloat16):
                xb = x[:rows].to(dtype)
                want = QuantizedWeight(blocks, native, "int8")(xb)
                got = QuantizedWeight(blocks, lower, "int8")(xb)
                assert torch.equal(got, want), (kind, rows, dtype)
