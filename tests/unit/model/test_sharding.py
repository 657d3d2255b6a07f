"""Tests for the per-rank load plan: TP shard sizes (head replication, vocabulary padding),
row/column ranges, and what `load_plan` / `keep_part` / `vocab_slice` keep of a matrix."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.model.arch_config import ModelArchConfig
from pagedinfer.model.sharding import (
    PROJECTIONS,
    TPShard,
    keep_part,
    load_plan,
    shard_ranges,
    vocab_slice,
)


def _config(heads: int = 4, kv_heads: int = 2, vocab: int = 100) -> ModelArchConfig:
    return ModelArchConfig(
        vocab_size=vocab,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_kv_heads_are_replicated_past_their_count() -> None:
    config = _config(heads=4, kv_heads=2)
    shards = [TPShard.of(config, rank, 4) for rank in range(4)]
    assert {(s.num_heads, s.num_kv_heads) for s in shards} == {(1, 1)}
    assert [s.kv_head_start(2) for s in shards] == [0, 0, 1, 1]
    assert [shard_ranges(config, s)["kv"] for s in shards] == [(0, 8), (0, 8), (8, 16), (8, 16)]


def test_vocabulary_is_padded_per_rank() -> None:
    config = _config(vocab=100)
    assert TPShard.of(config, 0, 1).vocab_per_rank == 100
    last = TPShard.of(config, 1, 2)  # 2 x 64 rows, the last 28 past the vocabulary
    assert (last.vocab_start, last.vocab_per_rank) == (64, 64)
    assert shard_ranges(config, last)["vocab"] == (64, 100)
    embed = torch.arange(100.0)[:, None].expand(100, 3)
    for weight in (embed, embed[64:]):  # whole, or the rows `load_plan` reads alone
        part = vocab_slice(weight, config, last)
        assert part.shape == (64, 3) and torch.equal(part[:36], embed[64:])
        assert not part[36:].any()


@pytest.mark.parametrize("heads,kv_heads,size", [(4, 2, 3), (12, 4, 3)])
def test_undividable_sizes_are_refused(heads: int, kv_heads: int, size: int) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size}"):
        TPShard.of(_config(heads, kv_heads), 0, size)


def test_load_plan_keeps_a_stage_and_a_ranks_rows() -> None:
    config = _config()
    wanted, rows = load_plan(config, 1, 2, 1, 2)  # tp rank 1/2, the last of 2 stages
    assert not wanted("model.layers.2.mlp.up_proj.weight") and wanted("model.layers.3.x")
    assert wanted("model.embed_tokens.weight") and wanted("model.norm.weight")  # tied head
    assert rows("model.layers.3.self_attn.q_proj.weight") == (16, 32)
    assert rows("model.layers.3.self_attn.v_proj.weight") == (8, 16)
    assert rows("model.layers.3.mlp.gate_proj.weight") == (24, 48)
    assert rows("model.embed_tokens.weight") == (64, 100)
    for name in ("model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):  # fmt: skip
        assert rows(name) is None
    first_wanted, first_rows = load_plan(config, 0, 1, 0, 2)
    assert first_wanted("model.layers.2.mlp.up_proj.weight") and not first_wanted("lm_head.weight")
    assert first_rows("model.layers.0.self_attn.q_proj.weight") is None


def test_keep_part_cuts_rows_and_columns() -> None:
    config = _config()
    ranges = shard_ranges(config, TPShard.of(config, 1, 2))
    q, _, _ = PROJECTIONS["self_attn.qkv_proj"]
    (o,) = PROJECTIONS["self_attn.o_proj"]
    w = torch.arange(32.0 * 32).view(32, 32)
    assert torch.equal(keep_part(w, q, ranges), w[16:32])
    assert torch.equal(keep_part(w[16:32], q, ranges), w[16:32])  # read pre-cut
    assert torch.equal(keep_part(w, o, ranges), w[:, 16:32])
