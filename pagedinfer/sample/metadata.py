"""Per-step sampling inputs and outputs: the contract between the model runner and `Sampler`.

The model runner builds one `SamplingMetadata` per step from its persistent batch; row i of
every tensor belongs to the i-th request that gets logits this step (scheduler order). Fields
that no request in the batch uses are `None` (or flagged by `no_penalties`/`all_greedy`), so
the common case (all greedy, no penalties) costs one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingMetadata", "LogprobsTensors", "SamplerOutput"]


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None
    """[num_reqs] float32; None when all_greedy. Greedy rows hold 0 (or any value) and are
    decided by argmax."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[num_reqs] float32; None when no request uses top-p (all 1.0)."""
    top_k: torch.Tensor | None
    """[num_reqs] int64; None when no request uses top-k. 0 in a row means disabled."""
    min_p: torch.Tensor | None
    """[num_reqs] float32; None when no request uses min-p."""
    generators: dict[int, torch.Generator]
    """Row index -> the request's own generator (seeded requests only)."""
    max_num_logprobs: int | None
    """Largest `logprobs` in the batch (None: nobody wants logprobs; -1 was resolved to the
    vocab size by the runner)."""

    no_penalties: bool
    prompt_token_ids: torch.Tensor | None
    """[num_reqs, max_prompt_len] int64 padded with vocab_size; only set when some request
    uses repetition_penalty."""
    output_token_ids: list[list[int]]
    """Generated token ids so far, per row (read by penalties and min_tokens)."""
    frequency_penalties: torch.Tensor | None
    """[num_reqs] float32."""
    presence_penalties: torch.Tensor | None
    """[num_reqs] float32."""
    repetition_penalties: torch.Tensor | None
    """[num_reqs] float32."""

    logit_bias: list[dict[int, float] | None] = field(default_factory=list)
    """Per row: token id -> additive bias, or None."""
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    """Row -> (min_tokens, stop token ids to mask while len(output) < min_tokens)."""
    allowed_token_ids_mask: torch.Tensor | None = None
    """[num_reqs, vocab_size] bool; True marks tokens that are NOT allowed."""
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)
    """Row -> banned token sequences (`SamplingParams.bad_words_token_ids`)."""


@dataclass
class LogprobsTensors:
    """Top-k logprobs of a batch, sampled token first: column 0 is the sampled (or prompt)
    token, columns 1..k are the top-k tokens in descending order."""

    logprob_token_ids: torch.Tensor
    """[num_rows, k + 1] int64"""
    logprobs: torch.Tensor
    """[num_rows, k + 1] float32"""
    selected_token_ranks: torch.Tensor
    """[num_rows] int64: rank of the sampled token in the full distribution (1 = top)."""

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[num_reqs] int64"""
    logprobs_tensors: LogprobsTensors | None
    """Logprobs of the raw model distribution (before penalties, bias and temperature, as vLLM's
    default `raw_logprobs` mode), or None."""
