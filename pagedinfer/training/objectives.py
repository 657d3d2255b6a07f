"""The training objectives of the draft heads: the rows each head learns from, its loss and
its validation accuracy (stage 4 of `draft_heads.train_draft`, which runs the optimiser).

- EAGLE: (h_t + noise, e(x_{t+1})) -> f_{t+1}; loss SmoothL1(f_{t+1}, h_{t+1}) at every
  position + `ce_weight` * CE(f_{t+1} W_d^T, x_{t+2}). Then `unroll_steps` - 1 more draft
  steps as drafting runs them ("training-time test", as EAGLE-3): step s feeds back the
  head's own f with the true x_{t+s}, attends to step 1's keys of the true prefix and its
  own chain's, and adds the same loss (weight `step_decay`**(s-1)) against h_{t+s} and
  x_{t+s+1}; only rows with a generated label at some step run them. Without it the head
  never sees its own features, and step 2 and 3 accuracy collapses. Batches concatenate
  sequences (about `batch_tokens` rows); attention stays within a sequence.
- Medusa: (h_t, e(x_{t+1})) -> head i (0-based) predicts x_{t+2+i}; loss
  sum_i `head_decay`**i CE_i, over batches of random positions.

Labels are draft-vocabulary ids; cross-entropy counts only generated labels, and a generated
token outside the draft vocabulary (`OOV_LABEL`) is a miss in the accuracies.
Callers: `draft_heads.train_heads`, tests/unit/training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedinfer.spec_decode import heads

if TYPE_CHECKING:
    from pagedinfer.training.distill import DistillData

__all__ = [
    "IGNORE_LABEL", "OOV_LABEL", "EagleRows", "FrozenTarget", "TrainSettings", "eagle_accuracy",
    "eagle_loss", "eagle_rows", "medusa_accuracy", "medusa_loss", "medusa_rows",
    "step_attention",
]  # fmt: skip

# Label values besides draft ids: no label (past the end, or a prompt token), and a
# generated token outside the draft vocabulary (not trained on; a miss in the accuracies).
IGNORE_LABEL = -100
OOV_LABEL = -1


@dataclass
class TrainSettings:
    """The optimiser's and the objectives' settings of one training run."""

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
class FrozenTarget:
    """The target's parts the heads reuse, in float32, and the label mapping."""

    embed: torch.Tensor  # [vocab_size, hidden_size]
    w_draft: torch.Tensor  # [V_d, hidden_size]: LM head rows of the draft vocabulary
    to_draft: torch.Tensor  # [vocab_size] int64: draft index, or OOV_LABEL


@dataclass
class EagleRows:
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


def eagle_rows(data: DistillData, seqs: Sequence[int], num_steps: int) -> EagleRows:
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
    return EagleRows(cat(base), cat(end), cat(gen), cat(pos), segments)


def _eagle_step_io(
    data: DistillData, rows: EagleRows, step: int, frozen: FrozenTarget, sel: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft step `step` (1-based) at rows `sel` (None: all): its input embedding
    e(x_{t+step}), regression target h_{t+step}, whether those exist, and its label
    x_{t+step+1} as a draft id (IGNORE_LABEL: absent or a prompt token; OOV_LABEL)."""
    base, end, gen = (rows.base, rows.end, rows.gen) if sel is None else (
        rows.base[sel], rows.end[sel], rows.gen[sel])  # fmt: skip
    idx = base + step
    valid = idx < end
    safe = torch.where(valid, idx, base)  # an in-range row where x_{t+step} does not exist
    embeds = frozen.embed[data.token_ids[safe]]
    target = data.features[safe]
    at = idx + 1
    has = (at < end) & (at >= gen)
    labels = torch.full(base.shape, IGNORE_LABEL, dtype=torch.int64)
    labels[has] = frozen.to_draft[data.token_ids[at[has]]]
    return embeds, target, valid, labels


def step_attention(
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
    head: heads.EagleHead, data: DistillData, rows: EagleRows, frozen: FrozenTarget,
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
    f = head(h, embeds, rows.positions, step_attention(rows.segments, store=kv1))
    out = [(f, target, valid, labels)]
    if num_steps < 2:
        return out
    sel = rows.unrolled()
    f, chain = f[sel], []
    for step in range(2, num_steps + 1):
        embeds, target, valid, labels = _eagle_step_io(data, rows, step, frozen, sel)
        kv: list[torch.Tensor] = []
        attend = step_attention(rows.segments, kv, prefix=(kv1[0], kv1[1]), chain=chain)
        f = head(f, embeds, rows.positions[sel] + step - 1, attend)
        chain = [*chain, (kv[0], kv[1])]
        out.append((f, target, valid, labels))
    return out


def eagle_loss(
    head: heads.EagleHead, data: DistillData, seqs: Sequence[int], frozen: FrozenTarget,
    settings: TrainSettings, feature_rms: float,
) -> torch.Tensor:  # fmt: skip
    """Sum over unrolled steps s of step_decay**(s-1) * (SmoothL1(f, h) + ce_weight * CE)."""
    rows = eagle_rows(data, seqs, settings.unroll_steps)
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
def eagle_accuracy(
    head: heads.EagleHead,
    data: DistillData,
    seqs: Sequence[int],
    frozen: FrozenTarget,
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
        rows = eagle_rows(data, group, num_steps)
        for s, (f, _, _, labels) in enumerate(_eagle_unroll(head, data, rows, frozen, num_steps)):
            sel = labels != IGNORE_LABEL  # an OOV_LABEL label is a miss
            pred = (f[sel] @ frozen.w_draft.T).argmax(-1)
            hits[s] += int((pred == labels[sel]).sum())
            totals[s] += int(sel.sum())
        group, size = [], 0
    return [h / max(t, 1) for h, t in zip(hits, totals)]


def medusa_rows(
    data: DistillData, seqs: Sequence[int], k: int, frozen: FrozenTarget
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows t with at least one generated label among x_{t+2..t+1+k}: row ids [M] and
    labels [k, M] (draft ids; IGNORE_LABEL: absent or a prompt token; OOV_LABEL)."""
    rows, labels = [], []
    for i in seqs:
        a, b, g = data.rows(i)
        lo, hi = max(a, g - 1 - k), b - 2  # rows [lo, hi)
        if hi <= lo:
            continue
        r = torch.arange(lo, hi)  # [m]
        lab = torch.full((k, hi - lo), IGNORE_LABEL, dtype=torch.int64)  # [k, m]
        for j in range(k):
            src = r + 2 + j
            ok = (src < b) & (src >= g)
            lab[j, ok] = frozen.to_draft[data.token_ids[src[ok]]]
        rows.append(r)
        labels.append(lab)
    if not rows:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(k, 0, dtype=torch.int64)
    return torch.cat(rows), torch.cat(labels, dim=1)


def medusa_loss(
    head: heads.MedusaHeads, data: DistillData, rows: torch.Tensor, labels: torch.Tensor,
    frozen: FrozenTarget, settings: TrainSettings,
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
def medusa_accuracy(
    head: heads.MedusaHeads, data: DistillData, rows: torch.Tensor, labels: torch.Tensor,
    frozen: FrozenTarget,
) -> list[float]:  # fmt: skip
    """Top-1 accuracy of each head over its generated labels (out of vocab: a miss)."""
    z = head(data.features[rows], frozen.embed[data.token_ids[rows + 1]])  # [k, M, H]
    acc = []
    for j in range(z.shape[0]):
        sel = labels[j] != IGNORE_LABEL  # every generated label; an OOV one is never predicted
        pred = (z[j, sel] @ frozen.w_draft.T).argmax(-1)
        acc.append(int((pred == labels[j, sel]).sum()) / max(int(sel.sum()), 1))
    return acc
