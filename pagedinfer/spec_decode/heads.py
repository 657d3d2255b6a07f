"""Trained draft heads for the default model: EAGLE and Medusa, and their file format.

Both read the target's final hidden states (after its last norm: the LM head's input, here
called features) and reuse the target's token embedding and LM head, restricted to a draft
vocabulary (`draft_vocab`: the tokens the training text uses most, in target ids): at batch 1
the full 49,152-row LM head costs about a third of a target forward, and a draft head runs it
k times a step.

- `EagleHead` (EAGLE-1, Li et al. 2024): the input at position t is the feature h_t and the
  embedding of the NEXT token x_{t+1}; `fc` maps [e(x_{t+1}); h_t] to the hidden size, one
  Llama decoder layer (attention over the earlier positions, with its own KV cache) turns it
  into a predicted feature f_{t+1} ~ h_{t+1}, and the LM head gives token t+2. Drafting
  feeds f and the drafted token back in. With `aux_layers` (fused features, as EAGLE-3,
  Li et al. 2025), the first step's feature is `fuse`([low; mid; h_t]): h_t alone is what
  the target needs for ITS next token, and the earlier layers keep more of what predicts
  the ones after it.
- `MedusaHeads` (Cai et al. 2024): k heads predict the tokens t+2..t+1+k in parallel from
  one input. Deviation from Medusa (and vLLM), whose heads read h_t alone: ours also read
  the embedding of x_{t+1}, the token the target just chose from h_t, which every proposer
  call has in hand. On a 135M model h_t alone left head 1 at 23% top-1 (it has to recompute
  the target's own argmax); with the token in, the heads stay parallel and one pass, as
  Medusa's (Hydra-style heads, which also feed drafted tokens back, are not this).
  `fc` maps [e(x_{t+1}); h_t] to x, and head i is a residual SiLU MLP on x.

Files are safetensors (tensors only; no pickle) with a JSON `config` in the metadata:
{"method", "hidden_size", ..., "target"} so a head is never loaded against the wrong model.
Training: `pagedinfer/training/` (`pagedinfer train-draft`). The heads shipped for the default
model lie in `spec_decode/trained/`; `config.shipped_heads_path` picks one when
`SpeculativeConfig.model` is not given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HeadConfig", "EagleHead", "MedusaHeads", "load_heads", "save_heads"]


@dataclass
class HeadConfig:
    method: str  # "eagle" | "medusa"
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int = 0  # attention heads (eagle)
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_medusa_heads: int = 0
    medusa_intermediate_size: int = 0  # each Medusa head's MLP width
    target: str = ""  # the target model's name, checked at load time
    # EAGLE with fused features (as EAGLE-3): the residual stream after these target layers
    # (0-based) joins h_t as the first draft step's input; empty: h_t alone (EAGLE-1).
    aux_layers: list[int] = field(default_factory=list)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x [tokens, heads, head_dim] at `positions` [tokens] (as the
    target's `apply_rotary`)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [tokens, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [tokens, 1, head_dim]
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)).to(x.dtype)


# An attention function: (q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H, D].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention over one sequence (training); GQA by repeating KV heads."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )  # [H, T, D]
    return out.transpose(0, 1)


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = c = config
        h = c.hidden_size
        self.fuse: nn.Linear | None = None
        if c.aux_layers:
            n = len(c.aux_layers)
            self.fuse = nn.Linear((n + 1) * h, h, bias=False)
            with torch.no_grad():  # starts as h_t alone (EAGLE-1)
                self.fuse.weight.zero_()
                self.fuse.weight[:, n * h :].copy_(torch.eye(h))
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        nn.init.zeros_(self.o.weight)  # starts as the identity on fc's output
        nn.init.zeros_(self.down.weight)

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, (len(aux_layers) + 1) * H] (the aux layers' residual
        streams, then h_t) -> the first step's input feature [T, H]. Each aux part is
        RMS-normalised first: the residual stream's scale grows with depth, far from h_t's."""
        if self.fuse is None:
            return target_features
        h = self.config.hidden_size
        parts = target_features.unflatten(-1, (-1, h))  # [T, n + 1, H]
        aux = F.rms_norm(parts[:, :-1].float(), (h,), eps=self.config.rms_norm_eps)
        joined = torch.cat([aux.to(parts.dtype), parts[:, -1:]], dim=1)
        return self.fuse(joined.flatten(1))

    def forward(
        self,
        features: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention = causal_attention,
    ) -> torch.Tensor:
        """features h_t [T, H] (`project`ed when fused, or the head's own f_t in later draft
        steps), next_embeds e(x_{t+1}) [T, H], positions t [T] -> predicted features
        f_{t+1} [T, H]. `attention` is dense causal (training) or paged."""
        c = self.config
        x = self.fc(torch.cat([next_embeds, features], dim=-1))  # [T, H]
        residual = x
        y = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv(y)  # [T, (heads + 2 kv) * D]
        n_q, n_kv, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        q = qkv[:, :n_q].view(-1, c.num_heads, d)
        k = qkv[:, n_q : n_q + n_kv].view(-1, c.num_kv_heads, d)
        v = qkv[:, n_q + n_kv :].view(-1, c.num_kv_heads, d)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        attn = attention(q, k, v).reshape(-1, n_q)  # [T, heads * D]
        x = residual + self.o(attn)
        y = rms_norm(x, self.post_norm, c.rms_norm_eps)
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)  # [T, H]


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        h, k, m = config.hidden_size, config.num_medusa_heads, config.medusa_intermediate_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():  # starts as x = h_t
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
        self.up = nn.Parameter(torch.empty(k, m, h))
        self.up_bias = nn.Parameter(torch.zeros(k, m))
        self.down = nn.Parameter(torch.zeros(k, h, m))  # each head starts as x itself
        nn.init.normal_(self.up, std=1.0 / math.sqrt(h))

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """h_t [T, H] and e(x_{t+1}) [T, H] -> per-head features [k, T, H] (head i, 0-based,
        predicts token t+2+i)."""
        x = self.fc(torch.cat([next_embeds, features], dim=-1))  # [T, H]
        u = torch.einsum("th,kmh->ktm", x, self.up) + self.up_bias[:, None, :]  # [k, T, m]
        return x[None] + torch.einsum("ktm,khm->kth", F.silu(u), self.down)


def save_heads(
    path: str, head: nn.Module, config: HeadConfig, draft_vocab: torch.Tensor, extra: dict
) -> None:
    from safetensors.torch import save_file

    tensors = {f"head.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    meta = {"config": json.dumps(asdict(config)), "training": json.dumps(extra)}
    save_file(tensors, path, metadata=meta)


def load_heads(
    path: str, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, HeadConfig, torch.Tensor, dict[str, Any]]:
    """(head module, config, draft vocabulary [V_d] target ids, training info)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if "config" not in meta:
        raise ValueError(f"{path}: not a pagedinfer draft-heads file (no config)")
    config = HeadConfig(**json.loads(meta["config"]))
    head: nn.Module = EagleHead(config) if config.method == "eagle" else MedusaHeads(config)
    head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
    head.to(dtype).eval().requires_grad_(False)
    return head, config, tensors["draft_vocab"], json.loads(meta.get("training", "{}"))
