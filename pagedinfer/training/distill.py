"""Distillation data for draft-head training: prompts, the target's greedy continuations and
its features at every position (stages 1-3 of `draft_heads.train_draft`).

- Prompts: turn 0 of ShareGPT rows [0, num_prompts) in file order, in the target's chat
  template, cut to `MAX_PROMPT_TOKENS`. Rows >= `HOLDOUT_START` are the held-out evaluation
  set: nothing here reads them (`training_prompt_indices` asserts it).
- Sequences: the target continues every prompt greedily (one batched `LLM.generate`): with
  greedy verification a draft is accepted exactly when it equals the target's argmax.
- Features: the target's own paged forward over each whole sequence (a private KV cache,
  the worker's backend) gives h_t, the LM head's input, at every position (float32).
  `save_distill_data` / `load_distill_data` keep them in a file for later runs.
- `build_draft_vocab` and `split_sequences`: the label vocabulary and the validation split.

An offline tool: it drives the whole engine, whose parts it imports lazily; the runtime never
imports this package. Callers: `draft_heads.train_draft`, the trained-heads tests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedinfer.entrypoints.llm import LLM

__all__ = [
    "HOLDOUT_START", "MAX_PROMPT_TOKENS", "DistillData", "build_draft_vocab", "chat_prompts",
    "compute_features", "generate_sequences", "load_distill_data", "load_training_prompts",
    "save_distill_data", "split_sequences", "training_prompt_indices",
]  # fmt: skip

HOLDOUT_START = 800
"""ShareGPT rows with this index or higher are the held-out evaluation set."""
MAX_PROMPT_TOKENS = 512
_KEEP_TAIL = 16  # a cut prompt keeps its last tokens: the template's assistant turn start


def training_prompt_indices(num_prompts: int) -> list[int]:
    """ShareGPT row indices used for training: [0, num_prompts), never a held-out row."""
    if not 0 < num_prompts <= HOLDOUT_START:
        raise ValueError(f"num_prompts must be in [1, {HOLDOUT_START}], got {num_prompts}")
    indices = list(range(num_prompts))
    assert max(indices) < HOLDOUT_START, "held-out rows must never be trained on"
    return indices


def load_training_prompts(
    num_prompts: int, dataset_path: str | None = None, all_turns: bool = False
) -> list[str]:
    """Turn-0 texts of the training rows (rows without a string turn 0 are skipped); with
    `all_turns`, every user turn of those rows, each as a prompt of its own (about 3.6x the
    prompts: more text for the heads from the same rows). `dataset_path`: the ShareGPT JSON
    (default: `bench.datasets.default_sharegpt_path()` where it exists, else a ValueError)."""
    from pagedinfer.bench.datasets import resolve_dataset_path

    with open(resolve_dataset_path(dataset_path, "`dataset_path`"), encoding="utf-8") as f:
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
