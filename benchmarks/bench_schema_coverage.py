"""Which JSON schemas each guided-decoding backend takes, and whether it enforces them, on
the public JSON-Schema-Test-Suite (github.com/json-schema-org/JSON-Schema-Test-Suite, MIT):
each case is a schema with instances labelled valid or invalid.

Per backend ("xgrammar", "guidance", and "auto" as the engine routes), each schema is
compiled (refused: outside the backend's declared coverage), then every instance's compact
JSON is fed through the grammar token by token (the default model's tokenizer). An invalid
instance the grammar takes to its end is a lie: a model could finish that output. A valid
one it rejects is over-strict (a safe loss). No model runs.

Usage:
    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite /tmp/suite
    .venv/bin/python benchmarks/bench_schema_coverage.py --suite /tmp/suite \\
        [--draft draft2020-12] [--show-lies 20]

Skipped: cases whose schema needs remote references or is a bare boolean (no grammar
backend takes `true`/`false` as a schema), and `optional/` tests.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedinfer.structured_output.backend import (  # noqa: E402
    create_backend,
    grammar_accepts_text,
    resolve_auto_backend,
)
from pagedinfer.structured_output.specs import StructuredOutputOptions  # noqa: E402
from pagedinfer.tokenizer import Tokenizer  # noqa: E402

JSON = StructuredOutputOptions.JSON


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", required=True, help="a JSON-Schema-Test-Suite checkout")
    parser.add_argument("--draft", default="draft2020-12")
    parser.add_argument("--show-lies", type=int, default=20)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_model_path(None)
    backends = {n: create_backend(n, tokenizer, 49152, disable_any_whitespace=True)
                for n in ("xgrammar", "guidance")}  # fmt: skip
    cases = []
    for path in sorted(glob.glob(os.path.join(args.suite, "tests", args.draft, "*.json"))):
        for case in json.load(open(path, encoding="utf-8")):
            schema = case["schema"]
            if not isinstance(schema, dict) or "http" in json.dumps(schema.get("$ref", "")):
                continue
            if "refRemote" in path:
                continue
            cases.append((os.path.basename(path)[:-5], case))
    stats: dict[str, collections.Counter] = {n: collections.Counter()
                                             for n in ("xgrammar", "guidance", "auto")}  # fmt: skip
    lies: list[tuple[str, str, str, str]] = []
    for keyword, case in cases:
        spec = json.dumps(case["schema"])
        chosen: dict[str, str | None] = {}
        for name, backend in backends.items():
            try:
                backend.validate(JSON, spec)
                backend.compile_grammar(JSON, spec)
                chosen[name] = name
            except Exception:
                chosen[name] = None
        try:
            chosen["auto"] = resolve_auto_backend(JSON, spec, disable_any_whitespace=True)
        except ValueError:
            chosen["auto"] = None
        for name, used in chosen.items():
            s = stats[name]
            s["schemas"] += 1
            if used is None:
                s["refused"] += 1
                continue
            for test in case["tests"]:
                text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
                ok = grammar_accepts_text(backends[used], tokenizer, JSON, spec, text)
                if test["valid"]:
                    s["valid taken" if ok else "valid rejected"] += 1
                elif ok:
                    s["LIES"] += 1
                    lies.append((name, keyword, case["description"], test["description"]))
                else:
                    s["invalid rejected"] += 1
    print(f"JSON-Schema-Test-Suite {args.draft}: {len(cases)} schemas "
          f"({sum(len(c['tests']) for _, c in cases)} instances)")  # fmt: skip
    print("\n| backend | schemas taken | instances: valid taken | valid rejected | "
          "invalid rejected | invalid taken (lies) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, s in stats.items():
        taken = s["schemas"] - s["refused"]
        print(f"| {name} | {taken} / {s['schemas']} ({100 * taken / s['schemas']:.0f}%) | "
              f"{s['valid taken']} | {s['valid rejected']} | {s['invalid rejected']} | "
              f"{s['LIES']} |")  # fmt: skip
    by = collections.Counter((n, k) for n, k, _, _ in lies)
    if lies:
        print("\nLies by backend and keyword file:", dict(by))
        for entry in lies[: args.show_lies]:
            print("  ", " / ".join(entry))


if __name__ == "__main__":
    main()
