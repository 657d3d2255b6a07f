"""The README's examples run as written: each Python block in a fresh interpreter with the
default model, and each curl against a real `pagedinfer serve` on the default model.

The unit tier (tests/unit/test_docs.py) checks the other pages' examples for syntax and
flags; these are the ones a newcomer copies first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _readme_blocks(lang: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == lang]


PYTHON_BLOCKS = _readme_blocks("python")
CURLS = [b for b in _readme_blocks("bash") if b.lstrip().startswith("curl ")]


def test_the_readme_has_examples() -> None:
    assert PYTHON_BLOCKS and CURLS


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=lambda c: c.splitlines()[0][:40])
def test_readme_python_example_runs(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip(), "the example printed nothing"


def test_readme_curl_runs_against_a_server() -> None:
    server = ServerProcess(*small_engine_flags())
    try:
        for block in CURLS:
            # The README's address is the default one; this server took a free port.
            command = block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
            proc = subprocess.run(
                ["bash", "-c", command], capture_output=True, text=True, timeout=300
            )
            assert proc.returncode == 0, proc.stderr
            body = json.loads(proc.stdout)  # an error would be {"error": ...}, no choices
            assert body.get("choices"), body
    finally:
        server.stop()
