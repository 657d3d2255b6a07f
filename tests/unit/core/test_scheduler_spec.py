"""Scheduler side of speculative decoding: drafts scheduled through the token budget with their
KV slots, rejected drafts rolled back, stops inside an accepted run, draft caps, preemption,
prefix caching of verified tokens only, and the acceptance counts."""

from __future__ import annotations

from pagedinfer.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedinfer.core.scheduler import Scheduler
from tests.unit.core.utils import (
    EOS,
    ScriptedGrammar,
    add_guided_request,
    create_requests,
    make_hasher,
)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, draft_layers=4)


def spec_scheduler(
    spec: SpeculativeConfig = NGRAM,
    num_blocks: int = 100,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        speculative_config=spec,
    )


def output(
    so: SchedulerOutput,
    tokens: dict[str, list[int]],
    drafts: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(r, []) for r in req_ids],
        draft_token_ids=drafts,
    )


def prefilled(sched: Scheduler, request: Request, first: int = 7, drafts=(1, 2, 3)) -> None:
    """Run `request`'s prompt: it samples `first` and the proposer drafts `drafts`."""
    sched.add_request(request)
    so = sched.schedule()
    assert so.num_scheduled_tokens[request.request_id] == request.num_prompt_tokens
    sched.update_from_output(
        so, output(so, {request.request_id: [first]}, {request.request_id: list(drafts)})
    )
    assert request.spec_token_ids == list(drafts)


def test_drafts_are_scheduled_with_their_slots_and_cleared() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    prefilled(sched, req)
    so = sched.schedule()
    # The sampled token plus three drafts; the drafts go to the workers and leave the request.
    assert so.num_scheduled_tokens == {req.request_id: 4}
    assert so.scheduled_spec_decode_tokens == {req.request_id: [1, 2, 3]}
    assert req.spec_token_ids == [] and req.num_computed_tokens == 6 + 1 + 3
    # 10 token positions -> 3 blocks of 4; ngram keeps no lookahead.
    assert len(sched.kv_cache_manager.get_block_ids(req.request_id)) == 3


def test_model_drafters_reserve_lookahead_slots() -> None:
    sched = spec_scheduler(DRAFT)
    assert sched.num_lookahead_tokens == 3
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    sched.add_request(req)
    sched.schedule()
    # 6 prompt tokens + 3 lookahead positions (the drafter writes KV there) -> 3 blocks.
    assert len(sched.kv_cache_manager.get_block_ids(req.request_id)) == 3


def test_rejected_drafts_are_rolled_back_and_counted() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    prefilled(sched, req)
    so = sched.schedule()
    # Drafts 1, 2 accepted, 3 rejected; the correction token is 9.
    eco = sched.update_from_output(so, output(so, {req.request_id: [1, 2, 9]}))
    assert eco.outputs[0].new_token_ids == [1, 2, 9]
    assert req.output_token_ids == [7, 1, 2, 9]
    # KV is valid for the prompt, 7, 1 and 2 (the positions verified); 9 is not computed.
    assert req.num_computed_tokens == 9 and req.num_tokens == 10
    stats = eco.scheduler_stats.spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1]
    # The next step schedules the one uncomputed token (no drafts came back).
    so = sched.schedule()
    assert so.num_scheduled_tokens == {req.request_id: 1} and not so.scheduled_spec_decode_tokens
    assert sched.update_from_output(so, output(so, {req.request_id: [4]})).scheduler_stats
    assert sched.make_stats().spec_decoding is None  # counts are per step, taken once


def test_all_accepted_gives_the_bonus_token() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    prefilled(sched, req)
    so = sched.schedule()
    sched.update_from_output(so, output(so, {req.request_id: [1, 2, 3, 4]}, {req.request_id: [5]}))
    assert req.output_token_ids == [7, 1, 2, 3, 4]
    assert req.num_computed_tokens == req.num_tokens - 1 == 10
    assert req.spec_token_ids == [5]


def test_a_stop_inside_the_accepted_run_trims_the_rest() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    prefilled(sched, req, drafts=(1, EOS, 3))
    so = sched.schedule()
    eco = sched.update_from_output(so, output(so, {req.request_id: [1, EOS, 3, 4]}))
    (out,) = eco.outputs
    assert out.new_token_ids == [1, EOS] and str(out.finish_reason) == "stop"
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert not sched.has_unfinished_requests()


def test_max_tokens_trims_the_run_and_caps_the_drafts() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=4)
    sched.add_request(req)
    so = sched.schedule()
    # After the first token, 3 more may come: at most 2 drafts (+1 verified token).
    sched.update_from_output(so, output(so, {req.request_id: [7]}, {req.request_id: [1, 2, 3]}))
    assert req.spec_token_ids == [1, 2]
    so = sched.schedule()
    eco = sched.update_from_output(so, output(so, {req.request_id: [1, 2, 8]}))
    assert req.output_token_ids == [7, 1, 2, 8] and str(eco.outputs[0].finish_reason) == "length"


def test_budget_and_max_model_len_truncate_drafts() -> None:
    sched = spec_scheduler(max_num_batched_tokens=3)
    (req,) = create_requests(1, num_tokens=2, max_tokens=50)
    prefilled(sched, req)
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {req.request_id: [1, 2]}  # 1 + 2 fit in 3

    sched = spec_scheduler(max_model_len=10)
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    prefilled(sched, req)  # 7 tokens known: positions 6..8 may still be computed
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {req.request_id: [1, 2]}
    eco = sched.update_from_output(so, output(so, {req.request_id: [1, 2, 5]}))
    assert req.num_tokens == 10 and str(eco.outputs[0].finish_reason) == "length"


def test_drafts_only_for_requests_past_their_prompt() -> None:
    sched = spec_scheduler(max_num_batched_tokens=4)
    (req,) = create_requests(1, num_tokens=10, max_tokens=50)
    sched.add_request(req)
    so = sched.schedule()  # a 4-token chunk of the prompt
    sched.update_from_output(so, output(so, {}, {req.request_id: [1, 2]}))
    assert req.spec_token_ids == []


def test_preemption_drops_drafts() -> None:
    # Two requests of 2 blocks each, room for 5: the second's drafts find no slots.
    sched = spec_scheduler(num_blocks=5)
    a, b = create_requests(2, num_tokens=8, max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(
        so, output(so, {a.request_id: [7], b.request_id: [7]}, {a.request_id: [1, 2, 3],
                                                                b.request_id: [1, 2, 3]})
    )  # fmt: skip
    so = sched.schedule()
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert b.request_id not in so.scheduled_spec_decode_tokens
    assert so.scheduled_spec_decode_tokens == {a.request_id: [1, 2, 3]}


def test_only_verified_tokens_are_prefix_cached() -> None:
    sched = spec_scheduler(block_size=4)
    hasher = make_hasher(block_size=4)
    (req,) = create_requests(1, num_tokens=5, max_tokens=50, block_hasher=hasher)
    cached = sched.kv_cache_manager.num_cached_block
    prefilled(sched, req)  # 6 tokens known, 5 computed: one full block cached
    assert cached[req.request_id] == 1
    so = sched.schedule()  # computes position 5 and drafts at 6..8
    assert cached[req.request_id] == 1  # 6 real tokens: block 2 is not full
    sched.update_from_output(so, output(so, {req.request_id: [9]}, {req.request_id: [4]}))
    assert req.num_computed_tokens == 6 and req.all_token_ids[-2:] == [7, 9]
    so = sched.schedule()  # position 6 (the 9) and a draft at 7: positions 0..7 computed
    assert so.scheduled_spec_decode_tokens == {req.request_id: [4]}
    assert cached[req.request_id] == 1  # but position 7 is a draft: block 2 is not cached
    sched.update_from_output(so, output(so, {req.request_id: [4, 3]}))  # accepted + bonus
    assert req.num_computed_tokens == 8 and len(req.block_hashes) == 2
    sched.schedule()
    assert cached[req.request_id] == 2  # now verified


def test_guided_drafts_are_cut_to_what_the_grammar_accepts() -> None:
    sched = spec_scheduler()
    (req,) = create_requests(1, num_tokens=6, max_tokens=50)
    grammar = ScriptedGrammar([7, 1, 2, 3, 4, 5, 6])
    add_guided_request(sched, req, grammar)
    so = sched.schedule()
    # After 7, the grammar allows 1 2 3 ...: of the draft [1, 2, 9, 3] only [1, 2] survive.
    sched.update_from_output(so, output(so, {req.request_id: [7]}, {req.request_id: [1, 2, 9, 3]}))
    assert grammar.pos == 1 and req.spec_token_ids == [1, 2]
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {req.request_id: [1, 2]}
