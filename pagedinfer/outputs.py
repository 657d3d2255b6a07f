"""User-facing results of `LLM.generate` / `LLM.chat` (vLLM-compatible shapes).

Built by `engine.output_processor.OutputProcessor` from the engine core's token-level
`EngineCoreOutput`s; nothing in here touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PromptLogprobs",
    "RequestOutput",
    "SampleLogprobs",
]


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, its rank in the distribution (1 = most likely) and its
    decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One output sequence of a request (a request has `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence, or None (EOS or length)."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything the engine has produced for one request so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens not computed here: prefix-cache hits, plus KV loaded by a connector."""
    num_external_cached_tokens: int = 0
    """Of those, prompt tokens whose KV a KV connector loaded (disaggregated prefill)."""
    kv_transfer_params: dict[str, Any] | None = None
    """Set on the finished output by a KV connector: what a decode instance needs to fetch
    this prompt's KV (pass it as the decode request's `kv_transfer_params`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Timings: arrival_time, first_token_time, finished_time (monotonic seconds)."""
    pooled: list[float] | None = None
    """A finished pooling request's vector (its `outputs` hold no tokens)."""

    def add(self, later: RequestOutput) -> None:
        """Merge a later DELTA output of the same request into this one (used when the
        consumer of a stream falls behind): text, token ids and logprobs are appended per
        completion index; finish state, metrics and cache figures are the later ones."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.num_external_cached_tokens = max(
            self.num_external_cached_tokens, later.num_external_cached_tokens
        )
        if later.kv_transfer_params is not None:
            self.kv_transfer_params = later.kv_transfer_params
        self.metrics.update(later.metrics)


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    """The pooled hidden state (unit length when normalized)."""


@dataclass
class EmbeddingRequestOutput:
    """The result of one `LLM.embed` prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        assert output.pooled is not None, "not a finished pooling request"
        return cls(output.request_id, EmbeddingOutput(output.pooled), output.prompt_token_ids)
