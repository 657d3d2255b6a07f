"""The Llama-style decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3) over a flattened
batch.

Forward only: embeddings -> N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP)
-> RMSNorm; the config adds a family's features (`ModelArchConfig`: QKV biases for Qwen2,
a per-head RMSNorm of q and k before RoPE for Qwen3, a sliding window, longrope for
Phi-3); `compute_logits` runs the (tied) LM head only on the rows that need logits.
Inputs are the step's tokens of all requests laid end to end (`[num_tokens]`), so there is
no batch dimension; which tokens belong together is the attention backend's business,
reached through the `ForwardContext`.

Numerics follow Hugging Face's Llama so that greedy outputs match it token for token in
float32: RMSNorm in float32, RoPE cos/sin computed in float32 with the rotate-half layout,
residual adds in the model dtype. Q/K/V and gate/up projections are fused into one matmul
each at load time (`load_weights`, which `model/weights.py` implements).

Tensor parallelism (`distributed/parallel_state.get_tp_group()`, a group of one unless the
worker joined a larger one): each rank holds its share of the query heads (and of the KV
heads, replicated when there are more ranks than KV heads), of the MLP's columns and of the
vocabulary (`model/sharding.TPShard`). The column-parallel projections (qkv, gate_up) need
no communication; o_proj and down_proj are row-parallel and all-reduce their partial sums
(two all-reduces per layer); the embedding masks ids outside its vocabulary range and
all-reduces; the LM head's logits are all-gathered. Pipeline parallelism (`get_pp_group()`):
a stage builds only its layers (`get_pp_indices`); the first embeds, the others continue
from the previous stage's `(hidden, residual)`, and only the last applies the final norm.

Callers: the worker builds it (through `model/registry.py`) and the model runner runs it;
`spec_decode/` runs its first layers or reads its hidden states and LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.attention.backend import AttentionBackend, get_forward_context
from pagedinfer.distributed.kv_transfer.base import layer_name as kv_layer_name
from pagedinfer.distributed.parallel_state import (
    GroupCoordinator,
    get_pp_group,
    get_pp_indices,
    get_tp_group,
)
from pagedinfer.model.linear import Linear
from pagedinfer.model.rotary import Rope, RotaryEmbedding, apply_rotary
from pagedinfer.model.sharding import TPShard
from pagedinfer.model.weights import install_quantized, install_quantized_head, install_weights

if TYPE_CHECKING:
    from pagedinfer.model.arch_config import ModelArchConfig
    from pagedinfer.model.quant import QuantizedWeight, QuantMatrix

__all__ = ["ACTIVATIONS", "LlamaForCausalLM"]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)
        self.ops: Any = None  # C++ layer kernels (enable_fused_ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual), as vLLM's fused
        add-and-norm. The fused kernel works in place on x and residual."""
        if self.ops is not None:
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps)
            self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # As HF: normalise, then scale by the weight. The fused F.rms_norm is bitwise
            # equal to HF's pow/mean/rsqrt chain in float32 (used without the C++ ops).
            return self.weight * F.rms_norm(x, self.shape, eps=self.eps)
        # Lower precision: one fused op (it accumulates in float32 internally); rounding
        # once after the weight instead of HF's twice, i.e. slightly more accurate.
        return F.rms_norm(x, self.shape, self.weight, eps=self.eps)


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dimension of [num_tokens, num_heads, head_dim] (QK-norm), in
    float32 as Hugging Face's, then scaled by the weight in the input dtype. Always the
    torch path: the C++ norm kernels take [rows, hidden] contiguous inputs."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.eps = eps
        self.shape = (head_dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)
        return self.weight * normed


class LlamaAttention(nn.Module):
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
        self.layer_idx = local_idx
        """Index of this layer's KV cache in the forward context (local to the stage)."""
        self.layer_name = kv_layer_name(layer)
        """The layer's global name, under which a KV connector knows its cache."""
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.tp = tp
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        # Fused [q; k; v] rows: one matmul instead of three.
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, hidden)
        # Qwen3: each query and key head is RMS-normalised before RoPE.
        self.q_norm: HeadRMSNorm | None = None
        self.k_norm: HeadRMSNorm | None = None
        if config.qk_norm:
            self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend = backend
        self.options = config.attention_options(layer)
        """The layer's sliding window and soft cap, passed to the backend every call."""
        self.local_rope = config.sliding_rope_theta is not None and config.is_sliding(layer)
        """Whether the layer rotates with the sliding layers' own RoPE base (Gemma 3)."""
        self.ops: Any = None  # C++ layer kernels (enable_fused_ops)

    def forward(self, hidden: torch.Tensor, rope: Rope) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        num_rotated = self.num_heads + self.num_kv_heads
        if self.q_norm is not None and self.k_norm is not None:
            # In place on qkv (a fresh tensor), so both RoPE paths below read the result.
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.ops is not None:
            # In place on the q and k heads of qkv, the full float32 tables indexed by
            # position (this layer's: Gemma 3's sliding layers have their own).
            tables = rope.rotary
            self.ops.rotary_embedding(
                qkv, rope.positions, tables.cos, tables.sin, num_rotated, self.head_dim
            )
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_rotated, self.head_dim)
        else:
            # Rotate q and k heads together: one set of elementwise ops instead of two.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_rotated, self.head_dim)
            qk = apply_rotary(qk, *rope.tables())  # [num_tokens, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        connector = ctx.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        attn = self.backend.forward(
            q, k, v, kv_cache, ctx.attn_metadata, self.options
        )  # [num_tokens, num_heads, head_dim]
        if connector is not None:
            connector.save_kv_layer(self.layer_name, kv_cache)
        out = self.o_proj(attn.reshape(num_tokens, self.q_size))
        return self.tp.all_reduce(out)  # row-parallel: sum the ranks' partial products


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gated MLP's activations: SiLU (SwiGLU: Llama, Qwen, Mistral, Phi-3) and the tanh
approximation of GELU (GeGLU: Gemma)."""


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, shard: TPShard, tp: GroupCoordinator) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported ({ACTIVATIONS})")
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.tp = tp
        self.intermediate_size = shard.intermediate_size
        # Fused [gate; up] rows.
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size)
        self.ops: Any = None  # C++ layer kernels (enable_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.ops is not None:
            act = self.ops.gelu_tanh_and_mul if self.gelu else self.ops.silu_and_mul
            out = self.down_proj(act(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            out = self.down_proj(gate * up)
        return self.tp.all_reduce(out)  # row-parallel


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer: int,
        local_idx: int,
        backend: AttentionBackend,
        shard: TPShard,
        tp: GroupCoordinator,
    ) -> None:
        """Decoder layer `layer` (global index), the `local_idx`-th of its pipeline stage."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, local_idx, backend, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, shard, tp)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's MLP output, the residual stream) -> the same for this layer;
        the residual add is fused into the next norm (residual None: first layer)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows [vocab_start, vocab_start + vocab_per_rank) (zero rows past
    the vocabulary); ids outside the range look up zeros, and the all-reduce leaves each
    token exactly its one real row. A group of one is a plain embedding."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: GroupCoordinator) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(shard.vocab_per_rank, hidden_size), requires_grad=False
        )
        self.start = shard.vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class LlamaForCausalLM(nn.Module):
    decoder_layer_class: type[nn.Module] = LlamaDecoderLayer
    """The decoder layer a family builds (Gemma: `model/gemma.py`'s, with four norms)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.tp, self.pp = get_tp_group(), get_pp_group()
        self.shard = TPShard.of(config, self.tp.rank_in_group, self.tp.world_size)
        self.layer_start, self.layer_end = get_pp_indices(
            config.num_hidden_layers, self.pp.rank_in_group, self.pp.world_size
        )
        first, last = self.pp.is_first_rank, self.pp.is_last_rank
        tied = config.tie_word_embeddings
        # A stage holds the embedding if it embeds, or if it is the last and the LM head
        # is tied to it.
        self.embed_tokens: VocabParallelEmbedding | None = None
        if first or (last and tied):
            self.embed_tokens = VocabParallelEmbedding(self.shard, config.hidden_size, self.tp)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, i, i - self.layer_start, backend, self.shard, self.tp)
            for i in range(self.layer_start, self.layer_end)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.rotary_local: RotaryEmbedding | None = None
        """The sliding layers' RoPE tables, when they have a base of their own (Gemma 3)."""
        if torch.empty(()).device.type != "meta":
            self.build_rotary(config.max_position_embeddings)
        # On the meta device (the worker's build) the tables would be meta tensors, and the
        # first meta op costs ~1 s of torch imports: the worker builds them for real once
        # max_model_len is settled (Worker._build_rotary).
        self.lm_head_quant: QuantizedWeight | None = None
        self.lm_head_quant_max_rows = 0
        self.lm_head: nn.Linear | None = None
        if last and not tied:
            self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_per_rank, bias=False)
        self.requires_grad_(False)

    def build_rotary(self, max_position: int, max_model_len: int | None = None) -> None:
        """RoPE tables for positions [0, max_position), as real tensors (the worker builds
        the model on the meta device, then calls this once the engine's max_model_len is
        settled: longrope picks its factors by it; None: the model's context length)."""
        config = self.config
        self.rotary = RotaryEmbedding.of(config, max_position, max_model_len)
        if config.sliding_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.sliding_rope_theta, rope_scaling=None
            )
            self.rotary_local = RotaryEmbedding.of(local, max_position)

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    def enable_fused_ops(self, ops: Any) -> None:
        """Use the C++ layer kernels (`kernels/cpu.py`) for norms, RoPE and SiLU-and-mul.

        The kernels compute in float32 and round once: in bf16 they differ from torch's op
        chain by rounding; in float32 by summation order only (torch's ops reproduce Hugging
        Face's bit for bit, these do not, but the greedy tokens still equal HF's:
        tests/integration/test_hf_parity.py runs with them). Batch-1 float32 decode went
        ~65 -> ~85 tok/s with them.
        """
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):
                module.ops = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_layers: int | None = None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size].
        `num_layers`: run only the first N decoder layers, then the final norm (the
        self-speculative draft, `spec_decode/draft_model.py`).

        Pipeline stages: a stage after the first continues from `intermediate`, the
        previous stage's `forward_stage` output; use `forward_stage` on all but the last."""
        return self._run(input_ids, positions, num_layers, (), intermediate)[0]

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline stage before the last: its layers, without the final norm ->
        (hidden, residual), both [num_tokens, hidden_size], for the next stage."""
        hidden, residual = self._layers(input_ids, positions, None, (), intermediate)[:2]
        assert residual is not None, "a stage with no layers"
        return hidden, residual

    def forward_with_aux(
        self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the residual stream after each of `aux_layers` (0-based),
        concatenated: aux [num_tokens, len(aux_layers) * hidden_size]. EAGLE heads with
        fused features read them (`spec_decode/heads.py`)."""
        hidden, aux = self._run(input_ids, positions, None, aux_layers, None)
        return hidden, torch.cat(aux, dim=-1)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_layers: int | None,
        aux_layers: Sequence[int],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden, residual, aux = self._layers(
            input_ids, positions, num_layers, aux_layers, intermediate
        )
        assert self.norm is not None, "only the last pipeline stage has the final norm"
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_layers: int | None,
        aux_layers: Sequence[int],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        residual: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None and self.pp.is_first_rank
            hidden = self.embed(input_ids)  # [num_tokens, hidden_size]
            residual = None
        else:
            hidden, residual = intermediate
        rope = Rope(self.rotary, positions, hidden.dtype)
        rope_local = rope
        if self.rotary_local is not None:
            rope_local = Rope(self.rotary_local, positions, hidden.dtype)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers[:num_layers]):
            local = layer.self_attn.local_rope
            hidden, residual = layer(hidden, residual, rope_local if local else rope)
            if i in aux_layers:
                aux.append(hidden + residual)  # a copy: the next norm adds in place
        return hidden, residual, aux

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, hidden_size] inputs of the first layer."""
        assert self.embed_tokens is not None
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> logits [num_rows, vocab_size] in the model dtype.

        Not converted to float32 here: an all-greedy step takes the argmax of these as
        they are (exact: the conversion is monotone), and the sampler converts when it
        needs float32 (temperature, penalties, logprobs); at 200 rows the copy is 39 MB.
        Tensor parallel: each rank's vocabulary slice, all-gathered, padding cut off.
        """
        if self.lm_head_quant is not None and hidden.shape[0] <= self.lm_head_quant_max_rows:
            logits = self.lm_head_quant(hidden)  # [num_rows, vocab rows of this rank]
        else:
            logits = F.linear(hidden, self.lm_head_weight)  # [num_rows, vocab_per_rank]
        if self.tp.world_size == 1:
            return logits
        missing = self.shard.vocab_per_rank - logits.shape[1]
        if missing:  # the quantised head holds only real rows
            logits = F.pad(logits, (0, missing))
        return self.tp.all_gather(logits, dim=-1)[:, : self.config.vocab_size]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: the embedding's matrix when tied (this rank's
        vocabulary slice under tensor parallelism)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        assert self.embed_tokens is not None
        return self.embed_tokens.weight

    @torch.no_grad()
    def prepack_dense_weights(self, batch_hint: int) -> int:
        """oneDNN-blocked dense weights for every projection (`Linear.prepack`); returns
        how many were packed."""
        return sum(m.prepack(batch_hint) for m in self.modules() if isinstance(m, Linear))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Install HF-named Llama weights, fusing q/k/v and gate/up; every parameter must be
        covered exactly once. Under tensor/pipeline parallelism each rank takes only its
        slices and its stage's layers; the rest is dropped as it is read
        (`model/weights.install_weights`).

        The loaded tensors *become* the parameters (no copy into preallocated ones), and
        `state_dict` is consumed as it goes, so peak memory stays near one copy of the
        weights. The model may therefore be built on the meta device.
        """
        install_weights(self, state_dict)

    def load_quantized(
        self,
        blocks: dict[str, QuantMatrix],
        kernels: Any,
        max_rows: int,
        activations: str = "auto",
        keep_dense: bool = True,
    ) -> int:
        """Give the projections' steps of <= max_rows rows the file's own quantised
        matrices (`model/quant`, installed by `model/weights.install_quantized`); returns
        how many got one.

        A fused projection (qkv, gate_up) gets them when all its parts are stored in one
        format, or as parts in their own formats. `keep_dense=False` (every step the engine
        runs is within max_rows): they take every step and hold no dense weight; call it
        before `load_weights`, which then neither expects nor keeps those.
        """
        return install_quantized(self, blocks, kernels, max_rows, activations, keep_dense)

    def load_quantized_head(
        self,
        blocks: dict[str, QuantMatrix],
        kernels: Any,
        max_rows: int,
        quantize_lm_head: bool,
        activations: str = "auto",
    ) -> int:
        """The LM head's quantised path for steps of <= max_rows rows, after `load_weights`:
        the file's Q8_0/Q4/K-quant copy of its matrix (tied: the embedding's), else, if
        `quantize_lm_head`, a Q8_0 quantisation of the dense one (at batch 1 the LM head is
        the largest single read of a step; float32 models keep their exact weights). The
        dense matrix stays (tied: it is the embedding). Returns 1 if it got one, else 0.
        """
        return install_quantized_head(
            self, blocks, kernels, max_rows, quantize_lm_head, activations
        )
