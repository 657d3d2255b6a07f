"""The proposer seam: what the model runner asks of a draft method after each step.

After sampling, the runner hands the proposer the requests that just produced a token (their
prompt is done) and gets back up to k draft tokens per request. The drafts travel to the
scheduler in `ModelRunnerOutput.draft_token_ids`, come back in the next step's
`SchedulerOutput.scheduled_spec_decode_tokens` and are verified there by the target model and
the rejection sampler (`spec_decode/rejection_sampler.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedinfer.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from pagedinfer.attention.backend import AttentionBackend, CommonAttentionMetadata
    from pagedinfer.model.llama import LlamaForCausalLM
    from pagedinfer.spec_decode.draft_model import DraftModel
    from pagedinfer.worker.request_state import CachedRequestState

__all__ = ["DraftBatch", "Proposer", "StepRun", "create_proposer"]


@dataclass
class StepRun:
    """One request's part of the step just run: rows `first_row ..` of `DraftBatch.hidden`
    hold the target's features at positions `start ..`; the first `num_real` of them are
    real tokens whose next token is known now (a verified run's rejected drafts are not)."""

    state: CachedRequestState
    first_row: int
    start: int
    num_real: int


@dataclass
class DraftBatch:
    """The requests to draft for (those that sampled this step, in sampling order), and
    what the step computed for every request it ran (for drafters that read features)."""

    req_ids: list[str]
    states: list[CachedRequestState]
    """Each request's known tokens (`token_array()`, the token sampled this step included)."""
    hidden: torch.Tensor | None = None
    """[num_tokens, hidden_size]: the target's final hidden states for every token the step
    ran (the LM head's input)."""
    runs: list[StepRun] = field(default_factory=list)
    """Every request the step ran, in batch order."""
    want_drafts: bool = True
    """False when speculation is off for this step (batch too large): drafters with state
    of their own still update it, nobody drafts."""

    @property
    def last_real_rows(self) -> list[int]:
        """Per request of `states`: the row of the feature that produced its new token."""
        run_of = {id(run.state): run for run in self.runs}
        rows = []
        for state in self.states:
            run = run_of[id(state)]
            rows.append(run.first_row + run.num_real - 1)
        return rows


class Proposer(ABC):
    num_speculative_tokens: int
    needs_every_step = False
    """True for drafters whose own state (a KV cache) must see every step, even one that
    samples nothing or does not speculate."""
    needs_hidden = False
    """True for drafters that read the target's features (`DraftBatch.hidden`)."""
    aux_layers: tuple[int, ...] = ()
    """Target layers whose residual streams join the features, before h_t (EAGLE with
    fused features): `DraftBatch.hidden` is then [num_tokens, (len + 1) * hidden_size]."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> list[list[int]]:
        """Per request of `batch`: 0..k draft tokens to verify next step."""

    def observe_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> None:
        """Called after every target forward pass with its inputs (a drafter with a KV
        cache of its own keeps it in step here); nothing by default."""


class NgramDrafter(Proposer):
    """Prompt lookup in the request's own tokens (`NgramProposer`); no model, no KV."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from pagedinfer.spec_decode.ngram_proposer import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        # The scheduler drops drafts that would run past max_model_len; none is known here.
        self.ngram = NgramProposer(
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            max_model_len=np.iinfo(np.int32).max,
        )

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        return self.ngram.propose([s.token_array() for s in batch.states])


def create_proposer(
    config: SpeculativeConfig,
    draft: DraftModel | None = None,
    block_size: int = 16,
    target: LlamaForCausalLM | None = None,
    backend: AttentionBackend | None = None,
    head_kv_cache: torch.Tensor | None = None,
) -> Proposer:
    """The proposer for `config.method`: draft_model needs `draft` (the model that drafts,
    built by the worker); eagle and medusa the `target` model, and eagle the attention
    `backend` and its head's one-layer KV cache."""
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "draft_model":
        from pagedinfer.spec_decode.draft_model import DraftModelProposer

        assert draft is not None, "draft_model needs the draft model"
        return DraftModelProposer(config, draft, block_size)
    from pagedinfer.spec_decode.head_proposers import EagleProposer, MedusaProposer

    assert target is not None and config.model is not None
    if config.method == "medusa":
        return MedusaProposer(config, target, config.model)
    assert backend is not None and head_kv_cache is not None
    return EagleProposer(config, target, config.model, backend, head_kv_cache, block_size)
