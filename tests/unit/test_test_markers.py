"""Every integration test file declares `pytest.mark.integration` in its `pytestmark`, so
`pytest -m "not integration"` is the fast tier and `-m integration` the real-model tier."""

from __future__ import annotations

import ast
import os

INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration")


def _marks(path: str) -> set[str]:
    """The `pytest.mark.NAME`s of the module-level `pytestmark` assignment."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute):
                    if sub.value.attr == "mark":
                        names.add(sub.attr)
    return names


def test_every_integration_file_is_marked() -> None:
    files = sorted(f for f in os.listdir(INTEGRATION_DIR) if f.startswith("test_"))
    assert files
    unmarked = [f for f in files if "integration" not in _marks(os.path.join(INTEGRATION_DIR, f))]
    assert not unmarked, f"add `pytestmark = pytest.mark.integration` to {unmarked}"
