"""Model architectures pagedinfer can run: architecture name -> model class (lazy import).

Role: the one table of supported architectures. A Hugging Face checkpoint names its class in
`config.json`'s `architectures`; a GGUF file names its family in `general.architecture`
(llama.cpp's names), which `gguf_architecture` maps to the HF class name. `get_model_class`
imports the model's module only when asked, so reading a config never imports model code.

Invariants:
- An architecture not in the table is refused with a ValueError that lists the supported
  ones, before any weights are read: a checkpoint of another family would otherwise load
  into the wrong modules (or fail later with a less useful message).
- Every registered class has `LlamaForCausalLM`'s interface: built from
  `(ModelArchConfig, AttentionBackend)`, with `load_weights`, `load_quantized`, `forward`,
  `forward_stage`, `compute_logits` and the TP/PP attributes the worker reads.

Callers: the loader (validating the architecture while reading a config) and the worker
(building the model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedinfer.model.llama import LlamaForCausalLM

__all__ = [
    "architecture_features",
    "check_architecture",
    "get_model_class",
    "gguf_architecture",
    "supported_architectures",
]

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedinfer.model.llama", "LlamaForCausalLM"),
    # The same decoder with QKV biases (Qwen2) or QK-norm (Qwen3), set by the config.
    "Qwen2ForCausalLM": ("pagedinfer.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pagedinfer.model.llama", "LlamaForCausalLM"),
    # Llama with a sliding window over every layer (the config's `sliding_window`).
    "MistralForCausalLM": ("pagedinfer.model.llama", "LlamaForCausalLM"),
    # Llama's decoder; the checkpoint fuses q/k/v and gate/up (split by the loader), RoPE
    # may be longrope and every layer may slide.
    "Phi3ForCausalLM": ("pagedinfer.model.llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("pagedinfer.model.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("pagedinfer.model.gemma", "GemmaForCausalLM"),
}
"""HF architecture name -> (module, class name)."""

_FEATURES: dict[str, dict[str, object]] = {
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Gemma2ForCausalLM": {"gemma_norms": True, "hidden_act": "gelu_pytorch_tanh"},
    "Gemma3ForCausalLM": {"gemma_norms": True, "qk_norm": True, "hidden_act": "gelu_pytorch_tanh"},
}
"""Architecture -> the `ModelArchConfig` fields it implies (beyond Llama's defaults),
whichever format the checkpoint comes in."""

_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
"""GGUF `general.architecture` -> HF architecture name. (llama.cpp converts Mistral
checkpoints to its `llama` architecture.)"""

_MIXTURE_OF_EXPERTS = frozenset(
    {
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "PhimoeForCausalLM",
        "OlmoeForCausalLM", "GraniteMoeForCausalLM", "DbrxForCausalLM", "GptOssForCausalLM",
        "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
    }
)  # fmt: skip
"""Mixture-of-experts architectures: refused with that reason until the engine runs them."""

_GGUF_MIXTURE_OF_EXPERTS = frozenset({"qwen2moe", "qwen3moe", "deepseek2", "olmoe", "gpt-oss"})


def supported_architectures() -> list[str]:
    """The HF architecture names pagedinfer runs, sorted."""
    return sorted(_MODELS)


def _quoted(names: list[str]) -> str:
    return ", ".join(repr(name) for name in names)


def check_architecture(architecture: str) -> str:
    """`architecture` if it is supported, else ValueError naming the supported ones."""
    if architecture in _MIXTURE_OF_EXPERTS:
        raise ValueError(
            f"Model architecture {architecture!r} is a mixture-of-experts model, which "
            f"pagedinfer does not run yet (supported: {_quoted(supported_architectures())})"
        )
    if architecture not in _MODELS:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported "
            f"(supported: {_quoted(supported_architectures())})"
        )
    return architecture


def gguf_architecture(name: object) -> str:
    """A GGUF file's `general.architecture` -> the HF architecture name, else ValueError
    naming the supported GGUF architectures."""
    architecture = _GGUF_ARCHITECTURES.get(name) if isinstance(name, str) else None
    if name in _GGUF_MIXTURE_OF_EXPERTS:
        raise ValueError(
            f"GGUF architecture {name!r} is a mixture-of-experts model, which pagedinfer "
            f"does not run yet (supported: {_quoted(sorted(_GGUF_ARCHITECTURES))})"
        )
    if architecture is None:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported "
            f"(supported: {_quoted(sorted(_GGUF_ARCHITECTURES))})"
        )
    return architecture


def architecture_features(architecture: str) -> dict[str, object]:
    """The `ModelArchConfig` fields a supported architecture implies (e.g. Qwen2's QKV
    biases), for the checkpoint readers."""
    return dict(_FEATURES.get(check_architecture(architecture), {}))


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class of a supported HF architecture name (its module imported now)."""
    module_name, class_name = _MODELS[check_architecture(architecture)]
    model_class: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), class_name)
    return model_class
