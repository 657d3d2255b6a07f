"""Rotary position embeddings: the frequencies of each RoPE type, and the cos/sin tables.

`inverse_frequencies(head_dim, base, scaling, max_position_embeddings, max_model_len)`
gives the per-pair inverse frequencies and the factor cos and sin are scaled by, for plain
RoPE and for the scalings of `RopeScaling` (`linear`, `llama3`, `yarn`, `longrope`, and a
GGUF file's per-frequency factors). The float32 operations follow Hugging Face's
definitions step by step, so the tables, and hence greedy outputs in float32, equal
transformers'. Only longrope depends on `max_model_len` (the engine's longest sequence): it
picks its long or short factors once, for every position (`uses_long_factors` says why,
and where that differs from transformers).

`RotaryEmbedding` holds the tables for every position (the fused C++ kernel reads them by
position); `Rope` is one step's view of them, shared by every layer; `apply_rotary` is the
torch path's rotate-half.

Callers: the decoder (`model/llama.py`) and the worker (which builds the tables once the
model's length is known).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedinfer.model.arch_config import ModelArchConfig, RopeScaling

__all__ = [
    "Rope",
    "RotaryEmbedding",
    "apply_rotary",
    "inverse_frequencies",
    "uses_long_factors",
]


def _plain(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)  # [head_dim / 2]


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between
    blended smoothly."""
    old_len = s.original_max_position_embeddings or max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def _yarn(head_dim: int, base: float, s: RopeScaling, max_position_embeddings: int) -> torch.Tensor:
    """YaRN: dimensions that rotate fast over the original context are extrapolated (kept),
    slow ones interpolated (divided by `factor`), with a linear ramp between."""
    old_len = s.original_max_position_embeddings or max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # the extrapolated share of each dimension
    return interpolation * (1 - keep) + extrapolation * keep


def uses_long_factors(scaling: RopeScaling, max_model_len: int) -> bool:
    """Whether longrope runs its long factors: iff the engine's sequences may be longer than
    the original context (vLLM's rule).

    transformers switches per forward call instead: long iff the call's last position + 1
    exceeds the original context, and its `generate` recomputes the whole cache with the
    long factors once a sequence crosses it. A batch here mixes requests, and chunked
    prefill or a prefix-cache hit would make one sequence's cache hold both kinds, so the
    choice is made once for the engine. The two agree when every sequence stays within the
    original context and max_model_len does too (short factors both), or when every prompt
    is longer than it (long factors both); a sequence that starts shorter under a longer
    max_model_len runs the long factors here and the short ones in transformers until it
    crosses."""
    assert scaling.original_max_position_embeddings is not None
    return max_model_len > scaling.original_max_position_embeddings


def _longrope(
    head_dim: int, base: float, s: RopeScaling, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its factor, cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original context)) unless `attention_factor` is given."""
    long = uses_long_factors(s, max_model_len)
    factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (factors * base**exponents)  # [head_dim / 2]
    original = s.original_max_position_embeddings
    assert original is not None
    if s.attention_factor is not None:
        return inv_freq, s.attention_factor
    if s.factor <= 1.0:
        return inv_freq, 1.0
    return inv_freq, math.sqrt(1 + math.log(s.factor) / math.log(original))


def inverse_frequencies(
    head_dim: int,
    base: float,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, the factor cos and sin are scaled by).
    `max_model_len`: the longest sequence the engine runs (None: `max_position_embeddings`);
    only longrope reads it."""
    if scaling is None:
        return _plain(head_dim, base), 1.0
    if scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.numel() != head_dim // 2:
            raise ValueError(f"{factors.numel()} RoPE frequency factors for head_dim {head_dim}")
        return _plain(head_dim, base) / factors, 1.0
    if scaling.rope_type == "linear":
        inv_freq = _plain(head_dim, base)
        inv_freq /= scaling.factor
        return inv_freq, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(_plain(head_dim, base), scaling, max_position_embeddings), 1.0
    if scaling.rope_type == "yarn":
        inv_freq = _yarn(head_dim, base, scaling, max_position_embeddings)
        return inv_freq, _yarn_attention_factor(scaling)
    if scaling.rope_type == "longrope":
        return _longrope(head_dim, base, scaling, max_model_len or max_position_embeddings)
    raise ValueError(f"RoPE type {scaling.rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling | None = None,
        max_position_embeddings: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(
            head_dim, base, scaling, max_position_embeddings or max_position, max_model_len
        )
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def of(
        cls, config: ModelArchConfig, max_position: int, max_model_len: int | None = None
    ) -> RotaryEmbedding:
        """The tables of `config`'s RoPE for positions [0, max_position), for an engine whose
        sequences are at most `max_model_len` long (None: the model's context length)."""
        return cls(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, max_model_len,
        )  # fmt: skip

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, [num_tokens, 1, head_dim]; computed once per
        forward pass and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class Rope:
    """One step's rotary inputs, shared by every layer: the positions, and the per-token
    cos/sin rows gathered on first use (the torch path; the fused kernel reads the full
    tables by position)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        self.rotary = rotary
        self.positions = positions
        self.dtype = dtype
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary.tables(self.positions, self.dtype)
        return self._tables


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (q and k heads may be stacked together)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
