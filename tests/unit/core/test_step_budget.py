"""The prompt-token budget of steps with decodes (`core/step_budget.py`): sized from the
measured step times, applied by the scheduler only while requests decode."""

from __future__ import annotations

from pagedinfer.core.step_budget import PrefillBudget

from .utils import create_requests, create_scheduler, make_output


def _settle(budget: PrefillBudget, decode_s: float, per_token_s: float, steps: int = 30) -> None:
    """Steps of `decode_s` of decodes plus `per_token_s` per prompt token, full budgets,
    with a decode-only step between them."""
    for _ in range(steps):
        budget.observe(decode_s, 0, had_decodes=True)
        n = budget.tokens
        budget.observe(decode_s + per_token_s * n, n, had_decodes=True)


def test_budget_settles_where_steps_meet_the_target() -> None:
    """Decodes 50 ms, 1 ms per prompt token, target 250 ms: ~(250 - 50) / 1 = 200 tokens
    (a little under: the margin), and such steps stay within the target."""
    budget = PrefillBudget(0.25, max_tokens=2048, min_tokens=16, initial=2048)
    _settle(budget, 0.05, 0.001)
    assert 170 <= budget.tokens <= 200
    assert 0.05 + 0.001 * budget.tokens <= 0.25


def test_a_small_prompt_step_does_not_collapse_a_settled_budget() -> None:
    budget = PrefillBudget(0.25, max_tokens=2048, min_tokens=32, initial=256)
    _settle(budget, 0.1, 0.0001)  # cheap tokens: ~1,350
    settled = budget.tokens
    assert settled > 1000
    budget.observe(0.1 + 0.0001 * 5, 5, had_decodes=True)  # a mostly cached chat turn
    assert budget.tokens == settled


def test_heavy_decodes_keep_a_quarter_of_the_target_for_prompts() -> None:
    """Decodes alone take 240 ms of a 250 ms target: prompts still get ~a quarter of the
    target's worth of tokens (62 ms at 1 ms per token), not the floor."""
    budget = PrefillBudget(0.25, max_tokens=2048, min_tokens=32, initial=256)
    _settle(budget, 0.24, 0.001)
    assert 50 <= budget.tokens <= 62


def test_budget_grows_at_most_twice_per_step_and_keeps_its_bounds() -> None:
    budget = PrefillBudget(0.25, max_tokens=1000, min_tokens=32, initial=100)
    budget.observe(0.001, 100, had_decodes=False)  # a very cheap step
    assert budget.tokens == 200
    for _ in range(10):
        budget.observe(0.001, budget.tokens, had_decodes=False)
    assert budget.tokens == 1000
    budget.observe(100.0, 1000, had_decodes=False)  # a very slow one
    assert budget.tokens == 32


def test_scheduler_caps_prompt_tokens_only_while_requests_decode() -> None:
    sched = create_scheduler(max_num_batched_tokens=2048, step_latency_target_ms=250)
    (long,) = create_requests(1, num_tokens=3000)
    sched.add_request(long)
    so = sched.schedule()  # nobody decodes: the whole budget
    assert so.num_scheduled_tokens == {"0": 2048}

    sched = create_scheduler(max_num_batched_tokens=2048, step_latency_target_ms=250)
    (stream,) = create_requests(1, num_tokens=10, max_tokens=100)
    sched.add_request(stream)
    so = sched.schedule()
    sched.update_from_output(so, make_output(so, sched))  # "0" decodes from now on
    (long,) = create_requests(1, num_tokens=3000, start=1)
    sched.add_request(long)
    chunks = []
    for _ in range(6):
        so = sched.schedule()
        assert so.num_scheduled_tokens["0"] == 1  # the stream's token, every step
        chunks.append(so.num_scheduled_tokens["1"])
        sched.observe_step_time(0.01 + 0.001 * chunks[-1])  # 10 ms + 1 ms per prompt token
        sched.update_from_output(so, make_output(so, sched))
    assert chunks[0] == 64  # before any measurement: the initial budget
    assert all(0.01 + 0.001 * c <= 0.25 for c in chunks[1:]), chunks  # then within target
    assert chunks[-1] >= 190, chunks


def test_no_target_keeps_the_fixed_budget() -> None:
    sched = create_scheduler(max_num_batched_tokens=2048)
    a, b = create_requests(2, num_tokens=3000)
    sched.add_request(a)
    so = sched.schedule()
    sched.add_request(b)
    sched.update_from_output(so, make_output(so, sched))
    so = sched.schedule()
    assert sum(so.num_scheduled_tokens.values()) == 2048
