"""Gemma 2 and Gemma 3 (text): the Llama-style decoder with Gemma's norms and scalings.

What differs from `model/llama.py`, composed from its blocks:
- four RMSNorms per layer ("sandwich" norms): before and after attention, before and after
  the MLP, each output normed before it joins the residual stream; every norm (QK-norm
  too) scales by (1 + weight), which the model stores as the multiplier itself: GGUF files
  hold it that way (llama.cpp's converter adds the 1), and the loader adds it to Hugging
  Face weights (`model/loader.py`);
- the embeddings multiplied by sqrt(hidden_size), rounded to the model dtype (as
  transformers does);
- GELU-tanh gated MLP, scores scaled by `query_pre_attn_scalar` ** -0.5, sliding-window
  layers interleaved with global ones (`ModelArchConfig.layer_types`), in Gemma 3 with a
  RoPE base of their own, QK-norm (Gemma 3), and soft caps on the attention scores and the
  final logits (Gemma 2). Those are config fields the shared blocks read.

Callers: the worker builds it through `model/registry.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedinfer.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm

if TYPE_CHECKING:
    from pagedinfer.attention.backend import AttentionBackend
    from pagedinfer.distributed.parallel_state import GroupCoordinator
    from pagedinfer.model.arch_config import ModelArchConfig
    from pagedinfer.model.rotary import Rope
    from pagedinfer.model.sharding import TPShard

__all__ = ["GemmaForCausalLM"]


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer: int,
        local_idx: int,
        backend: AttentionBackend,
        shard: TPShard,
        tp: GroupCoordinator,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, layer, local_idx, backend, shard, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config, shard, tp)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's normed MLP output, the residual stream) -> the same for
        this layer; as in `LlamaDecoderLayer`, each add to the residual stream is fused into
        the norm that follows it."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer_class = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        # transformers multiplies by sqrt(hidden) already rounded to the model dtype.
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
