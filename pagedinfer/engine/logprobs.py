"""Turn the engine core's `LogprobsLists` into user-facing per-token `Logprob` dicts.

Role: the sampler returns, per token position, a row whose column 0 is the sampled token (or,
for prompts, the actual next prompt token) with its rank in the full distribution, and columns
1..k the top-k tokens. `LogprobsProcessor` (one per request) converts each row into
`{token_id: Logprob(logprob, rank, decoded_token)}`, accumulates them, and keeps the running
`cumulative_logprob` of the sampled tokens.

Invariants:
- Each dict lists the sampled token first, with its true rank; the top-k follow with ranks
  1..k. If the sampled token is also in the top-k it appears once, with the sampled rank.
- Extra columns beyond the request's own `logprobs` / `prompt_logprobs` count are dropped (the
  sampler may compute the batch-wide maximum); -1 means "keep all columns".
- Prompt logprobs start with None: nothing predicts the first prompt token.
- `logprobs`, `prompt_logprobs` and `cumulative_logprob` are None when not requested.

Callers: `engine.output_processor.RequestState`.
"""

from __future__ import annotations

from tokenizers.decoders import Decoder

from pagedinfer.core.messages import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from pagedinfer.engine.detokenizer import TokenizerLike
from pagedinfer.outputs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["LogprobsProcessor", "TokenTextCache"]


class TokenTextCache:
    """Text of single token ids, memoized (shared by all requests of one OutputProcessor).

    The text is the token string from `convert_ids_to_tokens` run through the tokenizer's own
    decoder (so byte-level "ĠHello" reads " Hello"); a token that is only part of a UTF-8
    character reads U+FFFD. Falls back to `decode([id])`.
    """

    def __init__(self, tokenizer: TokenizerLike | None) -> None:
        self._tokenizer = tokenizer
        self._decoder: Decoder | None = None if tokenizer is None else tokenizer.backend.decoder
        self._cache: dict[int, str | None] = {}

    def __call__(self, token_ids: list[int]) -> list[str | None]:
        if self._tokenizer is None:
            return [None] * len(token_ids)
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._cache]
        if missing:
            tokens = self._tokenizer.convert_ids_to_tokens(missing)
            for token_id, token in zip(missing, tokens, strict=True):
                self._cache[token_id] = self._token_text(token_id, token)
        return [self._cache[t] for t in token_ids]

    def _token_text(self, token_id: int, token: str | None) -> str | None:
        assert self._tokenizer is not None
        if token is not None and self._decoder is None:
            return token
        if token is not None and self._decoder is not None:
            try:
                text: str = self._decoder.decode([token])
                return text
            # Decoders raise bare Exceptions; a lone token one rejects still has decode() below.
            except Exception:  # noqa: BLE001
                token = None
        try:
            return self._tokenizer.decode([token_id], skip_special_tokens=False)
        # An id the tokenizer cannot decode gets no text rather than failing the request.
        except Exception:  # noqa: BLE001
            return None


class LogprobsProcessor:
    """Accumulates sample and prompt logprobs of one request."""

    def __init__(
        self,
        token_text: TokenTextCache,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self._token_text = token_text
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = None if num_prompt_logprobs is None else []
        self._prompt_logprobs_popped = False

    @classmethod
    def from_request(
        cls, token_text: TokenTextCache, request: EngineCoreRequest
    ) -> LogprobsProcessor:
        params = request.sampling_params
        return cls(token_text, params.logprobs, params.prompt_logprobs)

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and self.logprobs is not None:
            self._update_sample_logprobs(output.new_logprobs)
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._update_prompt_logprobs(output.new_prompt_logprobs)

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """Prompt logprobs not yet handed out (DELTA mode reports them once), else None."""
        if not self.prompt_logprobs or self._prompt_logprobs_popped:
            return None
        self._prompt_logprobs_popped = True
        return self.prompt_logprobs

    def _update_sample_logprobs(self, lists: LogprobsLists) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for ids, lps, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
        ):
            self.cumulative_logprob += lps[0]
            self.logprobs.append(self._make_dict(ids, lps, rank, self.num_logprobs))

    def _update_prompt_logprobs(self, lists: LogprobsLists) -> None:
        assert self.prompt_logprobs is not None
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        for ids, lps, rank in zip(
            lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks, strict=True
        ):
            self.prompt_logprobs.append(self._make_dict(ids, lps, rank, self.num_prompt_logprobs))

    def _make_dict(
        self, ids: list[int], lps: list[float], sampled_rank: int, num: int | None
    ) -> dict[int, Logprob]:
        if num is not None and num >= 0:
            ids, lps = ids[: num + 1], lps[: num + 1]
        texts = self._token_text(ids)
        row = {ids[0]: Logprob(lps[0], sampled_rank, texts[0])}
        for rank, (token_id, logprob, text) in enumerate(
            zip(ids[1:], lps[1:], texts[1:], strict=True), 1
        ):
            # setdefault: a sampled token that is also in the top-k keeps its (equal) true rank
            # and its first position.
            row.setdefault(token_id, Logprob(logprob, rank, text))
        return row
