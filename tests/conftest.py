"""Shared fixtures: the default model's path and a small-KV engine factory."""

from __future__ import annotations

import os

import pytest

SHARED_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from pagedinfer.gguf_metadata import find_default_model

    return find_default_model()


@pytest.fixture(scope="session")
def shared_dir() -> str:
    if not os.path.isdir(SHARED_DIR):
        pytest.skip(f"shared data not found at {SHARED_DIR}")
    return SHARED_DIR
