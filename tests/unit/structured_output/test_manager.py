"""StructuredOutputManager with real backends and the real tokenizer: compile, the per-step
bitmask (one row per request, k + 1 rows for a request verifying k draft tokens), draft
validation, and the model runner mapping mask rows onto logits rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedinfer.config import EngineConfig
from pagedinfer.core.request import RequestStatus
from pagedinfer.core.sched_output import CachedRequestData, GrammarOutput, SchedulerOutput
from pagedinfer.sampling_params import SamplingParams, StructuredOutputsParams
from pagedinfer.structured_output.manager import StructuredOutputManager
from pagedinfer.worker.model_runner import ModelRunner
from tests.unit.core.utils import create_requests

VOCAB = 49152
BACKENDS = ["xgrammar", "guidance"]
REGEX = r"(cat|dog)-[0-9]{3}"


def allowed(bitmask: np.ndarray, row: int) -> np.ndarray:
    packed = np.ascontiguousarray(bitmask[row]).view(np.uint8)
    return np.unpackbits(packed, bitorder="little")[:VOCAB].astype(bool)


@pytest.fixture(scope="module")
def manager():
    made = StructuredOutputManager(EngineConfig(), VOCAB, max_num_seqs=8)
    yield made
    made.shutdown()


@pytest.fixture(scope="module")
def tokenizer(manager):
    from pagedinfer.tokenizer import Tokenizer

    return Tokenizer.from_model_path(None)


def guided_request(manager, backend: str, req_id: str, regex: str = REGEX):
    (req,) = create_requests(1, start=int(req_id))
    params = StructuredOutputsParams(regex=regex)
    params.resolved_backend = backend
    req.sampling_params = SamplingParams(max_tokens=16, structured_outputs=params)
    req.structured_output_request = None
    manager.grammar_init(req)
    req.structured_output_request.future.result(timeout=60)
    assert req.structured_output_request.is_ready() and req.structured_output_request.grammar
    return req


def step(req_ids: list[str], drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
    drafts = drafts or {}
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r: 1 + len(drafts.get(r, [])) for r in req_ids},
        total_num_scheduled_tokens=sum(1 + len(drafts.get(r, [])) for r in req_ids),
        scheduled_spec_decode_tokens=drafts,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_rows_are_the_masks_along_the_draft(manager, tokenizer, backend) -> None:
    req = guided_request(manager, backend, "1")
    other = guided_request(manager, backend, "2")
    text = tokenizer.encode("dog-417", add_special_tokens=False)
    assert len(text) >= 3
    for token in text[:1]:  # move `req` one token in, as after a first step
        assert manager.accept_token(req, token) is None
    drafts = text[1:]
    requests = {"1": req, "2": other}

    out = manager.grammar_bitmask(requests, step(["2", "1"], {"1": drafts}))
    assert out is not None and out.req_ids == ["2", "1"]
    assert out.num_rows == [1, 1 + len(drafts)] and out.bitmask.shape[0] == 2 + len(drafts)

    # The reference: a fresh request's grammar walked along the same tokens.
    ref = guided_request(manager, backend, "3")
    fresh = allowed(manager.grammar_bitmask({"3": ref}, step(["3"])).bitmask, 0)
    assert (allowed(out.bitmask, 0) == fresh).all()  # `other`, not moved yet
    assert manager.accept_token(ref, text[0]) is None
    for j in range(len(drafts) + 1):
        expected = manager.grammar_bitmask({"3": ref}, step(["3"])).bitmask
        assert (allowed(out.bitmask, 1 + j) == allowed(expected, 0)).all(), j
        if j < len(drafts):
            assert manager.accept_token(ref, drafts[j]) is None
    # Row j allows draft j.
    for j, token in enumerate(drafts):
        assert allowed(out.bitmask, 1 + j)[token]
    # The grammar of `req` was rolled back: its next mask is unchanged.
    again = manager.grammar_bitmask(requests, step(["1"])).bitmask
    assert (allowed(again, 0) == allowed(out.bitmask, 1)).all()
    assert manager.validate_tokens(req, drafts) == drafts


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_draft_token_leaves_the_later_rows_open(manager, tokenizer, backend) -> None:
    req = guided_request(manager, backend, "4")
    good = tokenizer.encode("cat", add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)
    drafts = good + bad + good
    # Validation trims the draft to what the grammar takes, and moves nothing.
    assert manager.validate_tokens(req, drafts) == good
    assert manager.validate_tokens(req, bad + good) == []
    out = manager.grammar_bitmask({"4": req}, step(["4"], {"4": drafts}))
    n = len(good)
    assert out.num_rows == [1 + len(drafts)]
    assert allowed(out.bitmask, n).sum() < VOCAB and not allowed(out.bitmask, n)[bad[0]]
    for row in range(n + 1, 1 + len(drafts)):  # after the refused token: anything
        assert allowed(out.bitmask, row).all(), row
    # Rolled back to the start: "cat" is allowed again, nothing was consumed.
    assert manager.validate_tokens(req, good) == good


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_draft_that_ends_the_grammar_is_validated_with_eos(manager, tokenizer, backend) -> None:
    req = guided_request(manager, backend, "5")
    eos = req.structured_output_request.grammar.eos_token_id
    text = tokenizer.encode("cat-123", add_special_tokens=False)
    assert manager.validate_tokens(req, text + [eos, text[0]]) == text + [eos]
    assert manager.validate_tokens(req, text[:-1] + [eos]) == text[:-1]
    out = manager.grammar_bitmask({"5": req}, step(["5"], {"5": text + [eos]}))
    last = allowed(out.bitmask, len(text))  # after the full text: only EOS
    assert last[eos] and last.sum() == 1
    for token in text:
        assert manager.accept_token(req, token) is None
    assert manager.accept_token(req, eos) is RequestStatus.FINISHED_STOPPED


def test_the_runner_maps_mask_rows_onto_logits_rows() -> None:
    words = VOCAB // 32
    rows = np.zeros((4, words), dtype=np.int32)
    for i in range(4):  # row i allows token i + 10 only
        rows[i, (10 + i) // 32] = 1 << ((10 + i) % 32)
    # Request "a" verifies two drafts (three logits rows starting at 2), "b" one row at 0;
    # "c" is in the mask but not in this step's logits (e.g. aborted): its row is skipped.
    out = GrammarOutput(["a", "c", "b"], rows, num_rows=[2, 1, 1])
    logits = torch.zeros(5, VOCAB)
    ModelRunner._apply_grammar_bitmask(logits, {"b": 0, "a": 2}, out)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[13], list(range(VOCAB)), [10], [11], list(range(VOCAB))]


WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
           "days": {"type": "integer", "minimum": 1}}, "required": ["city", "days"]}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_tokens", [40, 12, 3])
def test_close_within_max_tokens_forces_a_valid_end(manager, tokenizer, backend, max_tokens):
    """A "model" that loops inside a string forever: with `close_within_max_tokens`, its
    last rows allow one token each (the closing), and the request ends within max_tokens
    with JSON that validates, reason "length". With too small a budget (3) the closing
    cannot fit: forced from the first token, it ends cut, as without the option."""
    jsonschema = pytest.importorskip("jsonschema")
    (req,) = create_requests(1, start=40 + max_tokens)
    params = StructuredOutputsParams(json=WEATHER, close_within_max_tokens=True)
    params.resolved_backend = backend
    req.sampling_params = SamplingParams(max_tokens=max_tokens, structured_outputs=params)
    req.max_tokens = max_tokens
    req.structured_output_request = None
    manager.grammar_init(req)
    req.structured_output_request.future.result(timeout=60)
    assert req.structured_output_request.is_ready()
    script = '{"city":"'  # then "ab" forever
    loop = tokenizer.encode("ab", add_special_tokens=False)[0]
    end = None
    forced = 0
    while end is None and req.num_output_tokens < max_tokens:
        out = manager.grammar_bitmask({req.request_id: req}, step([req.request_id]))
        ok = np.flatnonzero(allowed(out.bitmask, 0))
        if script:  # the allowed token that writes most of the script
            texts = {int(t): tokenizer.decode([int(t)]) for t in ok}
            token = max((t for t in texts if texts[t] and script.startswith(texts[t])),
                        key=lambda t: len(texts[t]))  # fmt: skip
            script = script[len(texts[token]) :]
        elif len(ok) == 1:
            token, forced = int(ok[0]), forced + 1
        else:
            token = loop
            assert loop in ok
        req.append_output_token_ids(token)
        end = manager.accept_token(req, token)
    text = tokenizer.decode(req.output_token_ids)
    if max_tokens == 3:
        # Cut: from the first token on, the rows held the minimal object's tokens alone.
        assert end is None and '{"city":"","days":1}'.startswith(text) and len(text) > 3
        return
    assert end == RequestStatus.FINISHED_LENGTH_CAPPED and forced >= 2
    assert req.num_output_tokens <= max_tokens
    value = json.loads(text)
    jsonschema.validate(value, WEATHER)
    assert value["days"] == 1 and value["city"].startswith("ab" if max_tokens > 12 else "")


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_repeated_call_list_invents_no_call(manager, tokenizer, backend) -> None:
    """A "model" that repeats one call without end in a parallel list (as the default model
    does with `get_time`): the list is closed between two calls once another could not be
    finished, so every call in it is one the model wrote, none made up by the closing."""
    from pagedinfer.entrypoints.openai.protocol import ChatTool
    from pagedinfer.entrypoints.openai.tool_choice import required_schema

    tools = [ChatTool.model_validate({"type": "function", "function": f}) for f in (
        {"name": "search_web", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}}, "required": ["query"]}},
        {"name": "get_time"})]  # fmt: skip
    schema = required_schema(tools, parallel=True)
    (req,) = create_requests(1, start=90)
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                     close_within_max_tokens=True)  # fmt: skip
    params.resolved_backend = backend
    req.sampling_params = SamplingParams(max_tokens=70, structured_outputs=params)
    req.max_tokens = 70
    req.structured_output_request = None
    manager.grammar_init(req)
    req.structured_output_request.future.result(timeout=60)
    assert req.structured_output_request.is_ready()
    script = tokenizer.encode('[' + '{"name":"get_time","parameters":{}},' * 20,
                              add_special_tokens=False)  # fmt: skip
    end = None
    while end is None and req.num_output_tokens < 70:
        out = manager.grammar_bitmask({req.request_id: req}, step([req.request_id]))
        ok = np.flatnonzero(allowed(out.bitmask, 0))
        token = script.pop(0)
        if token not in ok:  # forced: the closing
            assert len(ok) == 1
            token = int(ok[0])
        req.append_output_token_ids(token)
        end = manager.accept_token(req, token)
    calls = json.loads(tokenizer.decode(req.output_token_ids))
    assert end == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens <= 70
    assert len(calls) >= 3 and all(c == {"name": "get_time", "parameters": {}} for c in calls)
