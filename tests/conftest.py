"""Fixtures for every test tier: the default model's path. Test data lives in tests/data."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from pagedinfer.gguf_metadata import find_default_model

    return find_default_model()
