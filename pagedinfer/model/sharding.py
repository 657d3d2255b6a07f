"""What of a model's weights one tensor-/pipeline-parallel rank holds: the per-rank load plan.

Role: pure functions of the architecture config (`ModelArchConfig`) and a rank's place in
the TP x PP grid. `TPShard` sizes a rank's share (query heads, KV heads, MLP columns,
vocabulary rows), `shard_ranges` turns it into row/column ranges of the full matrices,
`PROJECTIONS` says which checkpoint matrices fuse into which parameter and which of their
rows or columns a rank keeps, and `load_plan` tells the loader which weights (a pipeline
stage's layers) and which rows (a TP shard) to read from the file.

Invariants:
- A shard never splits a head: ranks hold whole query heads, and whole KV heads (one KV
  head is shared by several ranks when there are more ranks than KV heads).
- Each rank's vocabulary slice is `vocab_per_rank` rows, a multiple of `VOCAB_PAD` under
  tensor parallelism; the last rank's slice may run past the vocabulary (zero rows).
- Column-parallel matrices (q/k/v, gate/up, vocabulary) are cut by rows, which `load_plan`
  can read alone from a GGUF file; row-parallel ones (o_proj, down_proj) are read whole and
  cut by columns when installed (`model/weights.py`).

Callers: the worker (`load_plan`, `TPShard` to size its attention backend), the model
(`model/llama.py` builds its layers from a `TPShard`) and `model/weights.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedinfer.distributed.parallel_state import get_pp_indices

if TYPE_CHECKING:
    from pagedinfer.model.arch_config import ModelArchConfig

__all__ = [
    "PROJECTIONS",
    "VOCAB_PAD",
    "RowPlan",
    "ShardedPart",
    "TPShard",
    "WeightFilter",
    "keep_part",
    "load_plan",
    "shard_ranges",
    "vocab_slice",
]

VOCAB_PAD = 64
"""Each rank's vocabulary slice is a multiple of this many rows (vLLM pads to 64 too)."""

WeightFilter = Callable[[str], bool]
"""HF weight name -> whether this process needs it (a pipeline stage skips other layers)."""
RowPlan = Callable[[str], "tuple[int, int] | None"]
"""HF weight name -> the rows [start, end) this process needs (a tensor-parallel shard), or
None for all of them."""


@dataclass(frozen=True)
class TPShard:
    """What one tensor-parallel rank holds of a model (all sizes local to the rank)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_start: int
    vocab_per_rank: int

    @classmethod
    def of(cls, config: ModelArchConfig, rank: int, size: int) -> TPShard:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {heads} attention heads"
            )
        if (size <= kv_heads and kv_heads % size) or (size > kv_heads and size % kv_heads):
            raise ValueError(
                f"tensor_parallel_size {size} and the model's {kv_heads} KV heads: one must "
                f"divide the other"
            )
        if config.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the MLP size "
                f"{config.intermediate_size}"
            )
        unit = VOCAB_PAD * size
        per_rank = -(-config.vocab_size // unit) * unit // size if size > 1 else config.vocab_size
        return cls(
            rank=rank,
            size=size,
            num_heads=heads // size,
            num_kv_heads=max(kv_heads // size, 1),
            intermediate_size=config.intermediate_size // size,
            vocab_start=rank * per_rank,
            vocab_per_rank=per_rank,
        )

    def kv_head_start(self, total_kv_heads: int) -> int:
        """The first global KV head this rank holds (ranks share one when replicated)."""
        if self.size <= total_kv_heads:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // total_kv_heads)


def shard_ranges(config: ModelArchConfig, shard: TPShard) -> dict[str, tuple[int, int]]:
    """[start, end) of the rows (of q, k/v, gate/up, the vocabulary) or columns (of o_proj,
    down_proj) of the full matrices that a tensor-parallel rank holds."""
    hd = config.head_dim
    q0 = shard.rank * shard.num_heads * hd
    kv0 = shard.kv_head_start(config.num_key_value_heads) * hd
    i0 = shard.rank * shard.intermediate_size
    vocab_end = min(shard.vocab_start + shard.vocab_per_rank, config.vocab_size)
    return {
        "q": (q0, q0 + shard.num_heads * hd),
        "kv": (kv0, kv0 + shard.num_kv_heads * hd),
        "mlp": (i0, i0 + shard.intermediate_size),
        "vocab": (shard.vocab_start, vocab_end),
    }


@dataclass(frozen=True)
class ShardedPart:
    """One checkpoint matrix of a decoder layer and what of it a tensor-parallel rank keeps."""

    name: str
    """The HF module path inside a layer, e.g. `self_attn.q_proj`."""
    rows: str | None = None
    """The `shard_ranges` key of the rows kept (a column-parallel matrix); None keeps all."""
    cols: str | None = None
    """The `shard_ranges` key of the columns kept (a row-parallel matrix); None keeps all."""


PROJECTIONS: dict[str, tuple[ShardedPart, ...]] = {
    # Fused [q; k; v] rows: one matmul instead of three.
    "self_attn.qkv_proj": (
        ShardedPart("self_attn.q_proj", rows="q"),
        ShardedPart("self_attn.k_proj", rows="kv"),
        ShardedPart("self_attn.v_proj", rows="kv"),
    ),
    "self_attn.o_proj": (ShardedPart("self_attn.o_proj", cols="q"),),
    # Fused [gate; up] rows.
    "mlp.gate_up_proj": (
        ShardedPart("mlp.gate_proj", rows="mlp"),
        ShardedPart("mlp.up_proj", rows="mlp"),
    ),
    "mlp.down_proj": (ShardedPart("mlp.down_proj", cols="mlp"),),
}
"""A Llama decoder layer's projections: the model's parameter (module path inside a layer)
-> the checkpoint matrices stacked by rows into it, in order."""

_ROW_KIND = {
    part.name.rpartition(".")[2]: part.rows
    for parts in PROJECTIONS.values()
    for part in parts
    if part.rows is not None
}
"""Last module name of a row-sharded matrix (`q_proj`) -> its `shard_ranges` key."""


def load_plan(
    config: ModelArchConfig, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> tuple[WeightFilter, RowPlan]:
    """What one rank needs of the file, for `load_model_weights(wanted=, rows=)`: its
    stage's layers (plus the embedding, norm and LM head where the stage uses them)
    and, of the row-sharded matrices, its rows. The model's `load_weights` cuts the rest
    (the columns of o_proj and down_proj) and accepts whole or pre-cut matrices alike."""
    ranges = shard_ranges(config, TPShard.of(config, tp_rank, tp_size))
    start, end = get_pp_indices(config.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def wanted(name: str) -> bool:
        if name.startswith("model.layers."):
            return start <= int(name.split(".")[2]) < end
        if name == "model.embed_tokens.weight":
            return first or (last and config.tie_word_embeddings)
        return last  # the final norm and an untied LM head

    def rows(name: str) -> tuple[int, int] | None:
        if tp_size == 1:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return ranges["vocab"]
        kind = _ROW_KIND.get(name.rsplit(".", 2)[-2]) if name.endswith(".weight") else None
        return ranges[kind] if kind is not None else None

    return wanted, rows


def keep_part(
    weight: torch.Tensor, part: ShardedPart, ranges: dict[str, tuple[int, int]]
) -> torch.Tensor:
    """This rank's rows and columns of a [out, in] matrix: rows unless `load_plan` already
    read only those, columns always (a view of the whole columns when unsharded)."""
    if part.rows is not None:
        lo, hi = ranges[part.rows]
        weight = weight if weight.shape[0] == hi - lo else weight[lo:hi]
    if part.cols is not None:
        weight = weight[:, slice(*ranges[part.cols])]
    return weight


def vocab_slice(weight: torch.Tensor, config: ModelArchConfig, shard: TPShard) -> torch.Tensor:
    """This rank's vocabulary rows of a [vocab_size, hidden] matrix (or of those rows
    alone, as `load_plan` reads them), zero-padded to `vocab_per_rank` rows."""
    lo, hi = shard_ranges(config, shard)["vocab"]
    part = weight if weight.shape[0] == hi - lo else weight[lo:hi]
    missing = shard.vocab_per_rank - part.shape[0]
    return F.pad(part, (0, 0, 0, missing)) if missing else part
