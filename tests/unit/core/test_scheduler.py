"""Scheduler behaviour on hand-built outputs (vLLM's tests/v1/core style)."""

from __future__ import annotations

from pagedinfer.core.request import RequestStatus

from .utils import (
    EOS,
    ScriptedGrammar,
    add_guided_request,
    create_requests,
    create_scheduler,
    make_output,
)


def test_schedule_new_requests_whole_prompts() -> None:
    sched = create_scheduler()
    for r in create_requests(3, num_tokens=20):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 20, "1": 20, "2": 20}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["0", "1", "2"]
    # 20 tokens at block size 16 need 2 blocks each.
    assert [len(n.block_ids) for n in so.scheduled_new_reqs] == [2, 2, 2]
    sched.update_from_output(so, make_output(so, sched))
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"0": 1, "1": 1, "2": 1}
    assert so2.scheduled_cached_reqs.req_ids == ["0", "1", "2"]
    assert so2.scheduled_new_reqs == []


def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end() -> None:
    sched = create_scheduler(max_num_batched_tokens=32)
    (req,) = create_requests(1, num_tokens=100)
    sched.add_request(req)
    chunks = []
    outputs = []
    for _ in range(4):
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens["0"])
        outputs.append(sched.update_from_output(so, make_output(so, sched)))
    assert chunks == [32, 32, 32, 4]
    assert [len(o.outputs) for o in outputs] == [0, 0, 0, 1]
    assert req.output_token_ids == [7]


def test_decodes_first_then_new_prefill_chunk_fills_budget() -> None:
    sched = create_scheduler(max_num_batched_tokens=50)
    a, b = create_requests(2, num_tokens=40)
    sched.add_request(a)
    so = sched.schedule()
    sched.update_from_output(so, make_output(so, sched))
    sched.add_request(b)
    so = sched.schedule()
    # Running request a decodes 1 token; b gets the remaining 49 -> whole 40-token prompt.
    assert so.num_scheduled_tokens == {"0": 1, "1": 40}
    assert list(so.num_scheduled_tokens) == ["0", "1"]  # running first


def test_long_prefill_threshold_caps_tokens_per_step() -> None:
    sched = create_scheduler(long_prefill_token_threshold=8)
    (req,) = create_requests(1, num_tokens=20)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        so = sched.schedule()
        seen.append(so.num_scheduled_tokens["0"])
        sched.update_from_output(so, make_output(so, sched))
    assert seen == [8, 8, 4]


def test_chunked_prefill_disabled_waits_for_budget() -> None:
    sched = create_scheduler(max_num_batched_tokens=30, enable_chunked_prefill=False)
    a, b = create_requests(2, num_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 20}  # b does not fit the remaining 10


def test_max_num_seqs_is_respected() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(5):
        sched.add_request(r)
    so = sched.schedule()
    assert len(so.num_scheduled_tokens) == 2
    assert len(sched.waiting) == 3


def test_stop_on_eos_stop_token_and_max_tokens() -> None:
    sched = create_scheduler()
    eos_req, stop_req, len_req = create_requests(3, max_tokens=3, stop_token_ids=[42])
    for r in (eos_req, stop_req, len_req):
        sched.add_request(r)
    so = sched.schedule()
    out = make_output(so, sched)
    out.sampled_token_ids = [[EOS], [42], [5]]
    eco = sched.update_from_output(so, out)
    reasons = {o.request_id: (str(o.finish_reason), o.stop_reason) for o in eco.outputs}
    assert reasons["0"] == ("stop", None)
    assert reasons["1"] == ("stop", 42)
    assert eco.outputs[2].finish_reason is None
    for _ in range(2):
        so = sched.schedule()
        eco = sched.update_from_output(so, make_output(so, sched, token=5))
    assert str(eco.outputs[0].finish_reason) == "length"
    assert len_req.num_output_tokens == 3
    assert sched.kv_cache_manager.get_num_free_blocks() == 1000


def test_min_tokens_defers_eos() -> None:
    sched = create_scheduler()
    (req,) = create_requests(1, min_tokens=2)
    sched.add_request(req)
    finished = []
    for _ in range(2):
        so = sched.schedule()
        eco = sched.update_from_output(so, make_output(so, sched, token=EOS))
        finished.append(eco.outputs[0].finish_reason is not None)
    assert finished == [False, True]  # the first EOS is below min_tokens and ignored
    assert req.output_token_ids == [EOS, EOS]


def test_max_model_len_caps_generation() -> None:
    sched = create_scheduler(max_model_len=12)
    (req,) = create_requests(1, num_tokens=10, max_tokens=100)
    sched.add_request(req)
    for _ in range(2):
        so = sched.schedule()
        eco = sched.update_from_output(so, make_output(so, sched))
    assert str(eco.outputs[0].finish_reason) == "length"
    assert req.num_tokens == 12


def test_max_model_len_caps_generation_even_below_min_tokens() -> None:
    # min_tokens only holds back stop tokens; the context length is a hard cap (a request
    # asking for more than fits used to run past max_model_len and never finish).
    sched = create_scheduler(max_model_len=12)
    (req,) = create_requests(1, num_tokens=10, max_tokens=20, min_tokens=20)
    sched.add_request(req)
    for _ in range(2):
        so = sched.schedule()
        eco = sched.update_from_output(so, make_output(so, sched))
    assert str(eco.outputs[0].finish_reason) == "length"
    assert req.num_tokens == 12 and not sched.has_unfinished_requests()


def test_abort_frees_blocks_at_once() -> None:
    sched = create_scheduler(num_blocks=10)
    a, b = create_requests(2, num_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    assert sched.kv_cache_manager.get_num_free_blocks() == 4
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == 7
    sched.finish_requests("1", RequestStatus.FINISHED_ABORTED)  # aborted while running
    assert sched.kv_cache_manager.get_num_free_blocks() == 10
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"0", "1"}


def test_abort_waiting_request() -> None:
    sched = create_scheduler(max_num_seqs=1)
    a, b = create_requests(2)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    sched.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0 and b.status == RequestStatus.FINISHED_ABORTED


def test_preemption_recompute_newest_first_and_no_admission() -> None:
    # 6 blocks of 4 tokens. Two requests of 8 tokens take 2 blocks each.
    sched = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b, c = create_requests(3, num_tokens=8, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, make_output(so, sched))
    sched.add_request(c)
    # Decode until the pool is exhausted; then b (newest running) is preempted.
    preempted_step = None
    for step in range(10):
        so = sched.schedule()
        if so.preempted_req_ids:
            preempted_step = step
            assert so.preempted_req_ids == {"1"}
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert sched.waiting.peek() is b  # resumes first, ahead of c
            assert "2" not in so.num_scheduled_tokens  # no admission in a preempting step
            break
        sched.update_from_output(so, make_output(so, sched))
    assert preempted_step is not None
    sched.update_from_output(so, make_output(so, sched))
    sched.kv_cache_manager.block_pool.check_integrity()


def test_priority_policy_orders_waiting_and_preempts_worst() -> None:
    sched = create_scheduler(policy="priority", max_num_seqs=1)
    reqs = create_requests(3)
    for r, prio in zip(reqs, [5, 1, 3]):
        r.priority = prio
        sched.add_request(r)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["1"]  # lowest value first

    sched = create_scheduler(policy="priority", num_blocks=4, block_size=4)
    a, b = create_requests(2, num_tokens=7, max_tokens=30)
    a.priority, b.priority = 0, 9
    sched.add_request(b)
    sched.add_request(a)
    for _ in range(5):
        so = sched.schedule()
        if so.preempted_req_ids:
            break
        sched.update_from_output(so, make_output(so, sched))
    # b was added first but has the worse priority: it is the victim.
    assert so.preempted_req_ids == {"1"}
    assert list(so.num_scheduled_tokens) == ["0"]


class _FakeGrammarRequest:
    """Stands in for a StructuredOutputRequest whose compile the test finishes by hand."""

    def __init__(self) -> None:
        self.grammar = None
        self.error: str | None = None
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready


def test_request_waiting_for_its_grammar_keeps_its_place_and_blocks_nobody() -> None:
    sched = create_scheduler()
    fsm, plain = create_requests(2)
    fsm.status = RequestStatus.WAITING_FOR_FSM
    fsm.structured_output_request = _FakeGrammarRequest()  # type: ignore[assignment]
    sched.add_request(fsm)
    sched.add_request(plain)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [plain.request_id]  # the other one went ahead
    assert fsm.status == RequestStatus.WAITING_FOR_FSM and sched.waiting.peek() is fsm
    sched.update_from_output(so, make_output(so, sched))
    fsm.structured_output_request.ready = True  # type: ignore[union-attr]
    so = sched.schedule()
    assert fsm.request_id in so.num_scheduled_tokens and fsm.status == RequestStatus.RUNNING


def test_request_whose_grammar_failed_finishes_alone_with_the_error() -> None:
    sched = create_scheduler()
    bad, plain = create_requests(2)
    bad.status = RequestStatus.WAITING_FOR_FSM
    failed = _FakeGrammarRequest()
    failed.ready, failed.error = True, "ValueError: bad schema"
    bad.structured_output_request = failed  # type: ignore[assignment]
    sched.add_request(bad)
    sched.add_request(plain)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [plain.request_id]
    eco = sched.update_from_output(so, make_output(so, sched))
    errors = [o for o in eco.outputs if o.request_id == bad.request_id]
    assert len(errors) == 1 and str(errors[0].finish_reason) == "error"
    assert "bad schema" in str(errors[0].stop_reason)
    assert bad.request_id not in sched.requests and len(sched.waiting) == 0
    assert bad.request_id in sched.finished_req_ids


def _guided_scheduler(grammar: ScriptedGrammar):
    sched = create_scheduler()
    (req,) = create_requests(1, max_tokens=10)
    add_guided_request(sched, req, grammar)
    return sched, req


def test_a_complete_grammar_finishes_its_request_with_stop() -> None:
    sched, req = _guided_scheduler(ScriptedGrammar([7, 8]))
    reasons = []
    for token in (7, 8):
        so = sched.schedule()
        eco = sched.update_from_output(so, make_output(so, sched, token=token))
        reasons.append(eco.outputs[0].finish_reason)
    assert reasons[0] is None and str(reasons[1]) == "stop"
    assert req.output_token_ids == [7, 8] and not sched.has_unfinished_requests()


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error() -> None:
    sched, req = _guided_scheduler(ScriptedGrammar([7, 8]))
    so = sched.schedule()
    eco = sched.update_from_output(so, make_output(so, sched, token=9))  # a dead end
    (out,) = eco.outputs
    assert str(out.finish_reason) == "error" and "no continuation" in str(out.stop_reason)
    assert not sched.has_unfinished_requests()
