"""The admission order of waiting requests (`Scheduler._schedule_waiting`): what stops the
pass, what is skipped and keeps its place, and the order preempted requests come back in.

The case of a head that cannot allocate while waiting requests hold loaded KV is in
test_scheduler_kv_connector.py."""

from __future__ import annotations

import pytest

from pagedinfer.core.request import RequestStatus
from pagedinfer.core.scheduler import Scheduler

from .utils import create_requests, create_scheduler, make_output


def _waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_head_that_cannot_allocate_stops_the_pass(policy: str) -> None:
    """A request behind the head that would fit is not admitted ahead of it, and nothing
    running is preempted for a waiting request."""
    sched = create_scheduler(num_blocks=6, block_size=4, policy=policy)
    (running,) = create_requests(1, num_tokens=15)
    sched.add_request(running)
    so = sched.schedule()  # 4 blocks; 2 left
    sched.update_from_output(so, make_output(so, sched))
    (head,) = create_requests(1, num_tokens=12, start=1)  # needs 3 blocks
    (small,) = create_requests(1, num_tokens=3, start=2)  # needs 1
    head.priority, small.priority = 0, 1
    sched.add_request(head)
    sched.add_request(small)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 1}  # the decode needs no new block
    assert not so.preempted_req_ids
    assert _waiting_ids(sched) == ["1", "2"]
    assert head.status == small.status == RequestStatus.WAITING


def test_without_chunked_prefill_a_head_that_does_not_fit_stops_the_pass() -> None:
    sched = create_scheduler(max_num_batched_tokens=30, enable_chunked_prefill=False)
    for r in create_requests(2, num_tokens=20) + create_requests(1, num_tokens=5, start=2):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 20}  # "2" would fit the 10 left, behind "1"
    assert _waiting_ids(sched) == ["1", "2"]


class _CompilingGrammar:
    error: str | None = None

    def is_ready(self) -> bool:
        return False


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_skipped_requests_keep_their_order_at_the_front(policy: str) -> None:
    """Requests that cannot start yet (grammar compiling, previous batch still in the
    pipeline) let later ones run and stay ahead of them, in their own order."""
    sched = create_scheduler(policy=policy)
    compiling, in_pipeline, plain, also_compiling = create_requests(4)
    for r in (compiling, also_compiling):
        r.status = RequestStatus.WAITING_FOR_FSM
        r.structured_output_request = _CompilingGrammar()  # type: ignore[assignment]
    for r in (compiling, in_pipeline, plain, also_compiling):
        sched.add_request(r)
    sched.in_flight = {in_pipeline.request_id}
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [plain.request_id]
    assert _waiting_ids(sched) == ["0", "1", "3"]
    sched.update_from_output(so, make_output(so, sched))
    (late,) = create_requests(1, start=4)
    sched.add_request(late)
    sched.in_flight = set()
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["2", "1", "4"]  # running first, then in order
    assert _waiting_ids(sched) == ["0", "3"]


def test_preempted_requests_resume_in_their_original_order_ahead_of_new_ones() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4)
    a, b, c = create_requests(1, num_tokens=8) + create_requests(2, num_tokens=4, start=1)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()  # a: 2 blocks, b and c: 1 each; the pool is full
    sched.update_from_output(so, make_output(so, sched))
    (new,) = create_requests(1, num_tokens=4, start=3)
    sched.add_request(new)
    so = sched.schedule()
    # a's next token needs a block: c (newest) goes; b then needs one and is the victim.
    assert so.preempted_req_ids == {"1", "2"}
    assert list(so.num_scheduled_tokens) == ["0"]
    assert _waiting_ids(sched) == ["1", "2", "3"]
