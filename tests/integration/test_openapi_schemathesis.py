"""schemathesis against `pagedinfer serve`'s own OpenAPI document (`GET /openapi.json`,
`entrypoints/openai/openapi.py`), on a real server process on loopback (issue 24, item 6).

Every operation, 20 examples per operation (deterministic generation, so CI runs the same
requests), phases examples, coverage and fuzzing, every check schemathesis has: no 5xx, only
declared status codes and content types, bodies matching their declared schemas (200s and
errors), schema-violating requests refused, schema-valid ones accepted, 405s with `Allow`,
and the rest. The server has auto tool choice on (hermes), so requests with tools are served.

The rules across fields that no JSON Schema states (the prompt and the output length within
the context, at most one guided-decoding field, a named tool among the tools, grammars that
compile, ...) are applied to the schema-valid cases by `schemathesis_hooks.py`, which says
each; they are listed for clients in docs/serving.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

pytest.importorskip("schemathesis")

HOOKS = os.path.join(os.path.dirname(__file__), "schemathesis_hooks.py")
MAX_MODEL_LEN = 256


def test_schemathesis_finds_nothing(tmp_path) -> None:
    server = ServerProcess(*small_engine_flags(MAX_MODEL_LEN), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes")  # fmt: skip
    try:
        cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        run = subprocess.run(
            [cli, "run", server.base + "/openapi.json", "--checks", "all", "--max-examples", "20",
             "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
             "--phases", "examples,coverage,fuzzing", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=840,
            env={**os.environ, "SCHEMATHESIS_HOOKS": HOOKS,
                 "PAGEDINFER_SCHEMATHESIS_BASE": server.base,
                 "PAGEDINFER_SCHEMATHESIS_MAX_MODEL_LEN": str(MAX_MODEL_LEN)},
        )  # fmt: skip
        report = run.stdout + run.stderr
        assert run.returncode == 0, report[-6000:]
        assert " 0 passed" not in report and "passed" in report, report[-2000:]
        assert "Traceback" not in server.log()
    finally:
        server.stop()
