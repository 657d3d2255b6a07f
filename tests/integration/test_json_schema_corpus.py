"""Guided JSON on a corpus of real-world schemas (`data/json_schemas.json`: API payloads,
config files, records; nested objects, bounded arrays, enums, consts, patterns, formats,
number ranges, `$ref`/`$defs`, `anyOf`/`oneOf`, nullable fields, `additionalProperties`).

For each backend (one engine each) and temperature (0 with flexible whitespace, 1 compact and
seeded by the entry's index), half the schemas go in one batch (each schema once per
backend); every output must finish with "stop" and validate against its schema
(`jsonschema`, with format checks: "date" as RFC 3339's full-date, the rest as `jsonschema`
checks them). Failures are collected and reported together. A schema a backend cannot take
is left out of that backend's run; llguidance takes the whole corpus, xgrammar all but the
`oneOf` schemas (checked below).

The model is tiny and rambles, so every string in the corpus is bounded (maxLength, enum or a
bounded pattern), every array has maxItems, and most objects forbid additional properties;
unbounded lexical spaces (the `email`/`uri`/`date-time` formats, number fractions, free map
keys) are kept to entries that finish. Entries are seeded by their index at T=1: append new
ones at the end.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from pagedinfer import LLM, SamplingParams, StructuredOutputsParams
from pagedinfer.structured_output.backend import resolve_auto_backend
from pagedinfer.structured_output.backend_guidance import validate_guidance_spec
from pagedinfer.structured_output.backend_xgrammar import validate_xgrammar_spec
from pagedinfer.structured_output.specs import StructuredOutputOptions

pytestmark = pytest.mark.integration

jsonschema = pytest.importorskip("jsonschema")

CORPUS_PATH = os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")
MIN_CORPUS = 60
MAX_TOKENS = 320
BACKENDS = ["xgrammar", "guidance"]
_VALIDATORS = {"xgrammar": validate_xgrammar_spec, "guidance": validate_guidance_spec}


_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _rfc3339_full_date(value: object) -> bool:
    """RFC 3339 `full-date` (JSON Schema's "date"): YYYY-MM-DD with a day that exists in that
    month. Year 0000 is allowed, as RFC 3339 allows it (Python's `date.fromisoformat`, which
    `jsonschema` uses, does not)."""
    if not isinstance(value, str):
        return True
    m = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", value)
    if m is None:
        return False
    year, month, day = (int(g) for g in m.groups())
    if not 1 <= month <= 12:
        return False
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return 1 <= day <= _DAYS[month - 1] + (month == 2 and leap)


# Draft 2020-12's checks ("time" here would be draft 3's HH:MM:SS), with RFC 3339 dates.
FORMAT_CHECKER = jsonschema.FormatChecker(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
FORMAT_CHECKER.checks("date")(_rfc3339_full_date)


def _load_corpus() -> list[dict]:
    with open(CORPUS_PATH, encoding="utf-8") as f:
        return json.load(f)


CORPUS = _load_corpus()


def _accepts(backend: str, schema: dict, compact: bool) -> bool:
    try:
        _VALIDATORS[backend](
            StructuredOutputOptions.JSON, json.dumps(schema), disable_any_whitespace=compact
        )
    except ValueError:
        return False
    return True


def _chat(llm: LLM, text: str) -> dict:
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request) -> tuple[str, LLM]:
    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=1024,
        max_num_seqs=64,
        log_stats_interval_s=0,
        structured_outputs_backend=request.param,
    )
    return request.param, llm


def test_corpus_is_well_formed() -> None:
    names = [entry["name"] for entry in CORPUS]
    assert len(names) >= MIN_CORPUS and len(set(names)) == len(names)
    for entry in CORPUS:
        assert set(entry) == {"name", "prompt", "schema"}, entry["name"]
        assert entry["prompt"].strip(), entry["name"]
        jsonschema.Draft202012Validator.check_schema(entry["schema"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_take_the_whole_corpus(backend: str) -> None:
    """llguidance takes every schema; xgrammar all but those with a `oneOf`, which it may
    read as `anyOf` (test_keyword_routing.py), and "auto" sends those to llguidance."""
    rejected = [
        (entry["name"], compact)
        for entry in CORPUS
        for compact in (False, True)
        if not _accepts(backend, entry["schema"], compact)
    ]
    assert len(CORPUS) - len({name for name, _ in rejected}) >= MIN_CORPUS, rejected
    if backend == "xgrammar":
        names = {name for name, _ in rejected}
        one_of = {e["name"] for e in CORPUS if "oneOf" in json.dumps(e["schema"])}
        assert names == one_of and len(names) <= 5, rejected
        for entry in CORPUS:
            if entry["name"] in names:
                spec = json.dumps(entry["schema"])
                assert resolve_auto_backend(StructuredOutputOptions.JSON, spec) == "guidance"
        return
    assert not rejected, f"{backend} rejects: {rejected}"


@pytest.mark.parametrize(
    "string",
    [
        {"type": "string", "format": "email", "maxLength": 12},
        {"type": ["string", "null"], "pattern": "^[a-z]+$", "maxLength": 5},
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
    ],
)
def test_xgrammar_leaves_out_lengths_it_would_drop(string: dict) -> None:
    """xgrammar 0.2 ignores minLength/maxLength next to a pattern or format: the backend must
    not take such a schema (a 30-character e-mail would pass a maxLength of 12); "auto" sends
    it to llguidance, which enforces both."""
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    spec = json.dumps(schema)
    with pytest.raises(ValueError, match="minLength/maxLength with"):
        validate_xgrammar_spec(StructuredOutputOptions.JSON, spec)
    assert resolve_auto_backend(StructuredOutputOptions.JSON, spec) == "guidance"
    loose = {k: v for k, v in string.items() if k not in ("minLength", "maxLength")}
    validate_xgrammar_spec(
        StructuredOutputOptions.JSON, json.dumps({**schema, "properties": {"s": loose}})
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_date_formats_are_exact(backend: str) -> None:
    """Only days that exist: xgrammar's own "date" takes the 31st of any month, llguidance's
    takes 02-29 of any year; the backends give both libraries an exact pattern instead."""
    from pagedinfer.structured_output.backend import create_backend
    from pagedinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    made = create_backend(backend, tokenizer, 49152, disable_any_whitespace=True)
    schema = {"type": "object", "additionalProperties": False, "required": ["d", "t"],
              "properties": {"d": {"type": "string", "format": "date"},
                             "t": {"type": ["string", "null"], "format": "date-time"}}}  # fmt: skip
    spec = json.dumps(schema)

    def takes(d: str, t: str) -> bool:
        grammar = made.compile_grammar(StructuredOutputOptions.JSON, spec)
        text = json.dumps({"d": d, "t": t}, separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False) + [made.eos_token_id]
        return grammar.accept_tokens("r", tokens)

    now = "2024-02-29T23:59:60.5+05:30"
    for day in ["2024-02-29", "2000-02-29", "0000-02-29", "2023-04-30", "2023-12-31"]:
        assert takes(day, now), day
    for day in ["2023-02-29", "1900-02-29", "2023-02-30", "2023-04-31", "2023-13-01"]:
        assert not takes(day, now), day
        assert not takes("2024-01-01", day + "T10:00:00Z"), day
    assert not takes("2024-01-01", "2024-01-01T24:00:00Z")
    made.destroy()


def test_rfc3339_date_check() -> None:
    good = ["2024-02-29", "0000-02-29", "2023-12-31"]
    bad = ["2023-02-29", "2023-02-31", "2023-13-01", "2023-04-31", "2023-1-01", "20230101"]
    assert all(_rfc3339_full_date(d) for d in good)
    assert not any(_rfc3339_full_date(d) for d in bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_corpus_outputs_validate(engine: tuple[str, LLM], temperature: float) -> None:
    backend, llm = engine
    compact = temperature > 0
    # Each temperature takes half the corpus (even entries greedy, odd ones at T=1): every
    # schema runs once per backend, in half the time of running all twice.
    half = CORPUS[0::2] if temperature == 0 else CORPUS[1::2]
    entries = [e for e in half if _accepts(backend, e["schema"], compact)]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=CORPUS.index(entry) if temperature > 0 else None,
            structured_outputs=StructuredOutputsParams(
                json=entry["schema"], disable_any_whitespace=compact
            ),
        )
        for entry in entries
    ]
    prompts = [_chat(llm, entry["prompt"]) for entry in entries]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(entries)
    failures = []
    for entry, out in zip(entries, outs):
        completion = out.outputs[0]
        text = completion.text
        if completion.finish_reason != "stop":
            failures.append((entry["name"], f"finish_reason={completion.finish_reason}", text))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            failures.append((entry["name"], f"invalid JSON: {e}", text))
            continue
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(
                entry["schema"], format_checker=FORMAT_CHECKER
            ).iter_errors(value)
        )
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            failures.append((entry["name"], f"schema violation at /{where}: {error.message}", text))
    report = "\n".join(
        f"- {name} [{backend}, T={temperature}]: {why}\n    {text!r}"
        for name, why, text in failures
    )
    assert not failures, f"{len(failures)}/{len(entries)} outputs failed:\n{report}"
