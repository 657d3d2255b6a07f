"""RoPE frequencies of every implemented type equal transformers' own, bit for bit, and a
GGUF file's frequency factors (llama.cpp's form of Llama 3.1 scaling) give the same RoPE;
Phi-3's longrope tables equal transformers' with its short and with its long factors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pagedinfer.model.arch_config import ROPE_SCALING_KEYS, ModelArchConfig, RopeScaling
from pagedinfer.model.rotary import RotaryEmbedding, inverse_frequencies, uses_long_factors

transformers = pytest.importorskip("transformers", reason="transformers' RoPE is the reference")

CASES: list[dict[str, Any]] = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
     "attention_factor": 1.25, "truncate": False},
]  # fmt: skip


def _hf(params: dict[str, Any], head_dim: int, base: float) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=131072, rope_parameters={**params, "rope_theta": base},
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize(("head_dim", "base"), [(64, 500000.0), (128, 1000000.0), (16, 10000.0)])
def test_frequencies_equal_transformers(params: dict[str, Any], head_dim: int, base: float) -> None:
    expected, expected_factor = _hf(params, head_dim, base)
    fields = {k: v for k, v in params.items() if k in ROPE_SCALING_KEYS[params["rope_type"]]}
    ours, factor = inverse_frequencies(
        head_dim, base, RopeScaling(rope_type=params["rope_type"], **fields), 131072
    )
    assert torch.equal(ours, expected)
    assert factor == pytest.approx(expected_factor, rel=0, abs=0)


def test_plain_rope_is_unscaled() -> None:
    inv_freq, factor = inverse_frequencies(64, 10000.0, None, 2048)
    assert factor == 1.0 and inv_freq[0] == 1.0 and inv_freq.shape == (32,)


def _llama_cpp_factors(head_dim: int, base: float, p: dict[str, Any]) -> list[float]:
    """llama.cpp's converter: one factor per frequency, written as `rope_freqs`."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / p["low_freq_factor"], old / p["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (old / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return factors


def test_gguf_frequency_factors_give_llama3_rope() -> None:
    params = CASES[2]
    expected, _ = _hf(params, 64, 500000.0)
    factors = torch.tensor(_llama_cpp_factors(64, 500000.0, params), dtype=torch.float32)
    scaling = RopeScaling("llama3", factor=1.0, freq_factors=tuple(factors.tolist()))
    ours, factor = inverse_frequencies(64, 500000.0, scaling, 131072)
    assert factor == 1.0
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


def test_tables_scale_cos_and_sin_by_the_attention_factor() -> None:
    config = ModelArchConfig(
        vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(1,),
        rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16,
                                 attention_factor=1.5),
    )  # fmt: skip
    plain = RotaryEmbedding(16, 64, 10000.0)
    scaled = RotaryEmbedding.of(config, 64)
    assert torch.equal(scaled.cos[0], torch.full((16,), 1.5))  # position 0: cos 1, scaled
    assert not torch.equal(scaled.cos[5] / 1.5, plain.cos[5])  # and the frequencies differ


@pytest.mark.parametrize("head_dim", [16, 96])
@pytest.mark.parametrize(
    "given", [{}, {"factor": 2.0}, {"attention_factor": 1.25}], ids=["derived", "factor", "attn"]
)
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_tables_equal_transformers(head_dim: int, given: dict[str, float], long: bool):
    """transformers' Phi3RotaryEmbedding picks the factors per call (long iff the call's
    last position + 1 > original_max_position_embeddings); ours are picked once, by
    max_model_len: equal tables for a call up to the original context with max_model_len
    at most it, and for a longer call with a longer max_model_len."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    gen = torch.Generator().manual_seed(head_dim)
    short = (1 + 0.3 * torch.rand(head_dim // 2, generator=gen)).tolist()
    long_factor = (1 + 20 * torch.rand(head_dim // 2, generator=gen) ** 2).tolist()
    base, original, max_positions = 10000.0, 64, 256
    params = {"rope_type": "longrope", "short_factor": short, "long_factor": long_factor, **given}
    config = transformers.Phi3Config(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_positions,
        original_max_position_embeddings=original, rope_parameters={**params, "rope_theta": base},
    )  # fmt: skip
    num_positions = 200 if long else original
    x = torch.zeros(1, num_positions, head_dim)
    cos, sin = Phi3RotaryEmbedding(config)(x, torch.arange(num_positions)[None])
    scaling = RopeScaling(
        "longrope", factor=given.get("factor", max_positions / original),
        original_max_position_embeddings=original, short_factor=tuple(short),
        long_factor=tuple(long_factor), attention_factor=given.get("attention_factor"),
    )  # fmt: skip
    assert uses_long_factors(scaling, num_positions) is long
    ours = RotaryEmbedding(head_dim, max_positions, base, scaling, max_positions, num_positions)
    assert torch.equal(ours.cos[:num_positions], cos[0])
    assert torch.equal(ours.sin[:num_positions], sin[0])
    # The other factors give other tables: the choice is real.
    other = RotaryEmbedding(head_dim, max_positions, base, scaling, max_positions,
                            original + 1 if not long else original)  # fmt: skip
    assert not torch.equal(other.cos[:num_positions], cos[0])


def test_longrope_switches_above_the_original_context() -> None:
    scaling = RopeScaling(
        "longrope", factor=4.0, original_max_position_embeddings=64,
        short_factor=(1.0,) * 8, long_factor=(2.0,) * 8,
    )  # fmt: skip
    assert [uses_long_factors(scaling, n) for n in (1, 64, 65, 256)] == [False, False, True, True]
    # max_model_len None: the model's context length (256 > 64), as vLLM's default.
    _, factor = inverse_frequencies(16, 10000.0, scaling, 256)
    inv_freq = inverse_frequencies(16, 10000.0, scaling, 256)[0]
    assert float(inv_freq[1]) == pytest.approx(10000.0 ** -(2 / 16) / 2.0, rel=1e-6)
    assert factor == math.sqrt(1 + math.log(4.0) / math.log(64))
