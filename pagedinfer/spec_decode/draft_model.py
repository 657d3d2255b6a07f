"""The "draft_model" proposer: a smaller model drafts k tokens by greedy decoding.

Two forms (`SpeculativeConfig`):
- `draft_layers=N`, self-speculative: the target's first N decoder layers, its final norm
  and its LM head. It needs no KV cache of its own: for real tokens, layers 0..N-1 of the
  target already hold exactly the keys and values the draft would compute, and the slots
  the draft writes for its own guesses (positions past the last real token) are written
  again by the target when it verifies them, before anything reads them.
- `model=PATH`: a separate model with the same tokenizer and its own paged KV cache, laid
  out like the target's (same block ids and slots, so the scheduler's block tables serve
  both). Each step it runs over the same tokens as the target (`observe_forward`), which
  keeps its cache in step for every real token, prefix-cache hits included.

`propose` then decodes k tokens for every request in one batch per position: the first
input is the token sampled this step (its position is the request's last), each next input
the previous draft. The drafts are argmax choices and carry no probabilities (as in vLLM's
runner): the rejection sampler treats them as point masses, which keeps sampling exact.
The scheduler reserves `num_speculative_tokens` lookahead slots per request for the
positions the draft writes; drafts are cut so that no position runs past the request's
block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedinfer.attention.backend import AttentionBackend, ForwardContext, set_forward_context
from pagedinfer.attention.metadata import make_attention_metadata, padded_block_table
from pagedinfer.config import SpeculativeConfig
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.spec_decode.proposer import DraftBatch, Proposer

if TYPE_CHECKING:
    from pagedinfer.attention.backend import CommonAttentionMetadata

__all__ = ["DraftModel", "DraftModelProposer"]


@dataclass
class DraftModel:
    """A model that drafts: its weights, attention backend and KV caches (one per layer)."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    num_layers: int | None = None
    """Run only the first N layers (self-speculative); None: all of them."""
    shares_target_kv: bool = False


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, draft: DraftModel, block_size: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.draft = draft
        self.block_size = block_size

    @torch.inference_mode()
    def observe_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> None:
        """The target just ran `input_ids` at `positions`: a separate draft model runs the
        same tokens into its own cache (its output is not needed)."""
        if self.draft.shares_target_kv:
            return
        ctx = ForwardContext(
            attn_metadata=self.draft.backend.build(common), kv_caches=self.draft.kv_caches
        )
        with set_forward_context(ctx):
            self.draft.model(input_ids, positions, self.draft.num_layers)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[list[int]]:
        states = batch.states
        bs = self.block_size
        # The draft for a request writes positions last .. last + n - 1; keep them inside
        # its blocks (the scheduler reserved k lookahead slots; near max_model_len fewer).
        last = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)  # [num_reqs]
        room = np.array([len(s.block_ids) * bs for s in states], dtype=np.int64) - last
        num_drafts = np.minimum(self.num_speculative_tokens, np.maximum(room, 0))
        drafts: list[list[int]] = [[] for _ in states]
        tokens = [s.all_token_ids[-1] for s in states]
        block_table_all = padded_block_table([s.block_ids for s in states])
        model = self.draft.model
        for step in range(int(num_drafts.max(initial=0))):
            active = np.nonzero(num_drafts > step)[0]  # requests still drafting
            common, positions = make_attention_metadata(
                np.ones(len(active), dtype=np.int64),
                last[active] + step,
                np.ascontiguousarray(block_table_all[active]),
                bs,
            )
            input_ids = torch.tensor([tokens[i] for i in active], dtype=torch.int64)
            ctx = ForwardContext(
                attn_metadata=self.draft.backend.build(common), kv_caches=self.draft.kv_caches
            )
            with set_forward_context(ctx):
                hidden = model(input_ids, torch.from_numpy(positions), self.draft.num_layers)
            next_ids = model.compute_logits(hidden).argmax(dim=-1).tolist()  # [num_active]
            for i, token in zip(active.tolist(), next_ids):
                drafts[i].append(token)
                tokens[i] = token
        return drafts
