"""`PrefillBudget`: how many prompt tokens a step may compute while requests are decoding,
so that the step (and with it the gap between those requests' tokens) stays near a latency
target (`SchedulerConfig.step_latency_target_ms`).

Chunked prefill bounds a step by tokens, but what a token costs depends on the machine,
the model and the context the chunk attends to: on a 2-core CPU a 2,048-token chunk of an
8,000-token prompt took ~10 s, and every stream waited for each chunk (issue 24). The budget
is sized from the engine's own measured step times instead, by feedback: after a step that
computed `n` prompt tokens in `t` seconds, the next may compute `0.9 * n * target / t`
(at most twice the last budget, at least `min_tokens`). A step's time is its decodes' cost
`d` plus `c` per prompt token, so the budget settles at `(target - d) / c`: the most
prompt work that keeps such steps within the target. It follows the cost per token as
it grows with the context. Steps without decoding requests are not capped (nobody waits
on them); vLLM has no such feedback (its budget is `max_num_batched_tokens` and
`long_prefill_token_threshold`, fixed).
"""

from __future__ import annotations

__all__ = ["PrefillBudget"]

_MARGIN = 0.9  # aim a little under the target: the next chunk attends to more context
_MAX_GROWTH = 2.0


class PrefillBudget:
    """Prompt tokens per step while decodes run, sized from measured step times."""

    def __init__(self, target_s: float, max_tokens: int, min_tokens: int, initial: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.tokens = max(self.min_tokens, min(initial, max_tokens))

    def observe(self, seconds: float, num_prompt_tokens: int) -> None:
        """A step that computed `num_prompt_tokens` prompt tokens took `seconds`."""
        if num_prompt_tokens <= 0 or seconds <= 0:
            return  # a decode-only step says nothing about the cost of prompt tokens
        fits = _MARGIN * num_prompt_tokens * self.target_s / seconds
        limit = _MAX_GROWTH * self.tokens
        self.tokens = int(max(self.min_tokens, min(fits, limit, self.max_tokens)))
