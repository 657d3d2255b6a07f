"""`PrefillBudget`: how many prompt tokens a step may compute while requests are decoding,
so that the step (and with it the gap between those requests' tokens) stays near a latency
target (`SchedulerConfig.step_latency_target_ms`).

Chunked prefill bounds a step by tokens, but what a token costs depends on the machine,
the model and the context the chunk attends to: on a 2-core CPU a 2,048-token chunk of an
8,000-token prompt took ~10 s, and every stream waited for each chunk (issue 24). The budget
is sized from the engine's own measured step times instead. A step with decodes costs `d`
(their part, learned from steps that compute no prompt token) plus `c` per prompt token
(`(t - d) / n` from a step that computed `n` in `t`); the budget is `0.9 x room / c`, the
room being `target - d`, and at least a quarter of the target when decodes alone take
longer (prompts keep progressing on a loaded server: its gaps then grow by at most a
quarter of the target). It follows `c` as it grows with the context. A step with few prompt
tokens says little about a full one: it updates the budget only if it ran over the target.
Growth is at most 2x per step, and a step never gets fewer than `min_tokens`. Steps without
decoding requests are not capped (nobody waits on them); vLLM has no such feedback (its
budget is `max_num_batched_tokens` and `long_prefill_token_threshold`, fixed).
"""

from __future__ import annotations

__all__ = ["PrefillBudget"]

_MARGIN = 0.9  # aim a little under the target: the next chunk attends to more context
_MAX_GROWTH = 2.0
_DECODE_EMA = 0.3  # weight of the newest decode-only step in the decode cost
_MIN_ROOM = 0.25  # of the target: prompt work a step gets however long its decodes take


class PrefillBudget:
    """Prompt tokens per step while decodes run, sized from measured step times."""

    def __init__(self, target_s: float, max_tokens: int, min_tokens: int, initial: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.tokens = max(self.min_tokens, min(initial, max_tokens))
        self.decode_s = 0.0
        """The decodes' share of a step (moving average of decode-only steps)."""

    def observe(self, seconds: float, num_prompt_tokens: int, had_decodes: bool) -> None:
        """A step that computed `num_prompt_tokens` prompt tokens (and decodes, if
        `had_decodes`) took `seconds`."""
        if seconds <= 0:
            return
        if num_prompt_tokens <= 0:
            if had_decodes:
                self.decode_s += _DECODE_EMA * (seconds - self.decode_s)
            return
        if num_prompt_tokens < self.tokens // 2 and seconds <= self.target_s:
            return  # a small chunk within the target: no news about a full one
        decode_s = min(self.decode_s, 0.9 * seconds) if had_decodes else 0.0
        per_token = (seconds - decode_s) / num_prompt_tokens
        room = max(self.target_s - self.decode_s, _MIN_ROOM * self.target_s)
        fits = _MARGIN * room / per_token
        limit = _MAX_GROWTH * self.tokens
        self.tokens = int(max(self.min_tokens, min(fits, limit, self.max_tokens)))
