"""Per-step input preparation, forward pass and sampling hand-off.

The runner keeps one `CachedRequestState` (`worker/request_state.py`) per live request (its
tokens, block table and generator), updated from each `SchedulerOutput`'s deltas.
`execute_model` flattens the scheduled tokens of all requests into one batch, builds the
attention metadata once (`attention/metadata.py`), runs the model and computes logits only
for rows that sample (the last token of each request whose scheduled chunk reaches the end
of its known tokens). `sample_tokens` then samples (its metadata from
`request_state.build_sampling_metadata`), appends the new tokens to the states and returns a
`ModelRunnerOutput`.

The split into two calls mirrors vLLM: the engine core may compute a grammar bitmask
between them (structured outputs plug in there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedinfer.attention.backend import AttentionBackend, ForwardContext, set_forward_context
from pagedinfer.attention.metadata import make_attention_metadata, padded_block_table
from pagedinfer.config import SpeculativeConfig
from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVConnectorOutput
from pagedinfer.core.messages import LogprobsLists
from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase
from pagedinfer.distributed.parallel_state import get_pp_group
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.sample.sampler import (
    LogprobsMode,
    Sampler,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
)
from pagedinfer.sampling_params import SamplingType
from pagedinfer.spec_decode.draft_model import DraftModel
from pagedinfer.spec_decode.proposer import DraftBatch, Proposer, StepRun, create_proposer
from pagedinfer.spec_decode.rejection_sampler import RejectionSampler
from pagedinfer.worker.request_state import CachedRequestState, build_sampling_metadata

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner"]


@dataclass
class _StepState:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]
    sampling_req_ids: list[str]
    logits: torch.Tensor | None  # [num_logits_rows, vocab_size]
    prompt_logprobs: dict[str, LogprobsLists | None]
    spec_drafts: list[list[int]] | None = None
    """Per sampling request, the drafts verified this step (its logits rows are the last
    real token's and one per draft); None when no request verifies drafts (one row each)."""
    hidden: torch.Tensor | None = None
    """[num_tokens, hidden_size], kept only for proposers that read the target's features."""
    runs: list[tuple[str, int, int, int]] | None = None
    """With `hidden`: per request (req_id, first row, start position, tokens run)."""
    kv_connector_output: KVConnectorOutput | None = None
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt completed this step -> their vectors."""


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        vocab_size: int,
        max_num_logprobs: int = 20,
        speculative_config: SpeculativeConfig | None = None,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        draft_model: DraftModel | None = None,
        head_kv_cache: torch.Tensor | None = None,
        kv_connector: KVConnectorBase | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`dtype`: the model's activations' (a pipeline stage receives its hidden states
        in it); the KV cache's may differ (`kv_cache_dtype`)."""
        self.model = model
        self.dtype = dtype
        # KV transfer (disaggregated prefill): loads before the forward pass, per-layer
        # hooks inside it (through the forward context), saves waited for after it.
        self.kv_connector = kv_connector
        self.backend = backend
        self.pp = get_pp_group()
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_num_logprobs = max_num_logprobs
        # The paged backend's C++ build also has a fast row-wise argmax for the sampler.
        kernels = getattr(backend, "kernel", None)
        self.sampler = Sampler(
            argmax=None if kernels is None else kernels.argmax_rows, logprobs_mode=logprobs_mode
        )
        self.logprobs_mode = logprobs_mode
        self.requests: dict[str, CachedRequestState] = {}
        self._step: _StepState | None = None
        # Speculative decoding: the proposer drafts after sampling; the rejection sampler
        # verifies the drafts the scheduler sends back.
        self.proposer: Proposer | None = None
        self.rejection_sampler: RejectionSampler | None = None
        self.disable_spec_above: int | None = None
        if speculative_config is not None:
            if speculative_config.draft_layers is not None:
                # Self-speculative: the target's first layers, sharing its KV cache.
                draft_model = DraftModel(
                    model, backend, kv_caches, speculative_config.draft_layers,
                    shares_target_kv=True,
                )  # fmt: skip
            self.proposer = create_proposer(
                speculative_config, draft_model, block_size, model, backend, head_kv_cache
            )
            self.rejection_sampler = RejectionSampler(self.sampler)
            limit = speculative_config.disable_by_batch_size
            assert limit != "auto", "SpeculativeConfig resolves 'auto' when validated"
            self.disable_spec_above = limit

    # ------------------------------------------------------------------ state updates

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.sampling_type == SamplingType.RANDOM_SEED:
                assert params.seed is not None
                generator = torch.Generator().manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
                pooling_params=new.pooling_params,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_token_ids and not self.pp.is_last_rank:
                # An earlier pipeline stage: the tokens come from the scheduler, since only
                # the last stage samples them.
                del state.all_token_ids[state.num_computed_tokens :]
                state.all_token_ids.extend(cached.new_token_ids[i])

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The forward pass; None: `sample_tokens()` returns the step's output. A step with
        no scheduled tokens returns its (empty) output here, with the KV connector's
        transfers (the `Executor.execute_model` contract)."""
        self._update_states(so)
        connector = self.kv_connector
        if connector is None:
            if so.total_num_scheduled_tokens == 0:
                return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
            self._execute(so)
            return None
        connector.bind_connector_metadata(so.kv_connector_metadata or KVConnectorMetadata())
        try:
            connector.start_load_kv()
            if so.total_num_scheduled_tokens > 0:
                self._execute(so)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        kv_output = connector.get_finished(so.finished_req_ids)
        if so.total_num_scheduled_tokens == 0:  # nothing computed: the transfers alone
            return ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, sampled_token_ids=[], kv_connector_output=kv_output
            )
        assert self._step is not None
        self._step.kv_connector_output = kv_output
        return None

    def _execute(self, so: SchedulerOutput) -> None:
        """Run the scheduled tokens (at least one) and leave the step in `self._step`."""
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        states = [self.requests[r] for r in req_ids]
        num_scheduled = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=num_reqs
        )  # [num_reqs]
        computed_np = np.fromiter(
            (s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs
        )  # [num_reqs]
        seq_lens_np = computed_np + num_scheduled  # [num_reqs]
        qsl_np = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl_np[1:])

        token_ids: list[int] = []
        logits_rows: list[int] = []
        sampling_req_ids: list[str] = []
        drafts_of = so.scheduled_spec_decode_tokens
        spec_drafts: list[list[int]] = []  # per sampling request
        prompt_lp_reqs: list[tuple[str, int, int]] = []  # (req_id, first row, num rows)
        pool_reqs: list[tuple[str, int, int]] = []  # (req_id, first row, num rows)
        block_table_np = padded_block_table([s.block_ids for s in states])
        for i, state in enumerate(states):
            start, end = int(computed_np[i]), int(seq_lens_np[i])
            drafts = drafts_of.get(state.req_id)
            token_ids.extend(state.all_token_ids[start:end])
            if drafts:
                # Verify: the request's new real token(s), then its drafts; logits at the
                # last real token and at every draft.
                assert end == state.num_tokens + len(drafts), (end, state.num_tokens, drafts)
                token_ids.extend(drafts)
                last = int(qsl_np[i + 1]) - 1
                logits_rows.extend(range(last - len(drafts), last + 1))
                sampling_req_ids.append(state.req_id)
                spec_drafts.append(drafts)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # Rows predicting prompt tokens start+1 .. min(end, num_prompt - 1).
                prompt_lp_reqs.append(
                    (state.req_id, int(qsl_np[i]), min(end, num_prompt - 1) - start)
                )
            if state.pooling_params is not None:
                # Pooled, never sampled: the request ends when its prompt does.
                pool_reqs.append((state.req_id, int(qsl_np[i]), end - start))
                continue
            if end >= state.num_tokens and not drafts:
                logits_rows.append(int(qsl_np[i + 1]) - 1)
                sampling_req_ids.append(state.req_id)
                spec_drafts.append([])

        common, positions_np = make_attention_metadata(
            num_scheduled, computed_np, block_table_np, bs
        )
        positions = positions_np
        input_ids = torch.tensor(token_ids, dtype=torch.int64)  # [num_tokens]
        pos_tensor = torch.from_numpy(positions)  # [num_tokens] int64
        ctx = ForwardContext(
            attn_metadata=self.backend.build(common),
            kv_caches=self.kv_caches,
            kv_connector=self.kv_connector,
        )
        aux = None
        if self.pp.world_size > 1:
            stage_hidden = self._forward_stage(ctx, input_ids, pos_tensor)
            if stage_hidden is None:  # an earlier stage: its output went to the next one
                for req_id in req_ids:
                    self.requests[req_id].num_computed_tokens += so.num_scheduled_tokens[req_id]
                self._step = _StepState(req_ids, [], None, {})
                return
            hidden = stage_hidden
        else:
            with set_forward_context(ctx):
                if self.proposer is not None and self.proposer.aux_layers:
                    hidden, aux = self.model.forward_with_aux(
                        input_ids, pos_tensor, self.proposer.aux_layers
                    )
                else:
                    hidden = self.model(input_ids, pos_tensor)  # [num_tokens, hidden_size]
        if self.proposer is not None:
            self.proposer.observe_forward(input_ids, pos_tensor, common)

        logits = None
        if logits_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(logits_rows)])
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_lp_reqs)
        pooled = self._pool(hidden, pool_reqs)
        for req_id in req_ids:
            self.requests[req_id].num_computed_tokens += so.num_scheduled_tokens[req_id]
        self._step = _StepState(
            req_ids,
            sampling_req_ids,
            logits,
            prompt_logprobs,
            spec_drafts if drafts_of and any(spec_drafts) else None,
        )
        self._step.pooled = pooled
        if self.proposer is not None and self.proposer.needs_hidden:
            self._step.hidden = hidden if aux is None else torch.cat([aux, hidden], dim=-1)
            self._step.runs = [
                (r, int(qsl_np[i]), int(computed_np[i]), int(num_scheduled[i]))
                for i, r in enumerate(req_ids)
            ]

    def _forward_stage(
        self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """One pipeline stage of the forward pass: receive the previous stage's (hidden,
        residual), run this stage's layers, and send them on (None); the last stage returns
        the final hidden states. Every stage derives the token count from the same
        scheduler output, so only the tensors' data crosses."""
        pp = self.pp
        intermediate = None
        if not pp.is_first_rank:
            shape = (input_ids.shape[0], self.model.config.hidden_size)
            intermediate = (
                torch.empty(shape, dtype=self.dtype),
                torch.empty(shape, dtype=self.dtype),
            )
            pp.recv(list(intermediate), pp.rank_in_group - 1)
        with set_forward_context(ctx):
            if pp.is_last_rank:
                return self.model(input_ids, positions, intermediate=intermediate)
            hidden, residual = self.model.forward_stage(input_ids, positions, intermediate)
        pp.send([hidden, residual], pp.rank_in_group + 1)
        return None

    def _pool(
        self, hidden: torch.Tensor, reqs: list[tuple[str, int, int]]
    ) -> dict[str, list[float]]:
        """Pool the pooling requests' rows of this step (the prompt chunk each computed);
        the vectors of the requests whose prompt this step completed."""
        out: dict[str, list[float]] = {}
        for req_id, row, num_rows in reqs:
            state = self.requests[req_id]
            params = state.pooling_params
            assert params is not None
            rows = hidden[row : row + num_rows].to(torch.float32)  # [num_rows, hidden_size]
            if params.pooling_type == "mean":
                part = rows.sum(dim=0)
                state.pool_sum = part if state.pool_sum is None else state.pool_sum + part
            if state.num_computed_tokens + num_rows < len(state.prompt_token_ids):
                continue  # not yet advanced for this step: more prompt chunks to come
            if params.pooling_type == "mean":
                assert state.pool_sum is not None
                vector = state.pool_sum / len(state.prompt_token_ids)
            else:
                vector = rows[-1]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            out[req_id] = vector.tolist()
        return out

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        reqs: list[tuple[str, int, int]],
    ) -> dict[str, LogprobsLists | None]:
        """Accumulate prompt logprobs per chunk; emit them once the prompt is complete."""
        out: dict[str, LogprobsLists | None] = {}
        for req_id, row, num_rows in reqs:
            state = self.requests[req_id]
            start = state.num_computed_tokens  # not yet advanced for this step
            targets = torch.tensor(
                state.prompt_token_ids[start + 1 : start + 1 + num_rows], dtype=torch.int64
            )
            num_lp = state.sampling_params.prompt_logprobs
            assert num_lp is not None
            if num_lp == -1:
                num_lp = self.vocab_size
            logits = self.model.compute_logits(hidden[row : row + num_rows])
            state.prompt_logprobs.append(compute_prompt_logprobs(logits, targets, num_lp))
            if start + num_rows >= len(state.prompt_token_ids) - 1:
                parts = state.prompt_logprobs
                ids, lps, ranks = [], [], []
                for part in parts:
                    a, b, c = part.tolists()
                    ids.extend(a)
                    lps.extend(b)
                    ranks.extend(c)
                out[req_id] = LogprobsLists(ids, lps, ranks)
                state.prompt_logprobs = []
        return out

    # ------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        step = self._step
        assert step is not None, "sample_tokens() without execute_model()"
        self._step = None
        req_id_to_index = {r: i for i, r in enumerate(step.req_ids)}
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs_lists = None
        states: list[CachedRequestState] = []
        if step.logits is not None:
            states = [self.requests[r] for r in step.sampling_req_ids]
            # The first logits row of each sampling request (k + 1 rows when verifying k).
            first_row: dict[str, int] = {}
            row = 0
            for i, req_id in enumerate(step.sampling_req_ids):
                first_row[req_id] = row
                row += 1 + (len(step.spec_drafts[i]) if step.spec_drafts else 0)
            if grammar_output is not None:
                self._apply_grammar_bitmask(step.logits, first_row, grammar_output)
            metadata = build_sampling_metadata(states, self.vocab_size)
            if step.spec_drafts is None:
                out = self.sampler(step.logits, metadata)
                token_lists = [[t] for t in out.sampled_token_ids.tolist()]
                if out.logprobs_tensors is not None:
                    # One row per sampling request, in req_ids order: the output's layout.
                    logprobs_lists = LogprobsLists(*out.logprobs_tensors.tolists())
            else:
                assert self.rejection_sampler is not None
                verified = self.rejection_sampler(step.spec_drafts, None, step.logits, metadata)
                token_lists = verified.sampled_token_ids
                if metadata.max_num_logprobs is not None:
                    logprobs_lists = self._verified_logprobs(
                        step.logits, first_row, step.sampling_req_ids, token_lists,
                        metadata.max_num_logprobs, self.logprobs_mode == "raw_logits",
                    )  # fmt: skip
            for state, tokens in zip(states, token_lists):
                for token_id in tokens:
                    state.append_token(token_id)
                sampled[req_id_to_index[state.req_id]] = tokens
        draft_token_ids = self._propose(step, states)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index=req_id_to_index,
            sampled_token_ids=sampled,
            logprobs=logprobs_lists,
            prompt_logprobs_dict=step.prompt_logprobs,
            draft_token_ids=draft_token_ids,
            kv_connector_output=step.kv_connector_output,
            pooler_output=step.pooled,
        )

    def _propose(
        self, step: _StepState, states: list[CachedRequestState]
    ) -> dict[str, list[int]] | None:
        """Drafts for the next step, unless speculation is off or the batch is too big
        (drafters with state of their own still see the step)."""
        proposer = self.proposer
        if proposer is None:
            return None
        want = bool(states) and (
            self.disable_spec_above is None or len(step.req_ids) <= self.disable_spec_above
        )
        if not want and not (proposer.needs_every_step and step.runs):
            return None
        batch = DraftBatch(step.sampling_req_ids if states else [], states, want_drafts=want)
        if step.runs is not None:
            batch.hidden = step.hidden
            for req_id, first_row, start, num_run in step.runs:
                state = self.requests[req_id]
                # Real positions whose next token is known: all but a verified run's
                # rejected drafts (the last known token has no successor yet).
                num_real = min(num_run, state.num_tokens - 1 - start)
                batch.runs.append(StepRun(state, first_row, start, num_real))
        drafts = proposer.propose(batch)
        if not want:
            return None
        return {r: d for r, d in zip(batch.req_ids, drafts) if d}

    @staticmethod
    def _verified_logprobs(
        logits: torch.Tensor,
        first_row: dict[str, int],
        req_ids: list[str],
        token_lists: list[list[int]],
        num_logprobs: int,
        as_logits: bool = False,
    ) -> LogprobsLists:
        """Raw-distribution logprobs of each kept token: token j of a verified run was
        sampled at its request's logits row first + j."""
        rows = [first_row[r] + j for r, kept in zip(req_ids, token_lists) for j in range(len(kept))]
        tokens = torch.tensor([t for kept in token_lists for t in kept], dtype=torch.int64)
        picked = logits[torch.tensor(rows)].to(torch.float32)  # [num_kept, vocab_size]
        raw = picked if as_logits else compute_logprobs(picked)
        return LogprobsLists(*gather_logprobs(raw, num_logprobs, tokens).tolists())

    @staticmethod
    def _apply_grammar_bitmask(
        logits: torch.Tensor, first_row: dict[str, int], grammar_output: GrammarOutput
    ) -> None:
        """Disallowed tokens of the structured requests' rows -> -inf (before sampling, so
        penalties, temperature and top-k/p only ever see allowed tokens). The mask's rows
        are in the scheduler's batch order, `grammar_output.rows_of(i)` of them for request
        i (more than one when draft tokens are verified: those logits rows follow the
        request's first one, `first_row[req_id]`); map them to this step's logits rows."""
        from pagedinfer.structured_output.backend import apply_token_bitmask

        rows: list[int] = []
        keep: list[int] = []
        mask_row = 0
        for i, req_id in enumerate(grammar_output.req_ids):
            n = grammar_output.rows_of(i)
            if req_id in first_row:
                rows.extend(range(first_row[req_id], first_row[req_id] + n))
                keep.extend(range(mask_row, mask_row + n))
            mask_row += n
        if not rows:
            return
        mask = torch.from_numpy(grammar_output.bitmask)
        if len(keep) != mask.shape[0]:
            mask = mask[keep]
        index = torch.tensor(rows)
        sub = logits.index_select(0, index)
        apply_token_bitmask(sub, mask)
        logits.index_copy_(0, index, sub)
