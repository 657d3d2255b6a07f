"""Guided decoding on the real model, with both backends: JSON schemas (validated with the
`jsonschema` package), any JSON object, regexes, choices and grammars; a guided request
does not change unguided ones in the same batch; a repeated schema compiles once; bad specs
fail their request alone, before anything is queued."""

from __future__ import annotations

import json
import re
import threading

import pytest

from pagedinfer import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.integration

jsonschema = pytest.importorskip("jsonschema")

BACKENDS = ["xgrammar", "guidance"]

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["colour", "tags"],
        "additionalProperties": False,
    },  # fmt: skip
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "location": {"$ref": "#/$defs/point"},
        },
        "required": ["city", "location"],
        "additionalProperties": False,
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            }
        },
    },
    {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]},
            "ok": {"type": "boolean"},
            "kind": {"const": "event"},
        },
        "required": ["id", "ok", "kind"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Give me a colour and some tags as JSON.",
    "Name a city and its coordinates in JSON.",
    "Describe an event record in JSON.",
]


def _chat(llm: LLM, text: str) -> dict:
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return {"prompt_token_ids": ids}


def _engine(backend: str) -> LLM:
    return LLM(
        dtype="float32",
        kv_cache_memory_bytes=96 * 2**20,
        max_model_len=512,
        log_stats_interval_s=0,
        structured_outputs_backend=backend,
    )


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request) -> LLM:
    return _engine(request.param)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, temperature: float) -> None:
    params = [
        SamplingParams(
            max_tokens=160,
            temperature=temperature,
            seed=7,
            structured_outputs=StructuredOutputsParams(
                json=schema, disable_any_whitespace=temperature > 0
            ),
        )
        for schema in SCHEMAS
    ]
    outs = llm.generate([_chat(llm, p) for p in PROMPTS], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_regex_and_choice_match_fully(llm: LLM) -> None:
    cases = [
        (
            StructuredOutputsParams(json_object=True),
            'Return a JSON object with a single key "ok" set to true.',
        ),
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "A phone number?"),
        (StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{1,30}\."), "Is the sky blue?"),
        (StructuredOutputsParams(choice=["Paris", "London", "Rome"]), "Capital of Italy?"),
    ]
    params = [  # the free-form object may run long: room for it
        SamplingParams(max_tokens=300 if so.json_object else 64, temperature=0,
                       structured_outputs=so)
        for so, _ in cases
    ]  # fmt: skip
    outs = llm.generate([_chat(llm, p) for _, p in cases], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", texts[1])
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", texts[2])
    assert texts[3] in {"Paris", "London", "Rome"}


ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""

SMALL_JSON_EBNF = r"""
root ::= "{" pair ("," pair){0,2} "}"
pair ::= key ":" value
key ::= "\"" [a-z]{1,8} "\""
value ::= [0-9]{1,4} | "true" | "false" | "\"" [a-z ]{0,12} "\""
"""


def test_grammar_outputs_parse(llm: LLM) -> None:
    params = [
        SamplingParams(
            max_tokens=40, temperature=t, seed=3,
            structured_outputs=StructuredOutputsParams(grammar=g),
        )
        for g in (ARITHMETIC_EBNF, SMALL_JSON_EBNF)
        for t in (0.0, 1.0)
    ]  # fmt: skip
    prompts = [_chat(llm, "Write an arithmetic expression.")] * 2 + [
        _chat(llm, "Write a tiny JSON object.")
    ] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs[:2]:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        assert re.fullmatch(r"[0-9+\-*/()]+", text)
        eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # parses (and evaluates)
    for out in outs[2:]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)


def test_lark_grammar_through_llguidance() -> None:
    llm = _engine("auto")  # auto sends Lark to llguidance
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    out = llm.generate(
        [_chat(llm, "What is six times seven?")],
        SamplingParams(max_tokens=20, temperature=0,
                       structured_outputs=StructuredOutputsParams(grammar=lark)),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.outputs[0].text)


def test_guided_requests_leave_unguided_ones_unchanged(llm: LLM) -> None:
    plain_prompts = [_chat(llm, "Tell me about the moon."), _chat(llm, "Count to five.")]
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.outputs[0].text for o in llm.generate(plain_prompts, plain, use_tqdm=False)]
    guided = SamplingParams(
        max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0])
    )
    mixed = llm.generate(
        [plain_prompts[0], _chat(llm, PROMPTS[0]), plain_prompts[1]],
        [plain, guided, plain],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_a_repeated_schema_compiles_once(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    before = llm.get_stats()
    params = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    llm.generate([_chat(llm, f"A number, {i}?") for i in range(3)], params, use_tqdm=False)
    llm.generate([_chat(llm, "One more number?")], params, use_tqdm=False)
    after = llm.get_stats()
    assert after["grammar_compiles"] - before["grammar_compiles"] == 1
    assert after["grammar_cache_hits"] - before["grammar_cache_hits"] == 3


def test_a_request_waiting_for_its_grammar_blocks_no_one(llm: LLM) -> None:
    """While a grammar compiles, its request waits at the head of the queue (WAITING_FOR_FSM)
    and the requests behind it run; once compiled it runs too. The compile is held by taking
    the manager's own per-spec lock, the one a second request with the same spec waits on."""
    from pagedinfer.core.request import RequestStatus
    from pagedinfer.structured_output.manager import spec_key

    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager
    scheduler = engine.engine_core.scheduler
    schema = {"type": "object", "properties": {"held": {"type": "boolean"}},
              "required": ["held"], "additionalProperties": False}  # fmt: skip
    guided = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    name = engine.config.structured_outputs_config.structured_outputs_backend
    backend = manager._backend(name, guided.structured_outputs)
    with manager._lock:
        lock = manager._spec_locks.setdefault(
            (id(backend), *spec_key(guided.structured_outputs)), threading.Lock()
        )
    plain = SamplingParams(max_tokens=6, temperature=0)
    lock.acquire()
    try:
        engine.add_request("g", _chat(llm, "Is it held? Answer in JSON."), guided)
        engine.add_request("p0", _chat(llm, "Say hello."), plain)
        engine.add_request("p1", _chat(llm, "Say goodbye."), plain)
        finished: dict[str, str] = {}
        for _ in range(12):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].text
        assert set(finished) == {"p0", "p1"}  # both ran to the end, behind "g"
        head = scheduler.waiting.peek()
        assert head.request_id == "g" and head.status is RequestStatus.WAITING_FOR_FSM
    finally:
        lock.release()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].text
                assert out.outputs[0].finish_reason == "stop"
    assert json.loads(finished["g"]) in ({"held": True}, {"held": False})


def test_a_compile_that_times_out_fails_its_request_alone() -> None:
    """`structured_outputs_compile_timeout_s`: a grammar not ready in time fails its request
    with reason "error" and says so; the request beside it is served."""
    from pagedinfer.structured_output.manager import spec_key

    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=32 * 2**20,
        max_model_len=256,
        log_stats_interval_s=0,
        structured_outputs_backend="guidance",
        structured_outputs_compile_timeout_s=0.5,
    )
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager
    guided = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")
    )
    backend = manager._backend("guidance", guided.structured_outputs)
    lock = manager._spec_locks.setdefault(
        (id(backend), *spec_key(guided.structured_outputs)), threading.Lock()
    )
    lock.acquire()  # the compile waits on this lock until after the deadline
    try:
        outs = llm.generate(
            [_chat(llm, "A number?"), _chat(llm, "Hello?")],
            [guided, SamplingParams(max_tokens=6, temperature=0)],
            use_tqdm=False,
        )
    finally:
        lock.release()
    assert outs[0].outputs[0].finish_reason == "error"
    assert "timed out" in str(outs[0].outputs[0].stop_reason)
    assert outs[1].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 6
    engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "so, needle",
    [
        (lambda: StructuredOutputsParams(json='{"type": "object", "properties": '), "json"),
        (lambda: StructuredOutputsParams(regex="(unclosed"), "regex"),
        (lambda: StructuredOutputsParams(grammar="root ::= ( 'a' "), "grammar"),
        (lambda: StructuredOutputsParams(json={"type": "strange"}), "json"),
        # Unsatisfiable: no string is both >= 5 and <= 2 long; no count is {3,1}.
        (
            lambda: StructuredOutputsParams(
                json={"type": "string", "minLength": 5, "maxLength": 2}
            ),
            "json",
        ),  # fmt: skip
        (lambda: StructuredOutputsParams(regex="a{3,1}"), "regex"),
    ],
)
def test_a_bad_spec_fails_its_request_alone(llm: LLM, so, needle) -> None:
    ok = _chat(llm, "Hi")
    bad = SamplingParams(max_tokens=8, structured_outputs=so())
    with pytest.raises(ValueError, match=f"(?i)invalid structured outputs \\({needle}"):
        llm.generate([ok, ok], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate([ok], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_structured_outputs_params_need_exactly_one_spec() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_the_grammar_starts_after_the_reasoning_end(llm: LLM) -> None:
    """`reasoning_end` (what `--reasoning-parser` sets): the tokens up to that text are
    free, the grammar constrains only what follows. Here the "reasoning" is the model
    counting (digits the regex forbids) and the end marker the number it reaches."""
    prompt = "1, 2, 3, 4, 5, 6,"
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert free[0].outputs[0].text.startswith(" 7, 8,"), free[0].outputs[0].text
    so = StructuredOutputsParams(regex=r" [a-z]{3}", reasoning_end=" 8,")
    out = llm.generate(
        prompt, SamplingParams(max_tokens=20, temperature=0, structured_outputs=so), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    head, _, tail = out.text.partition(" 8,")
    assert head == " 7," and re.fullmatch(r" [a-z]{3}", tail), out.text


def test_auto_routes_by_keyword_and_reports_the_backend(tmp_path) -> None:
    """The issue's case: top-level `required` beside `anyOf` (xgrammar dropped both) goes
    to llguidance under "auto", and the finished output validates; with a `not` (neither
    backend enforces it here) the request is refused naming it. The backend shows in the
    stats and in the step trace."""
    from pagedinfer.core.trace import load_trace

    trace = tmp_path / "run.jsonl"
    llm = LLM(dtype="float32", kv_cache_memory_bytes=32 * 2**20, max_model_len=512,
              log_stats_interval_s=0, trace_path=str(trace))  # fmt: skip
    either = [{"required": ["age"]}, {"properties": {"name": {"const": "Bob"}}}]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name"], "additionalProperties": False, "anyOf": either}  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=80, temperature=0, structured_outputs=so)
    out = llm.generate(_chat(llm, "Describe a person as JSON."), params, use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop", completion.text
    jsonschema.validate(json.loads(completion.text), schema)
    stats = llm.get_stats()
    assert stats["grammar_requests_guidance"] == 1 and stats["grammar_requests_xgrammar"] == 0
    _, steps = load_trace(str(trace))
    grammars = {c.get("grammar") for s in steps for c in s["scheduled"]}
    assert grammars == {"guidance"}
    negated = {**schema, "not": {"properties": {"age": {"const": 30}}}}
    with pytest.raises(ValueError, match="not"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json=negated)))
