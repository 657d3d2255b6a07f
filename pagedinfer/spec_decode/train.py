"""Training of EAGLE and Medusa draft heads by self-distillation (`pagedinfer train-draft`).

Pipeline (`train_draft`), every stage deterministic given the seed:
1. Data: turn 0 of ShareGPT rows [0, num_prompts) in file order, in the target's chat
   template, cut to `MAX_PROMPT_TOKENS`. Rows >= `HOLDOUT_START` are the held-out evaluation
   set: nothing here reads them (`training_prompt_indices` asserts it).
2. The target continues every prompt greedily (one batched `LLM.generate`): with greedy
   verification a draft is accepted exactly when it equals the target's argmax.
3. Features: the target's own paged forward over each whole sequence (a private KV cache,
   the worker's backend) gives h_t, the LM head's input, at every position (float32).
   `data_cache` keeps 2-3 in a file for later runs.
4. Training on CPU: AdamW (no weight decay), clipping, warmup then cosine decay. Labels are
   draft-vocabulary ids (`build_draft_vocab`); cross-entropy counts only generated labels.
   - EAGLE: (h_t + noise, e(x_{t+1})) -> f_{t+1}; loss SmoothL1(f_{t+1}, h_{t+1}) at every
     position + `ce_weight` * CE(f_{t+1} W_d^T, x_{t+2}). Then `unroll_steps` - 1 more draft
     steps as drafting runs them ("training-time test", as EAGLE-3): step s feeds back the
     head's own f with the true x_{t+s}, attends to step 1's keys of the true prefix and its
     own chain's, and adds the same loss (weight `step_decay`**(s-1)) against h_{t+s} and
     x_{t+s+1}; only rows with a generated label at some step run them. Without it the
     head never sees its own features, and step 2 and 3 accuracy collapses. Batches
     concatenate sequences (about `batch_tokens` rows); attention stays within a sequence.
   - Medusa: (h_t, e(x_{t+1})) -> head i (0-based) predicts x_{t+2+i}; loss
     sum_i `head_decay`**i CE_i, over batches of random positions.
   Validation: a seeded 5% of the training prompts; top-1 accuracy over generated labels (one
   outside the draft vocabulary is a miss), per Medusa head, and per EAGLE draft step.
5. `heads.save_heads` writes the head, its config, the draft vocabulary and the run's record.

An offline tool driving the whole engine: it imports `LLM` and the worker's helpers lazily.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.spec_decode import heads

if TYPE_CHECKING:
    from pagedinfer.entrypoints.llm import LLM

__all__ = [
    "HOLDOUT_START", "MAX_PROMPT_TOKENS", "DistillData", "TrainSettings", "build_draft_vocab",
    "chat_prompts", "compute_features", "generate_sequences", "load_distill_data",
    "load_training_prompts", "save_distill_data", "split_sequences", "target_name",
    "train_draft", "train_heads", "training_prompt_indices",
]  # fmt: skip

HOLDOUT_START = 800
"""ShareGPT rows with this index or higher are the held-out evaluation set."""
MAX_PROMPT_TOKENS = 512
_KEEP_TAIL = 16  # a cut prompt keeps its last tokens: the template's assistant turn start
# Label values besides draft ids: no label (past the end, or a prompt token), and a
# generated token outside the draft vocabulary (not trained on; a miss in the accuracies).
_IGNORE = -100
_OOV = -1

DEFAULT_EPOCHS = {"eagle": 4, "medusa": 3}
DEFAULT_LR = {"eagle": 1e-3, "medusa": 2e-3}


def training_prompt_indices(num_prompts: int) -> list[int]:
    """ShareGPT row indices used for training: [0, num_prompts), never a held-out row."""
    if not 0 < num_prompts <= HOLDOUT_START:
        raise ValueError(f"num_prompts must be in [1, {HOLDOUT_START}], got {num_prompts}")
    indices = list(range(num_prompts))
    assert max(indices) < HOLDOUT_START, "held-out rows must never be trained on"
    return indices


def load_training_prompts(
    num_prompts: int, data_path: str | None = None, all_turns: bool = False
) -> list[str]:
    """Turn-0 texts of the training rows (rows without a string turn 0 are skipped); with
    `all_turns`, every user turn of those rows, each as a prompt of its own (about 3.6x the
    prompts: more text for the heads from the same rows)."""
    from pagedinfer.bench.datasets import default_sharegpt_path

    with open(data_path or default_sharegpt_path(), encoding="utf-8") as f:
        rows = json.load(f)
    texts = []
    for i in training_prompt_indices(num_prompts):
        turns = rows[i].get("conversations") if isinstance(rows[i], dict) else None
        for j, turn in enumerate(turns or []):
            if j > 0 and not all_turns:
                break
            if not isinstance(turn, dict) or (j > 0 and turn.get("from") not in ("human", "user")):
                continue
            text = turn.get("value")
            if isinstance(text, str) and text.strip():
                texts.append(text)
    return texts


def chat_prompts(
    tokenizer: Any, texts: Sequence[str], max_prompt_tokens: int = MAX_PROMPT_TOKENS
) -> list[list[int]]:
    """Each text as a user message in the chat template, with the generation prompt; a
    prompt longer than `max_prompt_tokens` loses its middle (head and template tail kept)."""
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if len(ids) > max_prompt_tokens:
            ids = ids[: max_prompt_tokens - _KEEP_TAIL] + ids[-_KEEP_TAIL:]
        out.append(list(ids))
    return out


def generate_sequences(
    llm: LLM, prompts: Sequence[list[int]], max_tokens: int
) -> list[tuple[list[int], int]]:
    """Greedy continuations, one batched call: (prompt + generated ids, prompt length)."""
    from pagedinfer.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(p) + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outputs)]


@dataclass
class DistillData:
    """All sequences end to end. Sequence i is rows [starts[i], starts[i + 1])."""

    token_ids: torch.Tensor  # [num_rows] int64
    features: torch.Tensor  # [num_rows, hidden_size] float32: h_t of each row's token
    starts: list[int]  # [num_seqs + 1]
    num_prompt_tokens: list[int]  # [num_seqs]
    aux_layers: list[int] = field(default_factory=list)
    aux: torch.Tensor | None = None  # [num_rows, len(aux_layers) * hidden_size] bfloat16

    def target_features(self, rows: torch.Tensor) -> torch.Tensor:
        """What a fused EAGLE head's first step reads at `rows`: [aux; h_t], float32."""
        if self.aux is None:
            return self.features[rows]
        return torch.cat([self.aux[rows].float(), self.features[rows]], dim=-1)

    def sequences(self) -> list[tuple[list[int], int]]:
        """(token ids, prompt length) per sequence, as `generate_sequences` made them."""
        ids = self.token_ids.tolist()
        return [
            (ids[self.starts[i] : self.starts[i + 1]], self.num_prompt_tokens[i])
            for i in range(self.num_seqs)
        ]

    @property
    def num_seqs(self) -> int:
        return len(self.num_prompt_tokens)

    def rows(self, i: int) -> tuple[int, int, int]:
        """(first row, end row, first generated row) of sequence i."""
        a = self.starts[i]
        return a, self.starts[i + 1], a + self.num_prompt_tokens[i]


@torch.no_grad()
def compute_features(
    llm: LLM, sequences: Sequence[tuple[list[int], int]], aux_layers: Sequence[int] = ()
) -> DistillData:
    """The target's features for every position of every sequence, one sequence per paged
    forward (a temporary KV cache; the engine's own cache is not touched); with
    `aux_layers`, also the residual stream after those layers (bfloat16: it is 2-3 times
    the size of the features)."""
    from pagedinfer.attention.backend import ForwardContext, set_forward_context
    from pagedinfer.attention.metadata import make_attention_metadata

    worker = llm.llm_engine.engine_core.executor.worker
    model, backend, arch = worker.model, worker.backend, worker.arch
    bs = worker.config.cache_config.block_size
    lengths = [len(ids) for ids, _ in sequences]
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    features = torch.empty(starts[-1], arch.hidden_size)  # [num_rows, hidden_size] float32
    aux = None
    if aux_layers:
        aux = torch.empty(starts[-1], len(aux_layers) * arch.hidden_size, dtype=torch.bfloat16)
    num_blocks = -(-max(lengths) // bs)
    kv = [
        torch.zeros(2, num_blocks, bs, arch.num_key_value_heads, arch.head_dim, dtype=worker.dtype)
        for _ in range(arch.num_hidden_layers)
    ]  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
    for (ids, _), a in zip(sequences, starts):
        n = len(ids)
        # Stale K/V of an earlier, longer sequence beyond slot n is never read (causal).
        table = np.arange(-(-n // bs), dtype=np.int32)[None]  # [1, blocks]
        common, positions = make_attention_metadata(np.array([n]), np.array([0]), table, bs)
        ctx = ForwardContext(attn_metadata=backend.build(common), kv_caches=kv)
        inputs = (torch.tensor(ids, dtype=torch.int64), torch.from_numpy(positions))
        with set_forward_context(ctx):
            if aux is None:
                hidden = model(*inputs)
            else:
                hidden, aux_rows = model.forward_with_aux(*inputs, aux_layers)
                aux[a : a + n] = aux_rows
        features[a : a + n] = hidden.float()  # [n, hidden_size]
    token_ids = torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.int64)
    return DistillData(
        token_ids, features, starts, [p for _, p in sequences], list(aux_layers), aux
    )


def build_draft_vocab(
    data: DistillData, seq_indices: Sequence[int], size: int, eos_token_ids: Sequence[int],
    vocab_size: int,
) -> torch.Tensor:  # fmt: skip
    """The draft vocabulary [size] int64, sorted by target id: every EOS id, then the tokens
    generated most often in `seq_indices`; ties (and unseen tokens, when fewer than `size`
    were generated) by prompt frequency, then by lower id."""
    if not len(eos_token_ids) <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size} must be in [{len(eos_token_ids)}, {vocab_size}]")
    gen = np.zeros(vocab_size, dtype=np.int64)
    prompt = np.zeros(vocab_size, dtype=np.int64)
    ids = data.token_ids.numpy()
    for i in seq_indices:
        a, b, g = data.rows(i)
        gen += np.bincount(ids[g:b], minlength=vocab_size)
        prompt += np.bincount(ids[a:g], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -prompt, -gen))  # last key is the primary
    eos = sorted(set(eos_token_ids))
    rest = order[~np.isin(order, eos)][: size - len(eos)]
    return torch.from_numpy(np.sort(np.concatenate([eos, rest]))).to(torch.int64)


def split_sequences(num_seqs: int, val_frac: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) sequence indices, each sorted: a seeded random split."""
    if num_seqs < 2:
        raise ValueError("need at least 2 sequences (one to train on, one to validate)")
    perm = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = min(num_seqs - 1, max(1, round(val_frac * num_seqs)))
    return sorted(perm[num_val:]), sorted(perm[:num_val])


def save_distill_data(path: str, data: DistillData, key: dict[str, Any]) -> None:
    """Write sequences and features (safetensors) with `key` naming what produced them."""
    from safetensors.torch import save_file

    tensors = {
        "token_ids": data.token_ids, "features": data.features,
        "starts": torch.tensor(data.starts),
        "num_prompt_tokens": torch.tensor(data.num_prompt_tokens),
    }  # fmt: skip
    if data.aux is not None:
        tensors["aux"] = data.aux
    meta = {"key": json.dumps(key, sort_keys=True), "aux_layers": json.dumps(data.aux_layers)}
    save_file(tensors, path, metadata=meta)


def load_distill_data(path: str, key: dict[str, Any]) -> DistillData:
    """Read `save_distill_data`'s file; ValueError if it was made for another `key`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        found = json.loads(meta.get("key", "{}"))
        if found != json.loads(json.dumps(key)):
            raise ValueError(f"{path} holds data for {found}, not {key}: delete it or rename")
        t = {name: f.get_tensor(name) for name in f.keys()}
    return DistillData(
        t["token_ids"], t["features"], t["starts"].tolist(), t["num_prompt_tokens"].tolist(),
        json.loads(meta.get("aux_layers", "[]")), t.get("aux"),
    )  # fmt: skip


@dataclass
class TrainSettings:
    epochs: int
    lr: float
    seed: int = 0
    batch_tokens: int = 2048  # rows per optimiser step (EAGLE: whole sequences, about)
    clip_norm: float = 1.0
    warmup_frac: float = 0.05  # linear warmup, then cosine decay to 0
    ce_weight: float = 0.1  # EAGLE: token loss weight against the feature regression
    unroll_steps: int = 3  # EAGLE: draft steps trained (each later one on its own output)
    step_decay: float = 0.8  # EAGLE: step s's loss weight is step_decay ** (s - 1)
    noise: float = 0.05  # EAGLE: input features + U(-a, a), a = noise * the features' RMS
    head_decay: float = 0.8  # Medusa: head i's loss weight is head_decay ** i
    val_frac: float = 0.05
    bf16: bool = False  # autocast matmuls to bfloat16 (AMX: ~2x; weights stay float32)


@dataclass
class _Frozen:
    """The target's parts the heads reuse, in float32, and the label mapping."""

    embed: torch.Tensor  # [vocab_size, hidden_size]
    w_draft: torch.Tensor  # [V_d, hidden_size]: LM head rows of the draft vocabulary
    to_draft: torch.Tensor  # [vocab_size] int64: draft index, or _OOV


@dataclass
class _EagleRows:
    """EAGLE training rows of some sequences, concatenated: row t of a sequence of T tokens
    (t < T - 1) is the input (h_t, e(x_{t+1})) at position t."""

    base: torch.Tensor  # [M] the data row of h_t
    end: torch.Tensor  # [M] the sequence's end row
    gen: torch.Tensor  # [M] the sequence's first generated row
    positions: torch.Tensor  # [M]
    segments: list[tuple[int, int, int]]  # per sequence: (first row, rows, first unrolled)

    def unrolled(self) -> torch.Tensor:
        """[M'] the rows that draft steps >= 2 run on: each sequence's suffix from
        `first unrolled` (earlier rows have no generated label at any step)."""
        return torch.cat([torch.arange(a + lo, a + n) for a, n, lo in self.segments])


def _eagle_rows(data: DistillData, seqs: Sequence[int], num_steps: int) -> _EagleRows:
    base, end, gen, pos, segments, offset = [], [], [], [], [], 0
    for i in seqs:
        a, b, g = data.rows(i)
        n = b - a - 1
        base.append(torch.arange(a, b - 1))
        end.append(torch.full((n,), b))
        gen.append(torch.full((n,), g))
        pos.append(torch.arange(n))
        # Step s's label at row t is x_{t+s+1}: generated once t >= g - a - s - 1.
        lo = min(max(g - a - num_steps - 1, 0), n) if num_steps > 1 else n
        segments.append((offset, n, lo))
        offset += n
    cat = torch.cat
    return _EagleRows(cat(base), cat(end), cat(gen), cat(pos), segments)


def _eagle_step_io(
    data: DistillData, rows: _EagleRows, step: int, frozen: _Frozen, sel: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft step `step` (1-based) at rows `sel` (None: all): its input embedding
    e(x_{t+step}), regression target h_{t+step}, whether those exist, and its label
    x_{t+step+1} as a draft id (_IGNORE: absent or a prompt token; _OOV)."""
    base, end, gen = (rows.base, rows.end, rows.gen) if sel is None else (
        rows.base[sel], rows.end[sel], rows.gen[sel])  # fmt: skip
    idx = base + step
    valid = idx < end
    safe = torch.where(valid, idx, base)  # an in-range row where x_{t+step} does not exist
    embeds = frozen.embed[data.token_ids[safe]]
    target = data.features[safe]
    at = idx + 1
    has = (at < end) & (at >= gen)
    labels = torch.full(base.shape, _IGNORE, dtype=torch.int64)
    labels[has] = frozen.to_draft[data.token_ids[at[has]]]
    return embeds, target, valid, labels


def _step_attention(
    segments: Sequence[tuple[int, int, int]], store: list[torch.Tensor] | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    chain: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> heads.Attention:  # fmt: skip
    """The head's attention in training, as drafting runs it. Step 1 (`prefix` None): causal
    within each sequence, leaving its keys and values in `store`. Step s >= 2, on each
    sequence's unrolled suffix: the row of t (at position t + s - 1) attends to step 1's
    keys of positions 0..t (the true prefix), to its own chain's keys of steps 2..s-1
    (`chain`, rows as the queries') and to its own."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if store is not None:
            store[:] = [k, v]
        groups = q.shape[1] // k.shape[1]
        parts, off = [], 0
        for a, n, lo in segments:
            if prefix is None:
                parts.append(heads.causal_attention(q[a : a + n], k[a : a + n], v[a : a + n]))
                continue
            m = n - lo
            if m == 0:
                continue
            qs = q[off : off + m].transpose(0, 1)  # [heads, m, D]
            kp = prefix[0][a : a + n].repeat_interleave(groups, dim=1).transpose(0, 1)
            vp = prefix[1][a : a + n].repeat_interleave(groups, dim=1).transpose(0, 1)
            own = [*chain, (k, v)]
            kd = torch.stack([x[off : off + m] for x, _ in own], dim=2)  # [m, KV, s-1, D]
            vd = torch.stack([y[off : off + m] for _, y in own], dim=2)
            kd = kd.repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, m, s-1, D]
            vd = vd.repeat_interleave(groups, dim=1).transpose(0, 1)
            scale = q.shape[-1] ** -0.5
            sp = (qs @ kp.transpose(1, 2)) * scale  # [heads, m, n]
            allowed = torch.arange(n)[None, :] <= torch.arange(lo, n)[:, None]  # [m, n]
            sp = sp.masked_fill(~allowed, float("-inf"))
            sd = torch.einsum("hmd,hmsd->hms", qs, kd) * scale  # [heads, m, s-1]
            w = torch.softmax(torch.cat([sp, sd], dim=-1).float(), dim=-1).to(q.dtype)
            out = w[..., :n] @ vp + torch.einsum("hms,hmsd->hmd", w[..., n:], vd)
            parts.append(out.transpose(0, 1))  # [m, heads, D]
            off += m
        return torch.cat(parts)

    return attend


def _eagle_unroll(
    head: heads.EagleHead, data: DistillData, rows: _EagleRows, frozen: _Frozen,
    num_steps: int, noise: float = 0.0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Run `num_steps` draft steps as drafting does (step s >= 2 feeds back step s - 1's
    predicted feature with the true token x_{t+s}: the target accepted the drafts so far).
    Per step: (predicted features, regression targets, valid rows, labels); step 1 over
    every row, later steps over `rows.unrolled()`."""
    embeds, target, valid, labels = _eagle_step_io(data, rows, 1, frozen, None)
    h = data.target_features(rows.base) if head.fuse is not None else data.features[rows.base]
    if noise > 0:
        h = h + (torch.rand_like(h) * 2 - 1) * noise  # EAGLE: robustness to its own f
    h = head.project(h)
    kv1: list[torch.Tensor] = []
    f = head(h, embeds, rows.positions, _step_attention(rows.segments, store=kv1))
    out = [(f, target, valid, labels)]
    if num_steps < 2:
        return out
    sel = rows.unrolled()
    f, chain = f[sel], []
    for step in range(2, num_steps + 1):
        embeds, target, valid, labels = _eagle_step_io(data, rows, step, frozen, sel)
        kv: list[torch.Tensor] = []
        attend = _step_attention(rows.segments, kv, prefix=(kv1[0], kv1[1]), chain=chain)
        f = head(f, embeds, rows.positions[sel] + step - 1, attend)
        chain = [*chain, (kv[0], kv[1])]
        out.append((f, target, valid, labels))
    return out


def _eagle_loss(
    head: heads.EagleHead, data: DistillData, seqs: Sequence[int], frozen: _Frozen,
    settings: TrainSettings, feature_rms: float,
) -> torch.Tensor:  # fmt: skip
    """Sum over unrolled steps s of step_decay**(s-1) * (SmoothL1(f, h) + ce_weight * CE)."""
    rows = _eagle_rows(data, seqs, settings.unroll_steps)
    steps = _eagle_unroll(
        head, data, rows, frozen, settings.unroll_steps, settings.noise * feature_rms
    )
    loss = torch.zeros(())
    for s, (f, target, valid, labels) in enumerate(steps):
        part = torch.zeros(())
        if valid.any():
            part = part + F.smooth_l1_loss(f[valid].float(), target[valid])
        sel = labels >= 0
        if sel.any():
            logits = f[sel] @ frozen.w_draft.T  # [num_labels, V_d]
            part = part + settings.ce_weight * F.cross_entropy(logits.float(), labels[sel])
        loss = loss + settings.step_decay**s * part
    return loss


@torch.no_grad()
def _eagle_accuracy(
    head: heads.EagleHead,
    data: DistillData,
    seqs: Sequence[int],
    frozen: _Frozen,
    num_steps: int,
    batch_tokens: int = 8192,
) -> list[float]:
    """Top-1 accuracy of draft steps 1..num_steps over generated labels in `seqs` (step s
    fed the head's own features of the steps before it; the true tokens)."""
    hits, totals = [0] * num_steps, [0] * num_steps
    group: list[int] = []
    size = 0
    for n, i in enumerate(seqs):
        group.append(i)
        size += data.starts[i + 1] - data.starts[i]
        if size < batch_tokens and n + 1 < len(seqs):
            continue
        rows = _eagle_rows(data, group, num_steps)
        for s, (f, _, _, labels) in enumerate(_eagle_unroll(head, data, rows, frozen, num_steps)):
            sel = labels != _IGNORE  # an _OOV label is a miss
            pred = (f[sel] @ frozen.w_draft.T).argmax(-1)
            hits[s] += int((pred == labels[sel]).sum())
            totals[s] += int(sel.sum())
        group, size = [], 0
    return [h / max(t, 1) for h, t in zip(hits, totals)]


def _medusa_rows(
    data: DistillData, seqs: Sequence[int], k: int, frozen: _Frozen
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows t with at least one generated label among x_{t+2..t+1+k}: row ids [M] and
    labels [k, M] (draft ids; _IGNORE: absent or a prompt token; _OOV)."""
    rows, labels = [], []
    for i in seqs:
        a, b, g = data.rows(i)
        lo, hi = max(a, g - 1 - k), b - 2  # rows [lo, hi)
        if hi <= lo:
            continue
        r = torch.arange(lo, hi)  # [m]
        lab = torch.full((k, hi - lo), _IGNORE, dtype=torch.int64)  # [k, m]
        for j in range(k):
            src = r + 2 + j
            ok = (src < b) & (src >= g)
            lab[j, ok] = frozen.to_draft[data.token_ids[src[ok]]]
        rows.append(r)
        labels.append(lab)
    if not rows:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(k, 0, dtype=torch.int64)
    return torch.cat(rows), torch.cat(labels, dim=1)


def _medusa_loss(
    head: heads.MedusaHeads, data: DistillData, rows: torch.Tensor, labels: torch.Tensor,
    frozen: _Frozen, settings: TrainSettings,
) -> torch.Tensor:  # fmt: skip
    z = head(data.features[rows], frozen.embed[data.token_ids[rows + 1]])  # [k, B, H]
    loss = z.new_zeros(())
    for j in range(z.shape[0]):
        sel = labels[j] >= 0
        if sel.any():
            logits = z[j, sel] @ frozen.w_draft.T  # [num_labels, V_d]
            ce = F.cross_entropy(logits.float(), labels[j, sel])
            loss = loss + settings.head_decay**j * ce
    return loss


@torch.no_grad()
def _medusa_accuracy(
    head: heads.MedusaHeads, data: DistillData, rows: torch.Tensor, labels: torch.Tensor,
    frozen: _Frozen,
) -> list[float]:  # fmt: skip
    """Top-1 accuracy of each head over its generated labels (out of vocab: a miss)."""
    z = head(data.features[rows], frozen.embed[data.token_ids[rows + 1]])  # [k, M, H]
    acc = []
    for j in range(z.shape[0]):
        sel = labels[j] != _IGNORE  # every generated label; an _OOV one is never predicted
        pred = (z[j, sel] @ frozen.w_draft.T).argmax(-1)
        acc.append(int((pred == labels[j, sel]).sum()) / max(int(sel.sum()), 1))
    return acc


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def train_heads(
    method: str, config: heads.HeadConfig, data: DistillData,
    frozen_parts: tuple[torch.Tensor, torch.Tensor], draft_vocab: torch.Tensor,
    train_seqs: Sequence[int], val_seqs: Sequence[int], settings: TrainSettings,
    log: Callable[[str], Any] = print,
) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """Train a fresh head on `train_seqs`; `frozen_parts` = (embedding [V, H], LM head
    [V, H]) of the target. Returns the head (eval mode) and per-epoch metrics."""
    embed, lm_head = frozen_parts
    if method == "eagle" and config.aux_layers and data.aux_layers != config.aux_layers:
        raise ValueError(
            f"the head fuses layers {config.aux_layers}; the data has {data.aux_layers}"
        )
    to_draft = torch.full((config.vocab_size,), _OOV, dtype=torch.int64)  # [vocab]
    to_draft[draft_vocab] = torch.arange(len(draft_vocab))
    frozen = _Frozen(embed.float(), lm_head[draft_vocab].float(), to_draft)
    torch.manual_seed(settings.seed)
    head: nn.Module = (heads.EagleHead if method == "eagle" else heads.MedusaHeads)(config)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    feature_rms = float(data.features.pow(2).mean().sqrt())

    # Every epoch's batches up front, so the LR schedule knows the step count.
    epochs: list[list[Any]] = []
    if method == "eagle":
        for _ in range(settings.epochs):
            order = [train_seqs[j] for j in torch.randperm(len(train_seqs), generator=gen)]
            batches, cur, size = [], [], 0
            for i in order:
                cur.append(i)
                size += data.starts[i + 1] - data.starts[i] - 1
                if size >= settings.batch_tokens:
                    batches.append(cur)
                    cur, size = [], 0
            epochs.append(batches + ([cur] if cur else []))
    else:
        k = config.num_medusa_heads
        rows, labels = _medusa_rows(data, train_seqs, k, frozen)
        val_rows, val_labels = _medusa_rows(data, val_seqs, k, frozen)
        for _ in range(settings.epochs):
            perm = torch.randperm(len(rows), generator=gen)
            epochs.append(list(perm.split(settings.batch_tokens)))
    total = sum(len(b) for b in epochs)
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    warmup = max(1, int(settings.warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, total, warmup))

    history = []
    for epoch, batches in enumerate(epochs):
        start, loss_sum = time.perf_counter(), 0.0
        head.train()
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
                if method == "eagle":
                    loss = _eagle_loss(head, data, batch, frozen, settings, feature_rms)
                else:
                    loss = _medusa_loss(head, data, rows[batch], labels[:, batch], frozen, settings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), settings.clip_norm)
            opt.step()
            sched.step()
            loss_sum += float(loss.detach())
        train_s = time.perf_counter() - start
        head.eval()
        if method == "eagle":
            acc = _eagle_accuracy(head, data, val_seqs, frozen, max(settings.unroll_steps, 2))
        else:
            acc = _medusa_accuracy(head, data, val_rows, val_labels, frozen)
        loss_avg, acc = loss_sum / max(len(batches), 1), [round(x, 4) for x in acc]
        history.append(
            {"epoch": epoch + 1, "loss": loss_avg, "val_acc": acc, "train_s": round(train_s, 2)}
        )
        log(f"epoch {epoch + 1}/{settings.epochs}: loss {loss_avg:.4f}, val top-1 {acc} "
            f"({train_s:.1f} s)")  # fmt: skip
    head.eval().requires_grad_(False)
    return head, {"history": history, "val_acc": history[-1]["val_acc"] if history else []}


def _head_config(
    method: str, arch: Any, draft_vocab_size: int, k: int, target: str,
    aux_layers: Sequence[int] = (),
) -> heads.HeadConfig:  # fmt: skip
    same = ["hidden_size", "vocab_size", "head_dim", "intermediate_size", "rms_norm_eps"]
    return heads.HeadConfig(
        method=method, draft_vocab_size=draft_vocab_size, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads, rope_theta=arch.rope_theta,
        num_medusa_heads=k if method == "medusa" else 0, target=target,
        medusa_intermediate_size=2 * arch.hidden_size if method == "medusa" else 0,
        aux_layers=list(aux_layers) if method == "eagle" else [],
        **{name: getattr(arch, name) for name in same},
    )  # fmt: skip


def target_name(model: str | None) -> str:
    """A stable name for the target: the GGUF file's (or model directory's) basename."""
    if model is None:
        from pagedinfer.gguf_metadata import find_default_model

        model = find_default_model()
    return os.path.basename(os.path.normpath(model))


def train_draft(
    method: str, *, out: str, model: str | None = None, dtype: str = "float32",
    num_prompts: int = HOLDOUT_START, max_tokens: int = 192, draft_vocab_size: int = 8192,
    num_medusa_heads: int = 5, epochs: int | None = None, lr: float | None = None,
    seed: int = 0, data_path: str | None = None, data_cache: str | None = None,
    log: Callable[[str], Any] = print, prompts: Sequence[list[int]] | None = None,
    settings: dict[str, Any] | None = None, llm_kwargs: dict[str, Any] | None = None,
    all_turns: bool = False, train_dtype: str = "auto", aux_layers: Sequence[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Self-distil a draft head for `model` (None: the default GGUF) and save it to `out`.

    `data_path`: the ShareGPT JSON (default: `default_sharegpt_path()`); `data_cache`: a
    file for the generated sequences and their features, written on the first run and read
    by later ones with the same model, dtype, prompts and max_tokens (so EAGLE and Medusa,
    or several learning rates, share one generation); `prompts`: token-id prompts used
    instead of ShareGPT (tests); `settings`: `TrainSettings` overrides (ce_weight, noise,
    bf16...); `llm_kwargs`: extra engine options; `train_dtype`: "bfloat16" autocasts the
    heads' matmuls (AMX: ~2x), "auto" does where the CPU has native bf16. `epochs` / `lr`
    default to the method's `DEFAULT_EPOCHS` / `DEFAULT_LR`; `aux_layers` (EAGLE): target
    layers whose residual streams are fused with h_t into the first step's feature, as
    EAGLE-3 does (None or empty: h_t alone). Returns the training record stored in the
    file.
    """
    from pagedinfer.entrypoints.llm import LLM

    if method not in DEFAULT_EPOCHS:
        raise ValueError(f"method must be 'eagle' or 'medusa', got {method!r}")
    if aux_layers is not None and aux_layers and method != "eagle":
        raise ValueError("aux_layers: only EAGLE heads fuse earlier layers' features")
    args = {
        "method": method, "model": model, "dtype": dtype, "num_prompts": num_prompts,
        "max_tokens": max_tokens, "draft_vocab_size": draft_vocab_size,
        "num_medusa_heads": num_medusa_heads, "all_turns": all_turns, "train_dtype": train_dtype,
        "aux_layers": None if aux_layers is None else list(aux_layers),
        "epochs": epochs or DEFAULT_EPOCHS[method],
        "lr": lr or DEFAULT_LR[method], "seed": seed,
    }  # fmt: skip
    from pagedinfer.worker.worker import resolve_dtype

    settings = {"bf16": resolve_dtype(train_dtype) == torch.bfloat16, **(settings or {})}
    ts = TrainSettings(epochs=args["epochs"], lr=args["lr"], seed=seed, **settings)
    times: dict[str, float] = {}
    torch.manual_seed(seed)

    t = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, seed=seed, **(llm_kwargs or {}))
    if prompts is None:
        prompts = chat_prompts(
            llm.get_tokenizer(), load_training_prompts(num_prompts, data_path, all_turns)
        )
    worker = llm.llm_engine.engine_core.executor.worker
    arch, name = worker.arch, target_name(model)
    if method == "medusa":
        aux_layers = []
    elif aux_layers is None:
        aux_layers = []  # fused features measured no gain on the default model (see README)
    aux_layers = sorted(set(aux_layers))
    if not all(0 <= i < arch.num_hidden_layers - 1 for i in aux_layers):
        llm.llm_engine.engine_core.shutdown()
        raise ValueError(
            f"aux_layers {aux_layers}: layers are 0-based and the last one "
            f"({arch.num_hidden_layers - 1}) is h_t already"
        )
    target = worker.model  # embedding and LM head, [vocab, H] each:
    frozen_parts = (
        target.embed_tokens.weight.float().clone(),
        target.lm_head_weight.float().clone(),
    )
    times["load_s"] = time.perf_counter() - t
    digest = hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16]
    key = {"target": name, "dtype": dtype, "max_tokens": max_tokens, "prompts": digest}
    if data_cache is not None and os.path.exists(data_cache):
        data = load_distill_data(data_cache, key)
        log(f"read {data.num_seqs} sequences and their features from {data_cache}")
        if aux_layers and data.aux_layers != aux_layers:
            # The sequences stay; only the forward passes run again, keeping the aux.
            t = time.perf_counter()
            data = compute_features(llm, data.sequences(), aux_layers)
            times["features_s"] = time.perf_counter() - t
            log(f"features with layers {aux_layers} in {times['features_s']:.1f} s")
            save_distill_data(data_cache, data, key)
    else:
        log(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; generating...")
        t = time.perf_counter()
        sequences = generate_sequences(llm, prompts, max_tokens)
        times["generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        data = compute_features(llm, sequences, aux_layers)
        times["features_s"] = time.perf_counter() - t
        log(f"generated in {times['generate_s']:.1f} s; features of {len(data.token_ids)} "
            f"positions in {times['features_s']:.1f} s")  # fmt: skip
        if data_cache is not None:
            save_distill_data(data_cache, data, key)
    llm.llm_engine.engine_core.shutdown()
    del llm, worker, target  # the engine's KV cache and weights are no longer needed

    train_seqs, val_seqs = split_sequences(data.num_seqs, ts.val_frac, seed)
    draft_vocab = build_draft_vocab(
        data, train_seqs, draft_vocab_size, arch.eos_token_ids, arch.vocab_size
    )
    config = _head_config(method, arch, draft_vocab_size, num_medusa_heads, name, aux_layers)
    if not aux_layers:
        data.aux = None  # a cache made for a fused head also serves a plain one
    t = time.perf_counter()
    head, metrics = train_heads(
        method, config, data, frozen_parts, draft_vocab, train_seqs, val_seqs, ts, log
    )
    times["train_s"] = time.perf_counter() - t

    val_generated = torch.cat([data.token_ids[data.rows(i)[2] : data.rows(i)[1]] for i in val_seqs])
    coverage = float(torch.isin(val_generated, draft_vocab).float().mean())
    extra = {
        "args": args,
        "settings": asdict(ts),
        "num_sequences": data.num_seqs,
        "num_val_sequences": len(val_seqs),
        "num_positions": len(data.token_ids),
        "num_generated_tokens": len(data.token_ids) - sum(data.num_prompt_tokens),
        "val_draft_vocab_coverage": round(coverage, 4),
        "times_s": {k: round(v, 2) for k, v in times.items()},
        **metrics,
    }
    # bf16 halves the file (the shipped heads are committed). Drafting runs the head in the
    # target's dtype, so a bf16 engine (the default on CPUs with native bf16) drafts exactly
    # as it would from float32 weights.
    heads.save_heads(out, head.to(torch.bfloat16), config, draft_vocab, extra)
    log(f"saved {out} ({os.path.getsize(out) / 2**20:.1f} MiB); val top-1 {metrics['val_acc']}")
    return extra
