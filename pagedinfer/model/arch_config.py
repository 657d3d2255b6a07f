"""The architecture of a decoder-only model, as the model code needs it.

`ModelArchConfig` is the one typed value that crosses from the checkpoint readers
(`model/hf_config.py` for a Hugging Face `config.json`, `model/loader.py` for GGUF metadata)
to the model code, the sharding plan and the worker. Its field names are Hugging Face's.
Every field that changes the math is either implemented by the model code or refused by the
readers with the field named; nothing in a checkpoint's config is ignored silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pagedinfer.attention.backend import AttentionOptions

__all__ = [
    "FULL_ATTENTION_LAYER",
    "ROPE_SCALING_KEYS",
    "SLIDING_LAYER",
    "ModelArchConfig",
    "RopeScaling",
]

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
"""Architecture -> transformers' `model_type`, for `to_hf_config_dict`."""

SLIDING_LAYER = "sliding_attention"
FULL_ATTENTION_LAYER = "full_attention"
"""Hugging Face's `layer_types` values."""


ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor", "truncate",
    ),
    "longrope": (
        "factor", "original_max_position_embeddings", "short_factor", "long_factor",
        "attention_factor",
    ),
}  # fmt: skip
"""The `rope_parameters` keys of each implemented RoPE type (besides `rope_type` and
`rope_theta`): the fields of `RopeScaling` it uses."""


def _int_if_whole(value: float | None) -> float | int | None:
    """transformers' configs type some scalars as int (`query_pre_attn_scalar`)."""
    return int(value) if value is not None and float(value).is_integer() else value


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are rescaled for a longer context (Hugging Face's
    `rope_parameters` names); `model/rotary.py` turns it into the tables."""

    rope_type: Literal["linear", "llama3", "yarn", "longrope"]
    factor: float
    original_max_position_embeddings: int | None = None
    """The pre-training context (llama3, yarn, longrope)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: the rotation count that bounds the extrapolated dimensions."""
    beta_slow: float = 1.0
    """yarn: the rotation count that bounds the interpolated dimensions."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    """yarn, longrope: the factor cos and sin are scaled by; None derives it from `factor`
    (and yarn's `mscale` / `mscale_all_dim`)."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""
    short_factor: tuple[float, ...] | None = None
    """longrope: each frequency divided by its factor, for contexts up to the original one."""
    long_factor: tuple[float, ...] | None = None
    """longrope: the same for longer contexts (`model/rotary.py` says which one runs)."""
    freq_factors: tuple[float, ...] | None = None
    """A GGUF file's `rope_freqs` tensor: each frequency divided by its factor (llama.cpp's
    form of llama3 scaling). Set instead of the fields above."""


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters of a decoder-only model (HF names). The defaults are
    Llama's; each family's reader sets the fields that differ."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Every token id that ends generation; the first is the model's primary EOS."""
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2), not on o_proj."""
    rope_scaling: RopeScaling | None = None
    """None: plain RoPE with base `rope_theta`."""
    qk_norm: bool = False
    """An RMSNorm over each query and each key head, before RoPE (Qwen3), with weights
    `self_attn.q_norm` and `self_attn.k_norm` of `head_dim` each."""
    sliding_window: int | None = None
    """The window of the layers that slide (`AttentionOptions.sliding_window`); None: no
    layer does."""
    layer_types: tuple[str, ...] | None = None
    """Per layer `SLIDING_LAYER` or `FULL_ATTENTION_LAYER` (Gemma, Qwen2's top layers);
    None: every layer slides when `sliding_window` is set (Mistral, Phi-3)."""
    sliding_rope_theta: float | None = None
    """The RoPE base of the sliding layers (Gemma 3's local base; plain RoPE); None: the
    same RoPE as the other layers."""
    attn_logit_softcapping: float | None = None
    """Attention scores soft-capped at this value (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Logits soft-capped at this value: cap * tanh(logits / cap) (Gemma 2)."""
    query_pre_attn_scalar: float | None = None
    """Scores scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma)."""
    gemma_norms: bool = False
    """Gemma's decoder: every RMSNorm scales by (1 + weight) (the model stores 1 + weight,
    which is what GGUF files hold), a norm after attention and around the MLP (four per
    layer), and the embeddings multiplied by sqrt(hidden_size)."""

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("ModelArchConfig needs at least one eos token id")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {SLIDING_LAYER, FULL_ATTENTION_LAYER}
            if unknown:
                raise ValueError(f"layer_types {sorted(unknown)} are not supported")
            if SLIDING_LAYER in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers but no sliding_window")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            # Checked here, before any weights are read, for both checkpoint readers.
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name)
                if factors is None or len(factors) != self.head_dim // 2:
                    raise ValueError(
                        f"longrope {name} {factors!r}: needs {self.head_dim // 2} factors "
                        f"(head_dim {self.head_dim} / 2)"
                    )
            if scaling.original_max_position_embeddings is None:
                raise ValueError("longrope needs original_max_position_embeddings")

    def is_sliding(self, layer: int) -> bool:
        """Whether decoder layer `layer` (global index) attends through the window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING_LAYER

    def attention_options(self, layer: int) -> AttentionOptions:
        """What decoder layer `layer`'s queries attend to (window, soft cap)."""
        return AttentionOptions(
            sliding_window=self.sliding_window if self.is_sliding(layer) else None,
            logits_soft_cap=self.attn_logit_softcapping,
        )

    @property
    def attention_scale(self) -> float:
        """The factor the scores q.k are multiplied by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def eos_token_id(self) -> int:
        """The primary EOS id (first of `eos_token_ids`)."""
        return self.eos_token_ids[0]

    def to_hf_config_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers reads back to the same values (the
        architecture's own config class; the weights' names are the exporter's business:
        Phi-3's fused projections, `loader.export_hf_dir`)."""
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(f"{self.architecture} has no Hugging Face directory form here")
        eos: int | list[int] = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        return {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers >= 5 reads rope_parameters; older versions read rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": self._rope_parameters(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "attention_bias": False,
            "mlp_bias": False,
            **self._family_hf_fields(),
        }

    def _family_hf_fields(self) -> dict[str, Any]:
        """The config.json keys of the family's own features (windows, Gemma's fields)."""
        fields: dict[str, Any] = {}
        if self.architecture == "MistralForCausalLM":
            fields["sliding_window"] = self.sliding_window
        elif self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            fields["use_sliding_window"] = self.sliding_window is not None
            fields["sliding_window"] = self.sliding_window
            if self.sliding_window is not None:
                if self.layer_types is None:
                    raise ValueError("a Qwen sliding window without layer_types")
                fields["layer_types"] = list(self.layer_types)
        elif self.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            fields.update(
                hidden_activation=self.hidden_act,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types or ()),
                query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
                use_bidirectional_attention=False,
            )
            if self.architecture == "Gemma3ForCausalLM":
                fields["rope_parameters"] = {
                    FULL_ATTENTION_LAYER: self._rope_parameters(),
                    SLIDING_LAYER: {"rope_type": "default", "rope_theta": self.sliding_rope_theta},
                }
        elif self.architecture == "Phi3ForCausalLM":
            fields["sliding_window"] = self.sliding_window
            scaling = self.rope_scaling
            if scaling is not None and scaling.original_max_position_embeddings is not None:
                # Phi3Config's top-level key overrides the RoPE dict's.
                fields["original_max_position_embeddings"] = (
                    scaling.original_max_position_embeddings
                )
        elif self.sliding_window is not None or self.layer_types is not None:
            raise ValueError(f"{self.architecture} has no config.json form for a sliding window")
        return fields

    def _rope_parameters(self) -> dict[str, Any]:
        scaling = self.rope_scaling
        if scaling is None:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        if scaling.freq_factors is not None:
            raise ValueError("RoPE frequency factors from a GGUF file have no HF config form")
        fields = dataclasses.asdict(scaling)
        params = {
            k: fields[k] for k in ROPE_SCALING_KEYS[scaling.rope_type] if fields[k] is not None
        }
        return {"rope_type": scaling.rope_type, **params, "rope_theta": self.rope_theta}
