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
     position + `ce_weight` * CE(f_{t+1} W_d^T, x_{t+2}). Batches concatenate sequences
     (about `batch_tokens` rows); attention stays causal within each sequence.
   - Medusa: head i (0-based) on h_t predicts x_{t+2+i}; loss sum_i `head_decay`**i CE_i,
     over batches of random positions.
   Validation: a seeded 5% of the training prompts; top-1 accuracy over generated labels (one
   outside the draft vocabulary is a miss). EAGLE reports step 1 (true features in) and
   step 2 (its own f_{t+1} fed back with x_{t+2} over the true prefix, as drafting runs).
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
from dataclasses import asdict, dataclass
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

DEFAULT_EPOCHS = {"eagle": 10, "medusa": 5}
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

    @property
    def num_seqs(self) -> int:
        return len(self.num_prompt_tokens)

    def rows(self, i: int) -> tuple[int, int, int]:
        """(first row, end row, first generated row) of sequence i."""
        a = self.starts[i]
        return a, self.starts[i + 1], a + self.num_prompt_tokens[i]


@torch.no_grad()
def compute_features(llm: LLM, sequences: Sequence[tuple[list[int], int]]) -> DistillData:
    """The target's features for every position of every sequence, one sequence per paged
    forward (a temporary KV cache; the engine's own cache is not touched)."""
    from pagedinfer.attention.backend import ForwardContext, set_forward_context
    from pagedinfer.worker.model_runner import make_attention_metadata

    worker = llm.llm_engine.engine_core.executor.worker
    model, backend, arch = worker.model, worker.backend, worker.arch
    bs = worker.config.cache_config.block_size
    lengths = [len(ids) for ids, _ in sequences]
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    features = torch.empty(starts[-1], arch.hidden_size)  # [num_rows, hidden_size] float32
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
        with set_forward_context(ctx):
            hidden = model(torch.tensor(ids, dtype=torch.int64), torch.from_numpy(positions))
        features[a : a + n] = hidden.float()  # [n, hidden_size]
    token_ids = torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.int64)
    return DistillData(token_ids, features, starts, [p for _, p in sequences])


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
    save_file(tensors, path, metadata={"key": json.dumps(key, sort_keys=True)})


def load_distill_data(path: str, key: dict[str, Any]) -> DistillData:
    """Read `save_distill_data`'s file; ValueError if it was made for another `key`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        found = json.loads((f.metadata() or {}).get("key", "{}"))
        if found != json.loads(json.dumps(key)):
            raise ValueError(f"{path} holds data for {found}, not {key}: delete it or rename")
        t = {name: f.get_tensor(name) for name in f.keys()}
    return DistillData(
        t["token_ids"], t["features"], t["starts"].tolist(), t["num_prompt_tokens"].tolist()
    )


@dataclass
class TrainSettings:
    epochs: int
    lr: float
    seed: int = 0
    batch_tokens: int = 2048  # rows per optimiser step (EAGLE: whole sequences, about)
    clip_norm: float = 1.0
    warmup_frac: float = 0.05  # linear warmup, then cosine decay to 0
    ce_weight: float = 0.1  # EAGLE: token loss weight against the feature regression
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


def _segment_attention(lengths: Sequence[int]) -> heads.Attention:
    """Causal attention within each of consecutive sequences of `lengths` rows."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spans = zip(bounds, bounds[1:])
        parts = [heads.causal_attention(q[a:b], k[a:b], v[a:b]) for a, b in spans]
        return torch.cat(parts)  # [T, heads, head_dim]

    return attend


def _eagle_inputs(
    data: DistillData, seqs: Sequence[int], frozen: _Frozen
) -> tuple[torch.Tensor, ...]:
    """Concatenated EAGLE rows of `seqs` (row t of a sequence of T tokens, t < T - 1):
    features h_t [M, H], next embeds e(x_{t+1}) [M, H], positions [M], targets h_{t+1}
    [M, H], labels x_{t+2} as draft ids [M] (_IGNORE: absent or a prompt token; _OOV),
    and the per-sequence row counts."""
    h, e, pos, tgt, lab, lengths = [], [], [], [], [], []
    for i in seqs:
        a, b, g = data.rows(i)
        n = b - a - 1
        h.append(data.features[a : b - 1])
        tgt.append(data.features[a + 1 : b])
        e.append(frozen.embed[data.token_ids[a + 1 : b]])
        pos.append(torch.arange(n))
        labels = torch.full((n,), _IGNORE, dtype=torch.int64)  # [n]
        first = max(g - a - 2, 0)  # row t's label is token t + 2: generated from row g-a-2
        labels[first : n - 1] = frozen.to_draft[data.token_ids[a + first + 2 : b]]
        lab.append(labels)
        lengths.append(n)
    cat = torch.cat
    return cat(h), cat(e), cat(pos), cat(tgt), cat(lab), lengths  # type: ignore[return-value]


def _eagle_loss(
    head: heads.EagleHead, data: DistillData, seqs: Sequence[int], frozen: _Frozen,
    settings: TrainSettings, feature_rms: float,
) -> torch.Tensor:  # fmt: skip
    h, e, pos, tgt, labels, lengths = _eagle_inputs(data, seqs, frozen)
    a = settings.noise * feature_rms
    h = h + (torch.rand_like(h) * 2 - 1) * a  # EAGLE: robustness to its own fed-back f
    f = head(h, e, pos, _segment_attention(lengths))  # [M, H]
    loss = F.smooth_l1_loss(f.float(), tgt)
    sel = labels >= 0
    if sel.any():
        logits = f[sel] @ frozen.w_draft.T  # [num_labels, V_d]
        loss = loss + settings.ce_weight * F.cross_entropy(logits.float(), labels[sel])
    return loss


def _capturing_attention(store: list[torch.Tensor]) -> heads.Attention:
    """Causal attention over one sequence that leaves its keys and values in `store`."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store[:] = [k, v]
        return heads.causal_attention(q, k, v)

    return attend


def _prefix_attention(k1: torch.Tensor, v1: torch.Tensor) -> heads.Attention:
    """EAGLE's second draft step for all rows at once: row i (at position i + 1) attends to
    step-1 keys/values of rows 0..i (the true prefix) and to its own key/value."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, groups = q.shape[0], q.shape[1] // k.shape[1]
        keys = torch.cat([k1[:m], k]).repeat_interleave(groups, dim=1)  # [2M, heads, D]
        values = torch.cat([v1[:m], v]).repeat_interleave(groups, dim=1)
        eye = torch.eye(m, dtype=torch.bool)
        mask = torch.cat([torch.ones(m, m, dtype=torch.bool).tril(), eye], dim=1)  # [M, 2M]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
        )  # [heads, M, D]
        return out.transpose(0, 1)

    return attend


@torch.no_grad()
def _eagle_accuracy(
    head: heads.EagleHead, data: DistillData, seqs: Sequence[int], frozen: _Frozen
) -> list[float]:
    """Top-1 accuracy of draft steps 1 and 2 over generated labels in `seqs`."""
    hits, totals = [0, 0], [0, 0]
    for i in seqs:
        a, b, g = data.rows(i)
        if b - a < 3:
            continue
        h, e, pos, _, labels, _ = _eagle_inputs(data, [i], frozen)
        kv: list[torch.Tensor] = []
        f1 = head(h, e, pos, _capturing_attention(kv))  # [n, H]: f_{t+1}
        # Step 2: (f_{t+1}, e(x_{t+2})) at position t + 1 predicts x_{t+3}.
        f2 = head(f1[:-1], e[1:], pos[:-1] + 1, _prefix_attention(*kv))  # [n - 1, H]
        for step, (f, lab) in enumerate(((f1, labels), (f2, labels[1:]))):
            first = max(g - a - 2 - step, 0)  # rows whose label was generated
            f, lab = f[first : len(lab) - 1], lab[first : len(lab) - 1]
            pred = (f @ frozen.w_draft.T).argmax(-1)
            hits[step] += int((pred == lab).sum())
            totals[step] += len(lab)
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
    z = head(data.features[rows])  # [k, B, H]
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
    z = head(data.features[rows])  # [k, M, H]
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
            acc = _eagle_accuracy(head, data, val_seqs, frozen)
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
    method: str, arch: Any, draft_vocab_size: int, k: int, target: str
) -> heads.HeadConfig:
    same = ["hidden_size", "vocab_size", "head_dim", "intermediate_size", "rms_norm_eps"]
    return heads.HeadConfig(
        method=method, draft_vocab_size=draft_vocab_size, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads, rope_theta=arch.rope_theta,
        num_medusa_heads=k if method == "medusa" else 0, target=target,
        **{name: getattr(arch, name) for name in same},
    )  # fmt: skip


def target_name(model: str | None) -> str:
    """A stable name for the target: the GGUF file's (or model directory's) basename."""
    if model is None:
        from pagedinfer.model.gguf import find_default_model

        model = find_default_model()
    return os.path.basename(os.path.normpath(model))


def train_draft(
    method: str, *, out: str, model: str | None = None, dtype: str = "float32",
    num_prompts: int = HOLDOUT_START, max_tokens: int = 192, draft_vocab_size: int = 8192,
    num_medusa_heads: int = 3, epochs: int | None = None, lr: float | None = None,
    seed: int = 0, data_path: str | None = None, data_cache: str | None = None,
    log: Callable[[str], Any] = print, prompts: Sequence[list[int]] | None = None,
    settings: dict[str, Any] | None = None, llm_kwargs: dict[str, Any] | None = None,
    all_turns: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Self-distil a draft head for `model` (None: the default GGUF) and save it to `out`.

    `data_path`: the ShareGPT JSON (default: `default_sharegpt_path()`); `data_cache`: a
    file for the generated sequences and their features, written on the first run and read
    by later ones with the same model, dtype, prompts and max_tokens (so EAGLE and Medusa,
    or several learning rates, share one generation); `prompts`: token-id prompts used
    instead of ShareGPT (tests); `settings`: `TrainSettings` overrides (ce_weight, noise,
    bf16...); `llm_kwargs`: extra engine options. `epochs` / `lr` default to the method's
    `DEFAULT_EPOCHS` / `DEFAULT_LR`. Returns the training record stored in the file.
    """
    from pagedinfer.entrypoints.llm import LLM

    if method not in DEFAULT_EPOCHS:
        raise ValueError(f"method must be 'eagle' or 'medusa', got {method!r}")
    args = {
        "method": method, "model": model, "dtype": dtype, "num_prompts": num_prompts,
        "max_tokens": max_tokens, "draft_vocab_size": draft_vocab_size,
        "num_medusa_heads": num_medusa_heads, "all_turns": all_turns,
        "epochs": epochs or DEFAULT_EPOCHS[method],
        "lr": lr or DEFAULT_LR[method], "seed": seed,
    }  # fmt: skip
    ts = TrainSettings(epochs=args["epochs"], lr=args["lr"], seed=seed, **(settings or {}))
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
    else:
        log(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; generating...")
        t = time.perf_counter()
        sequences = generate_sequences(llm, prompts, max_tokens)
        times["generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        data = compute_features(llm, sequences)
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
    config = _head_config(method, arch, draft_vocab_size, num_medusa_heads, name)
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
    heads.save_heads(out, head, config, draft_vocab, extra)
    log(f"saved {out} ({os.path.getsize(out) / 2**20:.1f} MiB); val top-1 {metrics['val_acc']}")
    return extra
