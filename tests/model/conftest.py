"""The tiny random Llama both model-tier files compare against transformers."""

from __future__ import annotations

import pytest
import torch

from .tiny import make_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()
