"""The test data of the project: prompts and a ShareGPT-format sample written for pagedinfer.

Tests read their text from here and nowhere outside the repository, so a fresh clone runs the
whole suite. Files (original text, see README.md beside them):
- `prompts.jsonl`: one chat prompt a line, `{"kind": ..., "prompt": ...}`; kinds `question`,
  `instruction`, `code`, `list` (8-50 tokens) and `long` (400-600 tokens).
- `sharegpt_sample.json`: a few conversations in the layout `--dataset-name sharegpt` reads.

Callers: tests/integration/conftest.py (the parity prompts), test_spec_decode.py (the
held-out prompts of the trained heads), test_bench_cli.py and tests/unit/test_tokenizer.py.
"""

from __future__ import annotations

import json
import os

__all__ = ["DATA_DIR", "SHAREGPT_SAMPLE", "heldout_prompts", "load_prompts", "parity_texts"]

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
SHAREGPT_SAMPLE = os.path.join(DATA_DIR, "sharegpt_sample.json")
NUM_PARITY_SHORT = 8
NUM_PARITY_LONG = 4


def load_prompts() -> list[dict[str, str]]:
    """Every row of prompts.jsonl, in file order."""
    with open(os.path.join(DATA_DIR, "prompts.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _short_texts() -> list[str]:
    return [row["prompt"] for row in load_prompts() if row["kind"] != "long"]


def parity_texts() -> tuple[list[str], list[str]]:
    """The parity set: the first 8 short prompts and the first 4 long ones."""
    long = [row["prompt"] for row in load_prompts() if row["kind"] == "long"]
    return _short_texts()[:NUM_PARITY_SHORT], long[:NUM_PARITY_LONG]


def heldout_prompts(num_prompts: int) -> list[str]:
    """`num_prompts` short prompts after the parity set (none was ever trained on)."""
    texts = _short_texts()[NUM_PARITY_SHORT : NUM_PARITY_SHORT + num_prompts]
    assert len(texts) == num_prompts, f"prompts.jsonl has only {len(texts)} held-out prompts"
    return texts
