"""Does guided decoding ever finish an output that fails its schema? And which whitespace
mode lets a small model finish more often?

For each backend ("xgrammar", "guidance", "auto": one engine each, one alive at a time) and
each setting (free or compact whitespace, repetition_penalty), every schema of the corpus
is asked for once (a chat prompt per schema, greedy, `--max-tokens`), all at once. Per run:
schemas the backend refused (a 400 before anything ran), outputs that finished ("stop"),
of those how many validate (`jsonschema`, formats checked), and outputs that ran to
max_tokens (the small model looping). A finished output that does not validate is the bug
this benchmark exists to catch: the table's "finished, invalid" column must be 0.

Usage:
    .venv/bin/python benchmarks/bench_guided_validity.py \\
        [--schemas tests/integration/data/json_schemas.json] [--max-tokens 400] \\
        [--backends auto,xgrammar,guidance] [--settings any,compact,compact+rp1.1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

DEFAULT_SCHEMAS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "tests", "integration", "data", "json_schemas.json",
)  # fmt: skip


def run(llm: LLM, corpus: list[dict], setting: str, max_tokens: int) -> dict[str, int]:
    import jsonschema

    compact = "compact" in setting
    penalty = float(setting.split("rp")[1]) if "rp" in setting else 1.0
    tokenizer = llm.get_tokenizer()
    prompts, params, schemas = [], [], []
    counts = {"schemas": len(corpus), "refused": 0, "finished": 0, "finished_valid": 0,
              "finished_invalid": 0, "length": 0, "tokens": 0}  # fmt: skip
    for item in corpus:
        so = StructuredOutputsParams(json=item["schema"], disable_any_whitespace=compact)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, repetition_penalty=penalty,
                            structured_outputs=so)  # fmt: skip
        messages = [{"role": "user", "content": item["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        try:  # refused specs fail here, before anything runs
            llm.llm_engine.input_processor.process("check", {"prompt_token_ids": ids}, sp)
        except ValueError:
            counts["refused"] += 1
            continue
        prompts.append({"prompt_token_ids": ids})
        params.append(sp)
        schemas.append(item["schema"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        counts["tokens"] += len(c.token_ids)
        if c.finish_reason != "stop":
            counts["length"] += 1
            continue
        counts["finished"] += 1
        try:
            jsonschema.validate(json.loads(c.text), schema, format_checker=checker)
            counts["finished_valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            counts["finished_invalid"] += 1
            print(f"FINISHED BUT INVALID: {exc!s:.200}\n  {c.text[:300]!r}", file=sys.stderr)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", default=DEFAULT_SCHEMAS)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--backends", default="auto,xgrammar,guidance")
    parser.add_argument("--settings", default="any,compact,compact+rp1.1")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    corpus = json.load(open(args.schemas, encoding="utf-8"))
    print(f"{len(corpus)} schemas from {args.schemas}; greedy, max_tokens {args.max_tokens}; "
          f"{platform.processor() or platform.machine()}")  # fmt: skip
    print("\n| backend | setting | refused | finished | finished, valid | finished, invalid | "
          "ran to max_tokens | tokens | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        llm = LLM(dtype=args.dtype, kv_cache_memory_bytes=512 * 2**20, max_model_len=1024,
                  max_num_seqs=80, log_stats_interval_s=0,
                  structured_outputs_backend=backend)  # fmt: skip
        for setting in args.settings.split(","):
            start = time.perf_counter()
            c = run(llm, corpus, setting, args.max_tokens)
            print(f"| {backend} | {setting} | {c['refused']} | {c['finished']} | "
                  f"{c['finished_valid']} | {c['finished_invalid']} | {c['length']} | "
                  f"{c['tokens']} | {time.perf_counter() - start:.0f} |", flush=True)  # fmt: skip
        llm.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
