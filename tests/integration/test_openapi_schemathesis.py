"""schemathesis against `pagedinfer serve`'s own OpenAPI document (`GET /openapi.json`,
`entrypoints/openai/openapi.py`), on a real server process on loopback (issue 24, item 6).

Every operation, 20 examples per operation (deterministic generation, so CI runs the same
requests), phases examples, coverage and fuzzing, every check schemathesis has but one:
no 5xx, only declared status codes and content types, bodies matching their declared
schemas (200s and errors), schema-violating requests refused, 405s with `Allow`, and the
rest. Left out: `positive_data_acceptance` (every schema-valid request answered 2xx), which
still fails where a handler refuses by a rule across fields that the document does not
state: the prompt and `max_tokens` within the context length (no JSON Schema can count
tokens), at most one guided-decoding field, a named `tool_choice` whose function is among
`tools`, tool-call `arguments` that are JSON objects, Anthropic content blocks of a type
their role may send (docs/serving.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

pytest.importorskip("schemathesis")

EXCLUDED_CHECKS = ["positive_data_acceptance"]


def test_schemathesis_finds_nothing(tmp_path) -> None:
    server = ServerProcess(*small_engine_flags(256))
    try:
        cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        run = subprocess.run(
            [cli, "run", server.base + "/openapi.json", "--checks", "all",
             "--exclude-checks", ",".join(EXCLUDED_CHECKS), "--max-examples", "20",
             "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
             "--phases", "examples,coverage,fuzzing", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=840,
        )  # fmt: skip
        report = run.stdout + run.stderr
        assert run.returncode == 0, report[-6000:]
        assert " 0 passed" not in report and "passed" in report, report[-2000:]
        assert "Traceback" not in server.log()
    finally:
        server.stop()
