"""Environment variables: read through `pagedinfer/envs.py` only, when asked, and listed."""

from __future__ import annotations

import ast
import pathlib

import pytest

from pagedinfer import envs

PACKAGE = pathlib.Path(envs.__file__).parent


def _environment_reads(path: pathlib.Path) -> list[int]:
    """Lines of `path` that read the environment (`os.environ.get`, `os.environ[...]`,
    `os.getenv`); writes such as `os.environ.setdefault` for a library are not reads."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "getenv":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "get":
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "environ":
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "environ":
                lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "envs.py" or path.parent != PACKAGE
        for line in _environment_reads(path)
    ]
    assert offenders == [], "read these through pagedinfer/envs.py"


def test_variables_are_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert (envs.data_dir(), envs.block_hash_seed(), envs.ray_address()) == (None, "0", "auto")
    assert envs.openai_api_key() is None
    monkeypatch.setenv("PAGEDINFER_DATA_DIR", "/data")
    monkeypatch.setenv("PYTHONHASHSEED", "s3cret")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv("OPENAI_API_KEY", "")  # empty counts as unset
    assert (envs.data_dir(), envs.block_hash_seed(), envs.ray_address()) == (
        "/data",
        "s3cret",
        "10.0.0.1:6379",
    )
    assert envs.openai_api_key() is None


def test_the_block_hash_seed_changes_the_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedinfer.core.kv_cache_utils import get_hash_fn, hash_block_tokens

    sha = get_hash_fn("sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    default = hash_block_tokens(sha, None, [1, 2, 3])
    monkeypatch.setenv("PYTHONHASHSEED", "other")
    assert hash_block_tokens(sha, None, [1, 2, 3]) != default


def test_every_variable_is_documented() -> None:
    page = (PACKAGE.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name in envs.ENVIRONMENT_VARIABLES:
        assert f"| `{name}` |" in page
