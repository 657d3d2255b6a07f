"""How a pooling (embedding) request turns its prompt's hidden states into one vector.

A pooling request runs its prompt through the model like any prefill (chunked, batched with
generation requests) and finishes when the prefill does, with no token sampled: the engine
pools the final hidden states (after the model's last norm, what transformers returns as
`hidden_states[-1]`) over the prompt's positions. vLLM's `PoolingParams`; vLLM fixes the
pooling type per model (`--pooler-config`), here a request may choose it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["PoolingParams"]


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    pooling_type: Literal["last", "mean"] = "last"
    """"last": the last prompt token's hidden state (what causal models' embeddings use);
    "mean": the average over all prompt tokens (every position is computed: no prefix-cache
    hits)."""
    normalize: bool = True
    """Scale the vector to unit L2 norm."""

    # No `dimensions` (OpenAI's, vLLM's Matryoshka truncation): it applies only to models
    # trained for it, and none of the architectures served here is; the server refuses it.

    def __post_init__(self) -> None:
        if self.pooling_type not in ("last", "mean"):
            raise ValueError(f"pooling_type must be 'last' or 'mean', got {self.pooling_type!r}.")
