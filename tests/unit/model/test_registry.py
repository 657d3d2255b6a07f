"""Tests for the architecture registry: Llama resolves (lazily) to its class; any other HF or
GGUF architecture is refused with the list of supported ones."""

from __future__ import annotations

import pytest

from pagedinfer.model.registry import (
    check_architecture,
    get_model_class,
    gguf_architecture,
    supported_architectures,
)


def test_llama_resolves_to_its_class() -> None:
    from pagedinfer.model.llama import LlamaForCausalLM

    assert supported_architectures() == ["LlamaForCausalLM"]
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert gguf_architecture("llama") == check_architecture("LlamaForCausalLM")


def test_unknown_hf_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'Qwen2ForCausalLM' is not supported \(supported: "):
        get_model_class("Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="'LlamaForCausalLM'"):
        check_architecture("GPT2LMHeadModel")


@pytest.mark.parametrize("name", ["qwen2", None])
def test_unknown_gguf_architecture_lists_the_supported_ones(name: str | None) -> None:
    with pytest.raises(
        ValueError, match=r"GGUF architecture .* is not supported \(supported: 'llama'\)"
    ):
        gguf_architecture(name)
