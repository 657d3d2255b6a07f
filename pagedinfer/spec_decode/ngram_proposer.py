"""Prompt-lookup (n-gram) draft proposer: guesses the next tokens by copying from the context.

Role: the model runner calls `NgramProposer.propose(contexts)` once per decode step with, for
every request that speculates, its whole known sequence (prompt + output so far, the token
sampled this step included). It gets back one list of draft token ids per request, possibly
empty, which the rejection sampler verifies on the next step. Pure CPU, numpy only.

Rule (vLLM's prompt-lookup semantics), for a sequence `t` of length `L`:
  - take the LONGEST `n` in `[prompt_lookup_min, prompt_lookup_max]` such that the suffix
    `t[L-n:]` also occurs at some start `i` with `i + n <= L - 1` (so not the suffix itself,
    and followed by at least one token); among occurrences of that `n` keep the EARLIEST `i`;
  - propose `t[i+n : i+n+k]` with `k = min(num_speculative_tokens, max_model_len - L)`; the
    slice may be shorter when the sequence ends first, and it may run into the suffix.
  - `k <= 0`, `L < prompt_lookup_min` or no occurrence -> `[]`.

Speed: this runs every step for every request, so the search is vectorised. One numpy
comparison over the whole sequence finds every earlier position holding the last token; these
are candidate END positions of an occurrence. Each further step compares the candidates one
token further back and drops those that mismatch, so the candidate set shrinks geometrically
and the work is O(L + prompt_lookup_max * num_candidates). Passing an int32/int64 ndarray (a
buffer the caller keeps per request) avoids converting a long Python list on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NgramProposer"]


class NgramProposer:
    """Stateless prompt-lookup proposer; see the module docstring for the matching rule."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int,
    ) -> None:
        for name, value in (
            ("num_speculative_tokens", num_speculative_tokens),
            ("prompt_lookup_min", prompt_lookup_min),
            ("prompt_lookup_max", prompt_lookup_max),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, contexts: list[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """Draft token ids for each context, in order (an empty list where nothing matches)."""
        return [self.propose_one(token_ids) for token_ids in contexts]

    def propose_one(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Draft token ids for one request's whole known sequence `token_ids`."""
        num_tokens = len(token_ids)
        num_draft_tokens = min(self.num_speculative_tokens, self.max_model_len - num_tokens)
        # An occurrence of length n needs n + 1 tokens before the suffix ends, so n <= L - 1.
        max_n = min(self.prompt_lookup_max, num_tokens - 1)
        if num_draft_tokens <= 0 or max_n < self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids)  # [num_tokens]
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")

        # Candidate end positions j <= L - 2 of an occurrence: t[j] == t[L-1]. Ascending.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [num_candidates]
        if ends.size == 0:
            return []
        # Invariant at the top of each pass: every position in `ends` matches the last
        # `matched` tokens of the suffix. Extend one token further back per pass.
        matched = 1
        while matched < max_n:
            # Only a candidate with a token at j - matched can extend (its start would be
            # >= 0); `ends` is ascending, so those are a tail of it. The others stay valid
            # matches of the current length, so `ends` itself is kept until something extends.
            extendable = ends[np.searchsorted(ends, matched) :]
            longer = extendable[tokens[extendable - matched] == tokens[num_tokens - 1 - matched]]
            if longer.size == 0:
                break
            ends = longer
            matched += 1
        if matched < self.prompt_lookup_min:
            return []
        # All survivors share the same match length, so the smallest end is the earliest start.
        start = int(ends[0]) + 1  # i + n
        return tokens[start : start + num_draft_tokens].tolist()
