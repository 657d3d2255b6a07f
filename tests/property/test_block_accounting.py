"""Block accounting under any sequence of adds, steps and aborts (hypothesis state machine).

Invariants checked after every rule: the pool's integrity (free + referenced = total, ref
counts >= 0, hash map consistent), every block held by a request is referenced, the step's
token budget and max_num_seqs are never exceeded, and a request's prompt chunks add up to
its prompt. When everything has finished or been aborted, every block is free again.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedinfer.core.request import RequestStatus
from tests.unit.core.utils import create_requests, create_scheduler, make_hasher, make_output

NUM_BLOCKS = 24
BLOCK_SIZE = 4
BUDGET = 40
MAX_SEQS = 4


class SchedulerMachine(RuleBasedStateMachine):
    POLICY = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.sched = create_scheduler(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=MAX_SEQS,
            max_model_len=NUM_BLOCKS * BLOCK_SIZE,
            policy=self.POLICY,
        )
        self.next_id = 0
        self.prefilled: dict[str, int] = {}  # req id -> prompt tokens scheduled so far

    @rule(
        num_tokens=st.integers(1, 60),
        max_tokens=st.integers(1, 12),
        policy_priority=st.integers(0, 3),
    )
    def add(self, num_tokens: int, max_tokens: int, policy_priority: int) -> None:
        (req,) = create_requests(
            1, num_tokens=num_tokens, max_tokens=max_tokens, start=self.next_id
        )
        req.priority = policy_priority
        self.next_id += 1
        self.sched.add_request(req)

    @rule(token=st.sampled_from([0, 5, 9]))
    def step(self, token: int) -> None:
        so = self.sched.schedule()
        assert so.total_num_scheduled_tokens <= BUDGET
        assert len(self.sched.running) <= MAX_SEQS
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for req_id in so.preempted_req_ids:
            self.prefilled.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # A prefix-cache hit counts as prefilled: the chunks add up to the rest.
            if self.sched.requests[new.req_id].num_output_tokens == 0:
                self.prefilled[new.req_id] = new.num_computed_tokens
            if new.num_computed_tokens:
                event("a request started from a prefix-cache hit")
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            if req.num_output_tokens == 0:
                self.prefilled[req_id] = self.prefilled.get(req_id, 0) + n
                assert self.prefilled[req_id] <= req.num_prompt_tokens
        self.sched.update_from_output(so, make_output(so, self.sched, token=token))
        for req_id, req in list(self.sched.requests.items()):
            if req.num_output_tokens > 0 and req_id in self.prefilled:
                # Chunks of the prompt added up to exactly the prompt.
                assert self.prefilled.pop(req_id) == req.num_prompt_tokens

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.prefilled.pop(req_id, None)

    @invariant()
    def pool_is_consistent(self) -> None:
        kv = self.sched.kv_cache_manager
        kv.block_pool.check_integrity()
        held = [b for blocks in kv.req_to_blocks.values() for b in blocks]
        assert all(b.ref_cnt > 0 for b in held)
        assert len({id(b) for b in held}) + kv.get_num_free_blocks() == NUM_BLOCKS
        for req_id in kv.req_to_blocks:
            assert req_id in self.sched.requests
        # Each block's ref count is the number of requests holding it.
        holders: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in kv.block_pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), b

    def teardown(self) -> None:
        # Run everything to completion (bounded): all blocks must come back.
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            so = self.sched.schedule()
            self.sched.update_from_output(so, make_output(so, self.sched, token=5))
        assert not self.sched.has_unfinished_requests()
        assert self.sched.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS
        self.sched.kv_cache_manager.block_pool.check_integrity()


class PrioritySchedulerMachine(SchedulerMachine):
    POLICY = "priority"


class PrefixCachingMachine(SchedulerMachine):
    """Requests built from a few shared prefixes, so hits, shared blocks, lazy eviction
    and preemption of requests holding shared blocks all happen."""

    BASES = [[k * 1000 + j for j in range(64)] for k in range(3)]

    def __init__(self) -> None:
        super().__init__()
        self.hasher = make_hasher(BLOCK_SIZE)

    @rule(
        base=st.integers(0, 2),
        shared=st.integers(8, 48),
        suffix=st.integers(0, 12),
        max_tokens=st.integers(1, 10),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add_shared(
        self, base: int, shared: int, suffix: int, max_tokens: int, salt: str | None
    ) -> None:
        prompt = self.BASES[base][:shared] + [5000 + self.next_id] * suffix
        if not prompt:
            prompt = [1]
        (req,) = create_requests(
            1,
            start=self.next_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            block_hasher=self.hasher,
            cache_salt=salt,
        )
        self.next_id += 1
        self.sched.add_request(req)

    @rule()
    def reset_prefix_cache(self) -> None:
        kv = self.sched.kv_cache_manager
        in_use = kv.get_num_free_blocks() < NUM_BLOCKS
        assert self.sched.reset_prefix_cache() is not in_use
        if not in_use:
            assert kv.block_pool.cached_block_hash_to_block == {}

    @invariant()
    def cached_blocks_hold_their_hash(self) -> None:
        kv = self.sched.kv_cache_manager
        for req_id, blocks in kv.req_to_blocks.items():
            hashes = self.sched.requests[req_id].block_hashes
            for i, b in enumerate(blocks[: kv.num_cached_block.get(req_id, 0)]):
                assert b.block_hash == hashes[i], (req_id, i)

    def teardown(self) -> None:
        super().teardown()
        assert self.sched.reset_prefix_cache()
        assert self.sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
SchedulerMachine.TestCase.settings = _SETTINGS
PrioritySchedulerMachine.TestCase.settings = _SETTINGS
PrefixCachingMachine.TestCase.settings = _SETTINGS
TestSchedulerBlockAccountingFCFS = SchedulerMachine.TestCase
TestSchedulerBlockAccountingPriority = PrioritySchedulerMachine.TestCase
TestSchedulerBlockAccountingPrefixCaching = PrefixCachingMachine.TestCase
