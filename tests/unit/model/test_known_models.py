"""Model names that resolve to the files of installed wheels (`gguf_metadata.resolve_model`)."""

from __future__ import annotations

import os

from pagedinfer.gguf_metadata import (
    find_default_model,
    find_gemma3_270m,
    read_gguf_metadata,
    resolve_model,
)


def test_paths_pass_through_and_none_is_the_default_model() -> None:
    assert resolve_model("some/dir") == "some/dir"
    assert resolve_model(None) == find_default_model()


def test_gemma3_270m_is_assembled_from_its_wheels() -> None:
    path = resolve_model("gemma-3-270m")
    assert path == find_gemma3_270m()
    assert os.path.getsize(path) == 253_113_024
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "gemma3"
    assert meta["tokenizer.ggml.model"] == "llama"
