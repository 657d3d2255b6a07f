"""Attention metadata of a flattened batch, built from per-request numpy arrays.

`make_attention_metadata` turns "request i runs `num_scheduled[i]` tokens from position
`computed[i]`, its KV in the blocks of row i of a block table" into the
`CommonAttentionMetadata` every backend builds its own metadata from, plus each token's
position; `padded_block_table` makes that table from per-request block id lists. Everything
is vectorised numpy on the CPU; the tensors share the arrays' memory.

Callers: the model runner (every step), the draft proposers (their own forwards over the
same paged cache) and the draft trainer.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedinfer.attention.backend import CommonAttentionMetadata

__all__ = ["make_attention_metadata", "padded_block_table"]


def padded_block_table(block_ids: list[list[int]]) -> np.ndarray:
    """`[num_reqs, max_blocks]` int32 block table, each row padded with 0."""
    table = np.zeros((len(block_ids), max(len(ids) for ids in block_ids)), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


def make_attention_metadata(
    num_scheduled: np.ndarray, computed: np.ndarray, block_table: np.ndarray, block_size: int
) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """The flattened batch's attention metadata and token positions: request i runs
    `num_scheduled[i]` tokens starting at position `computed[i]`, its KV in the blocks of
    `block_table[i]` (`[num_reqs, max_blocks]` int32, padded)."""
    num_reqs = len(num_scheduled)
    seq_lens_np = computed + num_scheduled  # [num_reqs]
    qsl_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qsl_np[1:])
    num_tokens = int(qsl_np[-1])
    # Per-token request index and position, then slots, all vectorised.
    req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)  # [num_tokens]
    positions_np = np.arange(num_tokens) - np.repeat(qsl_np[:-1] - computed, num_scheduled)
    slots_np = (
        block_table[req_of_token, positions_np // block_size].astype(np.int64) * block_size
        + positions_np % block_size
    )  # [num_tokens]
    common = CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl_np.astype(np.int32)),
        query_start_loc_cpu=qsl_np.tolist(),
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)),
        seq_lens_cpu=seq_lens_np.tolist(),
        num_computed_tokens_cpu=computed.tolist(),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens_np.max()),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots_np),
        block_size=block_size,
    )
    return common, positions_np
