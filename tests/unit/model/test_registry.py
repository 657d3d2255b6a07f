"""Tests for the architecture registry: each supported family resolves (lazily) to its
class with the features it implies; any other HF or GGUF architecture, and mixture-of-experts
ones by name, are refused with the list of supported ones."""

from __future__ import annotations

import pytest

from pagedinfer.model.registry import (
    architecture_features,
    check_architecture,
    get_model_class,
    gguf_architecture,
    supported_architectures,
)

LLAMA_LIKE = [
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
]  # fmt: skip
GEMMA = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


def test_supported_families_resolve_to_the_decoder() -> None:
    from pagedinfer.model.gemma import GemmaForCausalLM
    from pagedinfer.model.llama import LlamaForCausalLM

    assert supported_architectures() == sorted(LLAMA_LIKE + GEMMA)
    assert all(get_model_class(name) is LlamaForCausalLM for name in LLAMA_LIKE)
    assert all(get_model_class(name) is GemmaForCausalLM for name in GEMMA)
    names = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
    assert [gguf_architecture(n) for n in names] == [
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *GEMMA, "Phi3ForCausalLM"
    ]  # fmt: skip
    assert architecture_features("Phi3ForCausalLM") == {}
    assert architecture_features("LlamaForCausalLM") == {}
    assert architecture_features("Gemma3ForCausalLM")["gemma_norms"] is True
    assert architecture_features("Qwen2ForCausalLM") == {"qkv_bias": True}
    assert architecture_features("Qwen3ForCausalLM") == {"qk_norm": True}


def test_unknown_hf_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'FalconForCausalLM' is not supported \(supported: "):
        get_model_class("FalconForCausalLM")
    with pytest.raises(ValueError, match="'LlamaForCausalLM', 'MistralForCausalLM'"):
        check_architecture("GPT2LMHeadModel")


def test_mixture_of_experts_is_named_as_such() -> None:
    with pytest.raises(ValueError, match="'MixtralForCausalLM' is a mixture-of-experts model"):
        check_architecture("MixtralForCausalLM")
    with pytest.raises(ValueError, match="'qwen3moe' is a mixture-of-experts model"):
        gguf_architecture("qwen3moe")


@pytest.mark.parametrize("name", ["falcon", None])
def test_unknown_gguf_architecture_lists_the_supported_ones(name: str | None) -> None:
    with pytest.raises(
        ValueError,
        match=r"GGUF architecture .* is not supported \(supported: 'gemma2', 'gemma3', 'llama', "
        r"'phi3', 'qwen2', 'qwen3'\)",
    ):
        gguf_architecture(name)
