"""Tests for `pagedinfer.engine.output_processor` and `pagedinfer.engine.logprobs`.

The engine core is faked: tests hand-build `EngineCoreOutput`s (as the scheduler would emit
them, one step at a time) and check the `RequestOutput`s: output kinds, stop strings ->
`reqs_to_abort`, stop tokens, n>1 fan-in, logprobs dicts, the per-request queue hook, aborts.

Uses the real SmolLM2 tokenizer (see test_detokenizer.py for how it is loaded and cached).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from pagedinfer.core.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from pagedinfer.engine.output_processor import OutputProcessor, ParentRequest
from pagedinfer.outputs import RequestOutput
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EOS = 2  # <|im_end|>
CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


class _Tok:
    """Stand-in for `pagedinfer.tokenizer.Tokenizer` over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = {i for i, tok in added.items() if tok.special}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _load_smollm2_backend(config: pytest.Config) -> BackendTokenizer:
    # Our own GGUF tokenizer (tests/unit/test_tokenizer.py proves it encodes exactly like
    # transformers'); loading it takes ~0.3 s.
    from pagedinfer.gguf_metadata import find_default_model
    from pagedinfer.tokenizer import Tokenizer

    backend: BackendTokenizer = Tokenizer.from_gguf(find_default_model()).backend
    return backend


@pytest.fixture(scope="module")
def tok(pytestconfig: pytest.Config) -> _Tok:
    return _Tok(_load_smollm2_backend(pytestconfig))


PROMPT = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def _request(
    tok: _Tok, request_id: str = "r", prompt: str = PROMPT, **kw: object
) -> EngineCoreRequest:
    return _request_with(tok, request_id, SamplingParams(**kw), prompt)  # type: ignore[arg-type]


def _request_with(
    tok: _Tok, request_id: str, params: SamplingParams, prompt: str = PROMPT
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tok.encode(prompt),
        sampling_params=params,
        eos_token_id=_EOS,
        arrival_time=100.0,
    )


def _processor(tok: _Tok, *requests: EngineCoreRequest) -> OutputProcessor:
    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    for req in requests:
        proc.add_request(req, PROMPT)
    return proc


def _out(
    request_id: str, ids: list[int], finish: FinishReason | None = None, **kw: object
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, ids, finish_reason=finish, **kw)  # type: ignore[arg-type]


def _run(
    proc: OutputProcessor, request_id: str, ids: list[int], finish: FinishReason, chunk: int = 1
) -> list[RequestOutput]:
    """Stream ids one chunk per step, the last step carrying `finish`; stop early if the
    front end finishes the request (stop string)."""
    outputs: list[RequestOutput] = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        step = proc.process_outputs(
            [_out(request_id, ids[i : i + chunk], finish if last else None)]
        )
        outputs += step.request_outputs
        if outputs and outputs[-1].finished:
            break
    return outputs


# ------------------------------------------------------------------------------ output kinds


def test_cumulative(tok: _Tok) -> None:
    ids = tok.encode("Hello there, 世界!")
    proc = _processor(tok, _request(tok, max_tokens=len(ids)))
    outs = _run(proc, "r", ids, FinishReason.LENGTH)
    assert len(outs) == len(ids)
    for n, ro in enumerate(outs, 1):
        assert ro.request_id == "r" and ro.prompt == PROMPT
        assert ro.outputs[0].token_ids == ids[:n]
        assert tok.decode(ids).startswith(ro.outputs[0].text)
    final = outs[-1]
    assert final.finished and final.outputs[0].text == "Hello there, 世界!"
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].stop_reason is None
    assert not outs[0].finished and outs[0].outputs[0].finish_reason is None
    assert final.outputs[0].logprobs is None and final.outputs[0].cumulative_logprob is None
    assert not proc.has_unfinished_requests() and proc.get_num_unfinished_requests() == 0


def test_cumulative_outputs_are_snapshots(tok: _Tok) -> None:
    ids = tok.encode("a b c")
    proc = _processor(tok, _request(tok))
    outs = _run(proc, "r", ids, FinishReason.LENGTH)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]


def test_delta(tok: _Tok) -> None:
    ids = tok.encode("Stream me 😀 please")
    proc = _processor(tok, _request(tok, output_kind=DELTA))
    outs = _run(proc, "r", ids, FinishReason.LENGTH)
    assert "".join(o.outputs[0].text for o in outs) == "Stream me 😀 please"
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_final_only(tok: _Tok) -> None:
    ids = tok.encode("Only at the end")
    proc = _processor(tok, _request(tok, output_kind=FINAL_ONLY))
    outs = _run(proc, "r", ids, FinishReason.LENGTH)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == "Only at the end"
    assert outs[0].outputs[0].token_ids == ids


def test_detokenize_false(tok: _Tok) -> None:
    ids = tok.encode("no text")
    proc = _processor(tok, _request(tok, detokenize=False))
    outs = _run(proc, "r", ids, FinishReason.LENGTH)
    assert outs[-1].outputs[0].text == "" and outs[-1].outputs[0].token_ids == ids


def test_metrics_and_cached_tokens(tok: _Tok) -> None:
    proc = _processor(tok, _request(tok))
    ro = proc.process_outputs([_out("r", [42], num_cached_tokens=7)], 101.0).request_outputs[0]
    assert ro.num_cached_tokens == 7
    assert ro.metrics == {"arrival_time": 100.0, "first_token_time": 101.0}
    ro = proc.process_outputs([_out("r", [43], FinishReason.LENGTH)], 102.0).request_outputs[0]
    assert ro.num_cached_tokens == 7  # sent once, kept
    assert ro.metrics == {
        "arrival_time": 100.0,
        "first_token_time": 101.0,
        "finished_time": 102.0,
    }


# ------------------------------------------------------------------------------ stop handling


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_finishes_and_aborts(tok: _Tok, include: bool) -> None:
    ids = tok.encode("One. Two. THE END. Three.")
    proc = _processor(tok, _request(tok, stop=["THE END"], include_stop_str_in_output=include))
    aborts: list[str] = []
    final = None
    for token_id in ids:
        step = proc.process_outputs([_out("r", [token_id])])
        aborts += step.reqs_to_abort
        if step.request_outputs and step.request_outputs[-1].finished:
            final = step.request_outputs[-1]
            break
    assert final is not None and aborts == ["r"]
    completion = final.outputs[0]
    assert completion.text == ("One. Two. THE END" if include else "One. Two. ")
    assert completion.finish_reason == "stop" and completion.stop_reason == "THE END"
    # The request is gone; a late output of the engine core (before it aborted) is ignored.
    assert not proc.has_unfinished_requests()
    assert proc.process_outputs([_out("r", [5])]).request_outputs == []


def test_stop_string_on_engine_finished_step_needs_no_abort(tok: _Tok) -> None:
    ids = tok.encode("abc STOP")
    proc = _processor(tok, _request(tok, stop=["STOP"]))
    step = proc.process_outputs([_out("r", ids, FinishReason.LENGTH)])
    assert step.reqs_to_abort == []
    assert step.request_outputs[0].outputs[0].finish_reason == "stop"
    assert step.request_outputs[0].outputs[0].stop_reason == "STOP"


def test_eos_and_stop_token(tok: _Tok) -> None:
    ids = tok.encode("Bye")
    proc = _processor(tok, _request(tok, "a"), _request(tok, "b", stop_token_ids=[ids[-1]]))
    step = proc.process_outputs(
        [
            _out("a", [*ids, _EOS], FinishReason.STOP),
            _out("b", ids, FinishReason.STOP, stop_reason=ids[-1]),
        ]
    )
    a, b = (ro.outputs[0] for ro in step.request_outputs)
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        "Bye",
        [*ids, _EOS],
        "stop",
        None,
    )
    # A non-special stop token stays in token_ids but not in the text.
    assert b.text == tok.decode(ids[:-1]) and b.token_ids == ids and b.stop_reason == ids[-1]
    assert step.reqs_to_abort == []


def test_abort_fields_pass_through(tok: _Tok) -> None:
    proc = _processor(tok, _request(tok))
    ro = proc.process_outputs([_out("r", [], FinishReason.ABORT)]).request_outputs[0]
    assert ro.finished and ro.outputs[0].finish_reason == "abort"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(min_size=1, max_size=40),
    chunk=st.integers(1, 3),
    stop=st.sampled_from([None, ["."], ["e", "\n"], ["the end"]]),
)
def test_delta_concatenation_equals_cumulative_final(
    tok: _Tok, text: str, chunk: int, stop: list[str] | None
) -> None:
    ids = tok.encode(text)
    assume(ids)  # some control characters encode to no token at all: nothing to stream
    proc = _processor(
        tok,
        _request(tok, "c", stop=stop, logprobs=0),
        _request(tok, "d", stop=stop, logprobs=0, output_kind=DELTA),
    )
    texts: dict[str, list[str]] = {"c": [], "d": []}
    tokens: dict[str, list[int]] = {"c": [], "d": []}
    finals: dict[str, RequestOutput] = {}
    for i in range(0, len(ids), chunk):
        finish = FinishReason.LENGTH if i + chunk >= len(ids) else None
        new = ids[i : i + chunk]
        rows = [[t] for t in new]
        lps = LogprobsLists(rows, [[-0.5]] * len(new), [1] * len(new))
        step = proc.process_outputs(
            [_out(r, new, finish, new_logprobs=lps) for r in ("c", "d") if r not in finals]
        )
        for ro in step.request_outputs:
            texts[ro.request_id].append(ro.outputs[0].text)
            tokens[ro.request_id] += ro.outputs[0].token_ids
            assert len(ro.outputs[0].logprobs or []) == len(ro.outputs[0].token_ids)
            if ro.finished:
                finals[ro.request_id] = ro
        if len(finals) == 2:
            break
    cumulative = finals["c"].outputs[0]
    assert "".join(texts["d"]) == cumulative.text
    assert tokens["d"] == cumulative.token_ids
    # Streamed cumulative texts never showed anything the final text does not keep.
    assert all(cumulative.text.startswith(t) for t in texts["c"])
    assert finals["d"].outputs[0].cumulative_logprob == cumulative.cumulative_logprob


# ------------------------------------------------------------------------------------- n > 1


def _add_parent(
    tok: _Tok, proc: OutputProcessor, request_id: str, params: SamplingParams, queue: object = None
) -> list[str]:
    parent = ParentRequest(request_id, params)
    child_ids = []
    for i in range(params.n):
        child_id, child_params = parent.get_child_info(i)
        proc.add_request(_request_with(tok, child_id, child_params), PROMPT, parent, i, queue)  # type: ignore[arg-type]
        child_ids.append(child_id)
    return child_ids


def test_parent_child_info() -> None:
    parent = ParentRequest("p", SamplingParams(n=3, seed=10, temperature=0.8))
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_p", "1_p", "2_p"]
    assert [p.n for _, p in infos] == [1, 1, 1]
    assert [p.seed for _, p in infos] == [10, 11, 12]
    assert parent.sampling_params.n == 3 and parent.sampling_params.seed == 10
    unseeded = ParentRequest("q", SamplingParams(n=2, temperature=0.8))
    assert unseeded.get_child_info(1)[1].seed is None
    with pytest.raises(IndexError):
        parent.get_child_info(3)


def test_n_cumulative_merges_children_by_index(tok: _Tok) -> None:
    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    c0, c1 = _add_parent(tok, proc, "p", SamplingParams(n=2, temperature=1.0))
    assert proc.get_num_unfinished_requests() == 2
    a, b = tok.encode(" alpha beta"), tok.encode(" gamma")
    # Child 1 reports first: outputs are still ordered by index.
    step = proc.process_outputs([_out(c1, b[:1]), _out(c0, a[:1])])
    (ro,) = step.request_outputs
    assert ro.request_id == "p" and not ro.finished
    assert [o.index for o in ro.outputs] == [0, 1]
    step = proc.process_outputs([_out(c1, b[1:], FinishReason.LENGTH), _out(c0, a[1:2])])
    (ro,) = step.request_outputs
    assert not ro.finished and ro.outputs[1].finish_reason == "length"
    step = proc.process_outputs([_out(c0, a[2:], FinishReason.STOP)])
    (ro,) = step.request_outputs
    assert ro.finished
    assert [o.text for o in ro.outputs] == [" alpha beta", " gamma"]
    assert [o.finish_reason for o in ro.outputs] == ["stop", "length"]
    assert ro.prompt_token_ids == tok.encode(PROMPT)
    assert not proc.has_unfinished_requests() and not proc.parent_requests


def test_n_delta_and_final_only(tok: _Tok) -> None:
    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    d0, d1 = _add_parent(tok, proc, "d", SamplingParams(n=2, output_kind=DELTA))
    f0, f1 = _add_parent(tok, proc, "f", SamplingParams(n=2, output_kind=FINAL_ONLY))
    x, y = tok.encode(" one two"), tok.encode(" three four")
    step = proc.process_outputs(
        [_out(d0, x[:1]), _out(f0, x[:1]), _out(f1, y, FinishReason.LENGTH)]
    )
    (ro,) = step.request_outputs  # FINAL_ONLY waits for both children
    assert ro.request_id == "d" and [o.index for o in ro.outputs] == [0]
    step = proc.process_outputs(
        [
            _out(d1, y, FinishReason.LENGTH),
            _out(d0, x[1:], FinishReason.LENGTH),
            _out(f0, x[1:], FinishReason.LENGTH),
        ]
    )
    d, f = step.request_outputs
    assert d.request_id == "d" and d.finished
    assert [(o.index, o.text) for o in d.outputs] == [
        (0, x_text := tok.decode(x[1:])),
        (1, tok.decode(y)),
    ]
    assert x_text == " two"
    assert f.request_id == "f" and f.finished
    assert [(o.index, o.text, o.token_ids) for o in f.outputs] == [
        (0, " one two", x),
        (1, " three four", y),
    ]


def test_abort_parent_and_child(tok: _Tok) -> None:
    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    children = _add_parent(tok, proc, "p", SamplingParams(n=3))
    proc.add_request(_request(tok, "solo"), PROMPT)
    assert proc.abort_requests(["1_p"]) == ["1_p"]
    assert proc.abort_requests(["p", "solo", "unknown"]) == ["0_p", "2_p", "solo"]
    assert not proc.has_unfinished_requests() and not proc.parent_requests
    assert proc.process_outputs([_out(c, [5]) for c in children]).request_outputs == []


def test_duplicate_request_id_rejected(tok: _Tok) -> None:
    proc = _processor(tok, _request(tok))
    with pytest.raises(ValueError, match="already"):
        proc.add_request(_request(tok), PROMPT)


def test_queue_hook(tok: _Tok) -> None:
    class _Queue:
        def __init__(self) -> None:
            self.items: list[RequestOutput] = []

        def put(self, item: RequestOutput) -> None:
            self.items.append(item)

    q1, q2 = _Queue(), _Queue()
    proc = OutputProcessor(tok)  # type: ignore[arg-type]
    proc.add_request(_request(tok, "a"), PROMPT, queue=q1)
    proc.add_request(_request(tok, "b"), PROMPT)
    c0, c1 = _add_parent(tok, proc, "p", SamplingParams(n=2), queue=q2)
    step = proc.process_outputs([_out("a", [42]), _out("b", [42]), _out(c0, [7]), _out(c1, [8])])
    assert [ro.request_id for ro in step.request_outputs] == ["b"]
    assert [ro.request_id for ro in q1.items] == ["a"]
    assert [ro.request_id for ro in q2.items] == ["p"]


# ---------------------------------------------------------------------------------- logprobs


def test_sample_logprobs(tok: _Tok) -> None:
    hello, world, x, y = tok.encode("Hello world x y")
    proc = _processor(tok, _request(tok, logprobs=2))
    # Row 1: sampled token is the top-1 token too. Row 2: sampled at rank 5; the sampler sent
    # one more column than requested (batch max), which is dropped.
    lps = LogprobsLists(
        logprob_token_ids=[[hello, hello, x], [world, x, y, hello]],
        logprobs=[[-0.1, -0.1, -2.5], [-3.0, -0.2, -0.9, -4.0]],
        sampled_token_ranks=[1, 5],
    )
    ro = proc.process_outputs([_out("r", [hello, world], new_logprobs=lps)]).request_outputs[0]
    completion = ro.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-3.1)
    first, second = completion.logprobs or []
    assert list(first) == [hello, x]
    assert (first[hello].rank, first[x].rank) == (1, 2)
    assert first[hello].decoded_token == "Hello"
    assert list(second) == [world, x, y]
    assert [(lp.rank, lp.logprob) for lp in second.values()] == [(5, -3.0), (1, -0.2), (2, -0.9)]
    assert second[world].decoded_token == tok.decode([world]) == " world"


def test_logprobs_delta_slicing_and_byte_tokens(tok: _Tok) -> None:
    ids = tok.encode(" 😀")
    proc = _processor(tok, _request(tok, logprobs=0, output_kind=DELTA))
    outs = []
    for token_id in ids:
        lps = LogprobsLists([[token_id]], [[-1.0]], [3])
        outs += proc.process_outputs([_out("r", [token_id], new_logprobs=lps)]).request_outputs
    for ro, token_id in zip(outs, ids, strict=True):
        (row,) = ro.outputs[0].logprobs or []
        assert list(row) == [token_id] and row[token_id].rank == 3
    # A token holding only part of a character shows as U+FFFD, like decode([id]).
    assert (outs[0].outputs[0].logprobs or [{}])[0][ids[0]].decoded_token == tok.decode(ids[:1])
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(-1.0 * len(ids))


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs(tok: _Tok, kind: RequestOutputKind) -> None:
    req = _request(tok, prompt="Hello big world", prompt_logprobs=1, output_kind=kind)
    p = req.prompt_token_ids
    assert len(p) == 3
    proc = _processor(tok, req)
    plp = LogprobsLists([[p[1], p[2]], [p[2], p[2]]], [[-1.0, -0.5], [-0.25, -0.25]], [2, 1])
    first = proc.process_outputs([_out("r", [5], new_prompt_logprobs=plp)]).request_outputs[0]
    prompt_logprobs = first.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == 3
    assert prompt_logprobs[0] is None
    assert prompt_logprobs[1] is not None and list(prompt_logprobs[1]) == [p[1], p[2]]
    assert (prompt_logprobs[1][p[1]].rank, prompt_logprobs[1][p[2]].rank) == (2, 1)
    assert prompt_logprobs[2] is not None and list(prompt_logprobs[2]) == [p[2]]
    assert math.isclose(prompt_logprobs[2][p[2]].logprob, -0.25)
    second = proc.process_outputs([_out("r", [6])]).request_outputs[0]
    # DELTA reports prompt logprobs once; CUMULATIVE every time.
    assert second.prompt_logprobs == (None if kind == DELTA else prompt_logprobs)
    assert first.outputs[0].logprobs is None


def test_log_stats_counts_generation_tokens(tok: _Tok) -> None:
    proc = OutputProcessor(tok, log_stats=True)  # type: ignore[arg-type]
    proc.add_request(_request(tok, "a"), PROMPT)
    proc.add_request(_request(tok, "b"), PROMPT)
    step = proc.process_outputs([_out("a", [1, 2]), _out("b", [3])])
    assert step.num_generation_tokens == 3
