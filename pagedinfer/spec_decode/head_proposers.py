"""The "eagle" and "medusa" proposers: trained heads (`heads.py`) over the target's features.

Both get, after each step, the target's features (final hidden states) of every token the
step ran (`DraftBatch.hidden`) and, per request, which of them are real: a verified run's
rejected drafts are not. Drafts are argmax choices over the heads' draft vocabulary, mapped
back to target token ids; they carry no probabilities (point masses for the rejection
sampler, as the draft-model proposer's).

EAGLE keeps a KV cache for its one decoder layer, laid out like the target's (same blocks
and slots). Its input at position t is (h_t, e(x_{t+1})), stored at position t, so every
real position the target computes is also computed by the head in the same step: the
"catch-up" over all runs of the step (prompt chunks too) keeps that cache complete, prefix
cache hits included (a cached block's head KV was written with the token that followed it
then, which may differ for a new request: only the draft quality can suffer, never the
output). The catch-up's last row of a request that just sampled token r at position P is
the input (h_{P-1}, e(r)): its predicted feature f_P gives draft 1 (the token at P + 1);
draft i + 1 comes from (f_{P+i-1}, e(draft i)) stored at position P + i - 1, inside the
`num_speculative_tokens` lookahead slots the scheduler reserves.

Medusa needs no cache: its heads read h_{P-1} (the feature that produced r) and e(r), and
head i (0-based) predicts the token at P + 1 + i.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedinfer.attention.backend import AttentionBackend
from pagedinfer.attention.metadata import make_attention_metadata, padded_block_table
from pagedinfer.config import SpeculativeConfig
from pagedinfer.model.linear import Linear
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.model.quant import GROUP_SIZE, QuantizedWeight, quantize_q8_0
from pagedinfer.spec_decode.heads import EagleHead, HeadConfig, MedusaHeads, load_heads
from pagedinfer.spec_decode.proposer import DraftBatch, Proposer

__all__ = ["EagleProposer", "MedusaProposer", "fast_linear", "load_head_file"]

# Draft heads run a few rows per call. As plain bf16 `F.linear` (oneDNN reorders the
# weight every call) one EAGLE pass took ~2 ms at batch 1 and a step makes k of them,
# which made EAGLE slower than no speculation; the target's own small-step path (Q8_0
# blocks through the C++ kernel, oneDNN's prepacked layout for bigger steps) cuts that
# several-fold. Q8_0 changes the drafts' logits by rounding only: drafts, not outputs.
_QUANT_MAX_ROWS = 32  # steps of drafts; the crossover measured for these heads: 32-64 rows
_PREPACK_BATCH_HINT = 16


def fast_linear(weight: torch.Tensor, quantize: bool = True) -> Linear:
    """A `Linear` computing x @ weight.T: Q8_0 blocks for steps of <= 32 rows (when the C++
    kernels are built and the input width is a multiple of 32), prepacked dense otherwise."""
    from pagedinfer.kernels.cpu import load_cpu_kernels

    out_features, in_features = weight.shape
    layer = Linear(in_features, out_features)
    layer.weight = torch.nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
    kernels = load_cpu_kernels() if quantize and in_features % GROUP_SIZE == 0 else None
    if kernels is not None:
        layer.set_quant(QuantizedWeight(quantize_q8_0(weight), kernels), _QUANT_MAX_ROWS)
    layer.prepack(_PREPACK_BATCH_HINT)
    return layer


def load_head_file(
    path: str, target: LlamaForCausalLM, dtype: torch.dtype
) -> tuple[torch.nn.Module, HeadConfig, torch.Tensor, torch.Tensor]:
    """(head, config, draft vocabulary [V_d] target ids, draft LM head [V_d, H]), checked
    against the target model."""
    head, config, draft_vocab, _ = load_heads(path, dtype)
    arch = target.config
    if config.hidden_size != arch.hidden_size or config.vocab_size != arch.vocab_size:
        raise ValueError(
            f"{path} was trained for a model with hidden size {config.hidden_size} and "
            f"{config.vocab_size} tokens, not this one ({arch.hidden_size}, {arch.vocab_size})"
        )
    lm_head = target.lm_head_weight[draft_vocab].to(dtype).contiguous()  # [V_d, H]
    return head, config, draft_vocab, lm_head


class _HeadProposer(Proposer):
    def __init__(
        self, config: SpeculativeConfig, target: LlamaForCausalLM, head_path: str,
        quantize: bool = True,
    ) -> None:  # fmt: skip
        self.num_speculative_tokens = config.num_speculative_tokens
        self.target = target
        dtype = target.embed_tokens.weight.dtype
        self.head, self.head_config, self.draft_vocab, self.lm_head = load_head_file(
            head_path, target, dtype
        )
        self.lm_head_linear = fast_linear(self.lm_head, quantize)

    def _argmax_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> target token ids [...] of the draft vocabulary's argmax."""
        shape = features.shape[:-1]
        logits = self.lm_head_linear(features.reshape(-1, features.shape[-1]))  # [n, V_d]
        return self.draft_vocab[logits.argmax(dim=-1)].reshape(shape)


class MedusaProposer(_HeadProposer):
    needs_hidden = True

    def __init__(
        self, config: SpeculativeConfig, target: LlamaForCausalLM, head_path: str,
        quantize: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(config, target, head_path, quantize)
        assert isinstance(self.head, MedusaHeads)
        num_heads = self.head_config.num_medusa_heads
        k = config.num_speculative_tokens
        if k > num_heads:
            raise ValueError(
                f"num_speculative_tokens ({k}) exceeds the {num_heads} Medusa heads in {head_path}"
            )
        # The first k heads as plain matmuls: fc, every head's up projection in one, and
        # each head's down projection.
        head = self.head
        m = self.head_config.medusa_intermediate_size
        self.fc = fast_linear(head.fc.weight, quantize)
        self.up = fast_linear(head.up[:k].reshape(k * m, -1), quantize)  # [k * m, H]
        self.up_bias = head.up_bias[:k].reshape(k * m)
        self.down = [fast_linear(head.down[i], quantize) for i in range(k)]  # [H, m] each

    def features(self, hidden: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
        """`MedusaHeads.forward` for the first k heads: h [T, H] and the tokens they produced
        [T] -> per-head features [k, T, H]."""
        x = self.fc(torch.cat([self.target.embed_tokens(new_tokens), hidden], dim=-1))
        u = torch.nn.functional.silu(self.up(x) + self.up_bias)  # [T, k * m]
        parts = u.chunk(len(self.down), dim=-1)
        return torch.stack([x + down(part) for down, part in zip(self.down, parts)])

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[list[int]]:
        if not batch.want_drafts or not batch.states:
            return [[] for _ in batch.states]
        assert batch.hidden is not None
        rows = torch.tensor(batch.last_real_rows, dtype=torch.int64)
        features = batch.hidden[rows]  # [num_reqs, H]
        new_tokens = torch.tensor([s.all_token_ids[-1] for s in batch.states])
        per_head = self.features(features, new_tokens)  # [k, num_reqs, H]
        tokens = self._argmax_tokens(per_head).T  # [num_reqs, k]
        return tokens.tolist()


class EagleProposer(_HeadProposer):
    needs_hidden = True
    needs_every_step = True  # its KV cache must see every real position

    def __init__(
        self,
        config: SpeculativeConfig,
        target: LlamaForCausalLM,
        head_path: str,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        block_size: int,
        quantize: bool = True,
    ):
        super().__init__(config, target, head_path, quantize)
        assert isinstance(self.head, EagleHead)
        names = ["fc", "qkv", "o", "gate_up", "down"]
        for name in names + (["fuse"] if self.head.fuse is not None else []):
            setattr(self.head, name, fast_linear(getattr(self.head, name).weight, quantize))
        self.aux_layers = tuple(self.head_config.aux_layers)
        self.backend = backend
        self.kv_caches = [kv_cache]  # one layer: [2, num_blocks, block_size, kv_heads, D]
        self.block_size = block_size

    def _run(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        num_scheduled: np.ndarray,
        starts: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """The head over runs of `num_scheduled[i]` positions from `starts[i]` (paged)."""
        common, positions = make_attention_metadata(
            num_scheduled, starts, block_table, self.block_size
        )
        metadata = self.backend.build(common)

        def paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.backend.forward(q, k, v, self.kv_caches[0], metadata)

        return self.head(
            features,
            self.target.embed_tokens(next_tokens),
            torch.from_numpy(positions),
            attention=paged,
        )

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[list[int]]:
        assert batch.hidden is not None
        runs = batch.runs
        states = [run.state for run in runs]
        # 1. Catch-up: every real position of every run, with the token after it.
        rows: list[int] = []
        next_ids: list[int] = []
        for run in runs:
            rows.extend(range(run.first_row, run.first_row + run.num_real))
            tokens = run.state.all_token_ids
            next_ids.extend(tokens[run.start + 1 : run.start + 1 + run.num_real])
        num_real = np.array([run.num_real for run in runs], dtype=np.int64)
        starts = np.array([run.start for run in runs], dtype=np.int64)
        table = padded_block_table([s.block_ids for s in states])
        live = num_real > 0
        drafts: list[list[int]] = [[] for _ in batch.states]
        if not live.any():
            return drafts
        features = self.head.project(batch.hidden[torch.tensor(rows, dtype=torch.int64)])
        predicted = self._run(
            features,
            torch.tensor(next_ids, dtype=torch.int64),
            num_real[live],
            starts[live],
            np.ascontiguousarray(table[live]),
        )  # [sum num_real, H]
        if not batch.want_drafts:
            return drafts
        # 2. Draft 1 from the last catch-up row of each request that sampled; then k - 1
        # decode steps of the head alone.
        ends = np.cumsum(num_real[live]) - 1
        end_of_run = dict(zip(np.nonzero(live)[0].tolist(), ends.tolist()))
        run_of_state = {id(run.state): i for i, run in enumerate(runs)}
        sampling = [run_of_state[id(s)] for s in batch.states]
        feats = predicted[torch.tensor([end_of_run[i] for i in sampling], dtype=torch.int64)]
        token = self._argmax_tokens(feats)  # [num_sampling]
        for j, t in enumerate(token.tolist()):
            drafts[j].append(t)
        # Draft i + 1 is written at position P + i - 1; keep those inside each request's
        # blocks (the lookahead slots; fewer near max_model_len).
        bs = self.block_size
        positions = np.array([runs[i].start + runs[i].num_real for i in sampling], np.int64)
        room = np.array([len(s.block_ids) * bs for s in batch.states], np.int64) - positions
        num_drafts = np.minimum(self.num_speculative_tokens, np.maximum(room, 0) + 1)
        sub_table = table[sampling]
        for step in range(1, int(num_drafts.max(initial=0))):
            active = np.nonzero(num_drafts > step)[0]
            index = torch.from_numpy(active)
            step_feats = self._run(
                feats[index],
                token[index],
                np.ones(len(active), dtype=np.int64),
                positions[active] + step - 1,
                np.ascontiguousarray(sub_table[active]),
            )
            step_tokens = self._argmax_tokens(step_feats)
            feats[index], token[index] = step_feats, step_tokens  # rows stay per request
            for j, t in zip(active.tolist(), step_tokens.tolist()):
                drafts[j].append(t)
        return drafts
