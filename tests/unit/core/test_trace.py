"""Trace recording and rendering without a model (hand-driven scheduler)."""

from __future__ import annotations

import pytest

from pagedinfer.core.trace import StepTracer, load_trace, render_html
from tests.unit.core.utils import create_requests, create_scheduler, make_hasher, make_output


def test_preemption_and_recompute_are_marked(tmp_path) -> None:
    path = str(tmp_path / "t.jsonl")
    sched = create_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    tracer = StepTracer(path, block_size=4, num_blocks=6)
    sched.tracer = tracer
    sched.kv_cache_manager.block_pool.tracer = tracer
    hasher = make_hasher(4)
    for i in range(2):
        (r,) = create_requests(
            1, start=i, prompt_token_ids=[i + 1] * 9, block_hasher=hasher, max_tokens=8
        )
        sched.add_request(r)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        tracer.batch_launched()
        tracer.batch_finishing()
        out = sched.update_from_output(so, make_output(so, sched))
        tracer.end_step([o.request_id for o in out.outputs if o.finished], 0.5)
    tracer.close()
    header, steps = load_trace(path)
    assert any(s["preempted"] == ["1"] for s in steps)
    assert any(s["freed_blocks"] for s in steps)
    page = render_html(header, steps)
    assert "class='preempted'" in page and ">P<" in page
    assert "class='recompute" in page  # the resumed request's recomputed prefill


def test_each_record_holds_its_own_batch_with_two_in_flight(tmp_path) -> None:
    """The pipeline-parallel order: batch k+1 is scheduled and launched before batch k's
    output is handled; each record still holds only its own batch's notes."""
    path = str(tmp_path / "t.jsonl")
    tracer = StepTracer(path, block_size=4, num_blocks=8)
    tracer.note_scheduled("a", 0, 4, 4, 4, 0, [0])
    tracer.batch_launched()
    tracer.note_scheduled("b", 0, 3, 3, 3, 0, [1])
    tracer.note_block_stored(1)
    tracer.batch_launched()
    tracer.batch_finishing()  # batch 0 is back
    tracer.note_block_freed(0)
    tracer.end_step(["a"], 0.25)
    tracer.note_preempted("c")  # scheduling of a batch that launches nothing yet
    tracer.batch_finishing()  # batch 1 is back
    tracer.end_step(["b"], 0.0)
    tracer.close()
    _, steps = load_trace(path)
    assert [s["step"] for s in steps] == [0, 1]
    assert [[e["req"] for e in s["scheduled"]] for s in steps] == [["a"], ["b"]]
    assert [s["freed_blocks"] for s in steps] == [[0], []]
    assert [s["stored_blocks"] for s in steps] == [[], [1]]
    assert [s["finished"] for s in steps] == [["a"], ["b"]]
    assert [s["preempted"] for s in steps] == [[], []]  # it goes with the next launch


def test_load_trace_rejects_other_files(tmp_path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a pagedinfer trace"):
        load_trace(str(bad))
