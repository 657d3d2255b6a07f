"""Training of EAGLE and Medusa draft heads by self-distillation (`pagedinfer train-draft`).

Pipeline (`train_draft`), every stage deterministic given the seed:
1. Data (`distill`): turn 0 of ShareGPT rows [0, num_prompts) in the target's chat template;
   rows >= `HOLDOUT_START` are held out for evaluation.
2. The target continues every prompt greedily (one batched `LLM.generate`).
3. Features: h_t, the LM head's input, at every position of every sequence (`distill`);
   `data_cache` keeps 2-3 in a file for later runs.
4. Training on CPU (`train_heads`): AdamW (no weight decay), clipping, warmup then cosine
   decay, over the objectives of `objectives` (EAGLE with training-time unrolling, Medusa).
   Validation: a seeded 5% of the training prompts; top-1 accuracy over generated labels, per
   Medusa head, and per EAGLE draft step.
5. `heads.save_heads` writes the head, its config, the draft vocabulary and the run's record.

An offline tool driving the whole engine: it imports `LLM` and the worker's helpers lazily,
and the runtime never imports it. Caller: `pagedinfer train-draft` (entrypoints/cli.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedinfer.spec_decode import heads
from pagedinfer.training.distill import (
    HOLDOUT_START,
    DistillData,
    build_draft_vocab,
    chat_prompts,
    compute_features,
    generate_sequences,
    load_distill_data,
    load_training_prompts,
    save_distill_data,
    split_sequences,
)
from pagedinfer.training.objectives import (
    OOV_LABEL,
    FrozenTarget,
    TrainSettings,
    eagle_accuracy,
    eagle_loss,
    medusa_accuracy,
    medusa_loss,
    medusa_rows,
)

if TYPE_CHECKING:
    from pagedinfer.entrypoints.llm import LLM

__all__ = ["DEFAULT_EPOCHS", "DEFAULT_LR", "target_name", "train_draft", "train_heads"]

DEFAULT_EPOCHS = {"eagle": 4, "medusa": 3}
DEFAULT_LR = {"eagle": 1e-3, "medusa": 2e-3}


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
    to_draft = torch.full((config.vocab_size,), OOV_LABEL, dtype=torch.int64)  # [vocab]
    to_draft[draft_vocab] = torch.arange(len(draft_vocab))
    frozen = FrozenTarget(embed.float(), lm_head[draft_vocab].float(), to_draft)
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
        rows, labels = medusa_rows(data, train_seqs, k, frozen)
        val_rows, val_labels = medusa_rows(data, val_seqs, k, frozen)
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
                    loss = eagle_loss(head, data, batch, frozen, settings, feature_rms)
                else:
                    loss = medusa_loss(head, data, rows[batch], labels[:, batch], frozen, settings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), settings.clip_norm)
            opt.step()
            sched.step()
            loss_sum += float(loss.detach())
        train_s = time.perf_counter() - start
        head.eval()
        if method == "eagle":
            acc = eagle_accuracy(head, data, val_seqs, frozen, max(settings.unroll_steps, 2))
        else:
            acc = medusa_accuracy(head, data, val_rows, val_labels, frozen)
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


def _check_method(method: str, aux_layers: Sequence[int] | None) -> None:
    if method not in DEFAULT_EPOCHS:
        raise ValueError(f"method must be 'eagle' or 'medusa', got {method!r}")
    if aux_layers is not None and aux_layers and method != "eagle":
        raise ValueError("aux_layers: only EAGLE heads fuse earlier layers' features")


def _draft_vocab_coverage(
    data: DistillData, val_seqs: Sequence[int], draft_vocab: torch.Tensor
) -> float:
    """The share of the validation sequences' generated tokens that the draft vocabulary holds."""
    val_generated = torch.cat([data.token_ids[data.rows(i)[2] : data.rows(i)[1]] for i in val_seqs])
    return float(torch.isin(val_generated, draft_vocab).float().mean())


def train_draft(
    method: str, *, out: str, model: str | None = None, dtype: str = "float32",
    num_prompts: int = HOLDOUT_START, max_tokens: int = 192, draft_vocab_size: int = 8192,
    num_medusa_heads: int = 5, epochs: int | None = None, lr: float | None = None,
    seed: int = 0, dataset_path: str | None = None, data_cache: str | None = None,
    log: Callable[[str], Any] = print, prompts: Sequence[list[int]] | None = None,
    settings: dict[str, Any] | None = None, llm_kwargs: dict[str, Any] | None = None,
    all_turns: bool = False, train_dtype: str = "auto", aux_layers: Sequence[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Self-distil a draft head for `model` (None: the default GGUF) and save it to `out`.

    `dataset_path`: the ShareGPT JSON (default: `bench.datasets.default_sharegpt_path()`
    where it exists, else a ValueError naming `dataset_path`); `data_cache`: a
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
    from pagedinfer.worker.worker import resolve_dtype

    _check_method(method, aux_layers)
    args = {
        "method": method, "model": model, "dtype": dtype, "num_prompts": num_prompts,
        "max_tokens": max_tokens, "draft_vocab_size": draft_vocab_size,
        "num_medusa_heads": num_medusa_heads, "all_turns": all_turns, "train_dtype": train_dtype,
        "aux_layers": None if aux_layers is None else list(aux_layers),
        "epochs": epochs or DEFAULT_EPOCHS[method],
        "lr": lr or DEFAULT_LR[method], "seed": seed,
    }  # fmt: skip
    settings = {"bf16": resolve_dtype(train_dtype) == torch.bfloat16, **(settings or {})}
    ts = TrainSettings(epochs=args["epochs"], lr=args["lr"], seed=seed, **settings)
    times: dict[str, float] = {}
    torch.manual_seed(seed)
    texts: list[str] = []
    if prompts is None:  # read before the engine loads: a missing dataset fails at once
        texts = load_training_prompts(num_prompts, dataset_path, all_turns)

    t = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, seed=seed, **(llm_kwargs or {}))
    if prompts is None:
        prompts = chat_prompts(llm.get_tokenizer(), texts)
    worker = llm.llm_engine.engine_core.executor.worker
    arch, name = worker.arch, target_name(model)
    # Medusa never fuses; fused EAGLE features measured no gain on the default model.
    fused = sorted(set(aux_layers or [])) if method == "eagle" else []
    if not all(0 <= i < arch.num_hidden_layers - 1 for i in fused):
        llm.llm_engine.engine_core.shutdown()
        raise ValueError(
            f"aux_layers {fused}: layers are 0-based and the last one "
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
    data = _distill(llm, prompts, max_tokens, fused, data_cache, key, times, log)
    llm.llm_engine.engine_core.shutdown()
    del llm, worker, target  # the engine's KV cache and weights are no longer needed

    train_seqs, val_seqs = split_sequences(data.num_seqs, ts.val_frac, seed)
    draft_vocab = build_draft_vocab(
        data, train_seqs, draft_vocab_size, arch.eos_token_ids, arch.vocab_size
    )
    config = _head_config(method, arch, draft_vocab_size, num_medusa_heads, name, fused)
    if not fused:
        data.aux = None  # a cache made for a fused head also serves a plain one
    t = time.perf_counter()
    head, metrics = train_heads(
        method, config, data, frozen_parts, draft_vocab, train_seqs, val_seqs, ts, log
    )
    times["train_s"] = time.perf_counter() - t

    coverage = _draft_vocab_coverage(data, val_seqs, draft_vocab)
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


def _distill(
    llm: LLM, prompts: Sequence[list[int]], max_tokens: int, aux_layers: list[int],
    data_cache: str | None, key: dict[str, Any], times: dict[str, float],
    log: Callable[[str], Any],
) -> DistillData:  # fmt: skip
    """The sequences and features to train on: read from `data_cache` when it holds them
    for `key` (the features recomputed when it lacks `aux_layers`), else generated and
    written there. Stage timings go to `times`."""
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
        return data
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
    return data
