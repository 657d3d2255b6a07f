"""Forced tool calls (`tool_choice` "required" and named) on a real `pagedinfer serve`, through
the official `openai` client: how many requests end in calls, and do all the calls validate?

Every case is one chat request: a tool set, a user prompt, "required" or one of the tools
by name, greedy or T=1, `parallel_tool_calls` on or off, streamed or not; all are sent at
once (`--concurrency`). Per case it records `finish_reason`, the calls (their arguments are
validated against the tool's schema with `jsonschema`) and, for a case that did not end in
calls, the raw output. The two figures that matter: "invalid calls" must be 0, and "ended in
calls" is the share of requests an agent loop can act on.

Usage:
    .venv/bin/python benchmarks/bench_tool_calls.py [--cases 96] [--max-tokens 160] \\
        [--model PATH] [--out tool_calls.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.integration.server_proc import ServerProcess, small_engine_flags  # noqa: E402
from tests.integration.tool_cases import (  # noqa: E402
    CALC,
    EMAIL,
    EVENT,
    NO_ARGS,
    PROMPTS,
    SEARCH,
    WEATHER,
    schemas,
)

TOOLSETS = [[WEATHER], [WEATHER, CALC], [SEARCH, EVENT, NO_ARGS], [CALC, SEARCH, EVENT, WEATHER],
            [EMAIL, EVENT], [EMAIL, WEATHER, SEARCH]]  # fmt: skip


def cases(n: int, model: str, max_tokens: int) -> list[tuple[bool, dict[str, Any]]]:
    out = []
    for i in range(n):
        tools = TOOLSETS[i % len(TOOLSETS)]
        named = i % 2 == 1
        choice: Any = "required"
        if named:
            name = tools[(i // 2) % len(tools)]["function"]["name"]
            choice = {"type": "function", "function": {"name": name}}
        body = {"model": model, "tools": tools, "tool_choice": choice, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "temperature": 0.0 if (i // 4) % 2 == 0 else 1.0, "seed": i,
                "parallel_tool_calls": i % 3 != 0}  # fmt: skip
        out.append((i % 8 >= 4, body))
    return out


def call(client: Any, stream: bool, body: dict) -> dict[str, Any]:
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"calls": calls, "finish": choice.finish_reason, "text": choice.message.content}
    parts: dict[int, list[str]] = {}
    finish, text = None, ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for c in ch.delta.tool_calls or []:
                entry = parts.setdefault(c.index, ["", ""])
                entry[0] += c.function.name or ""
                entry[1] += c.function.arguments or ""
            finish = ch.finish_reason or finish
    return {"calls": [tuple(parts[i]) for i in sorted(parts)], "finish": finish, "text": text}


def main() -> int:
    import jsonschema
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=None, help="Default: the default model.")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    flags = ["--kv-cache-memory-bytes", str(512 * 2**20), "--max-num-seqs", str(args.concurrency)]
    srv = ServerProcess(*([args.model] if args.model else []), *small_engine_flags(1024), *flags)
    try:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=900)
        name = client.models.list().data[0].id
        work = cases(args.cases, name, args.max_tokens)
        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda c: call(client, c[0], c[1]), work))
        elapsed = time.monotonic() - start
    finally:
        srv.stop()

    ended = invalid = 0
    failures = []
    for (stream, body), res in zip(work, results):
        by_name = schemas(body["tools"])
        ok_calls = True
        for n, a in res["calls"]:
            try:
                jsonschema.validate(json.loads(a), by_name[n])
            except (ValueError, jsonschema.ValidationError, KeyError):
                ok_calls = False
        invalid += not ok_calls
        if res["finish"] == "tool_calls" and res["calls"]:
            ended += 1
        else:
            failures.append({"stream": stream, "prompt": body["messages"][0]["content"],
                             "choice": body["tool_choice"], "T": body["temperature"],
                             "parallel": body["parallel_tool_calls"], **res})  # fmt: skip
    print(f"cpu: {platform.processor() or platform.machine()}; {len(work)} requests, "
          f"max_tokens {args.max_tokens}, {elapsed:.1f} s")  # fmt: skip
    print(f"ended in calls: {ended}/{len(work)}; requests with an invalid call: {invalid}")
    for f in failures:
        print(json.dumps(f, ensure_ascii=False)[:600])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"ended": ended, "requests": len(work), "invalid": invalid,
                       "failures": failures}, fh, indent=1)  # fmt: skip
    return 0 if invalid == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
