"""Per-step input preparation, forward pass and sampling hand-off.

The runner keeps one `CachedRequestState` per live request (its tokens, block table and
generator), updated from each `SchedulerOutput`'s deltas. `execute_model` flattens the
scheduled tokens of all requests into one batch, builds the attention metadata once, runs
the model and computes logits only for rows that sample (the last token of each request
whose scheduled chunk reaches the end of its known tokens). `sample_tokens` then samples,
appends the new tokens to the states and returns a `ModelRunnerOutput`.

The split into two calls mirrors vLLM: the engine core may compute a grammar bitmask
between them (structured outputs plug in there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedinfer.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    ForwardContext,
    set_forward_context,
)
from pagedinfer.config import SpeculativeConfig
from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVConnectorOutput
from pagedinfer.core.messages import LogprobsLists
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase
from pagedinfer.distributed.parallel_state import get_pp_group
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.sample.metadata import LogprobsTensors, SamplingMetadata
from pagedinfer.sample.sampler import (
    Sampler,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
)
from pagedinfer.sampling_params import SamplingParams, SamplingType
from pagedinfer.spec_decode.draft_model import DraftModel
from pagedinfer.spec_decode.proposer import DraftBatch, Proposer, StepRun, create_proposer
from pagedinfer.spec_decode.rejection_sampler import RejectionSampler

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "CachedRequestState", "make_attention_metadata", "padded_block_table"]

_GREEDY_EPS = 1e-5


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Prompt logprobs gathered chunk by chunk until the prompt is done.
    prompt_logprobs: list[LogprobsTensors] = field(default_factory=list)
    # prompt + output, kept in step with output_token_ids by append_token().
    all_token_ids: list[int] = field(default_factory=list)
    # The same tokens in a growing numpy buffer, made on the first token_array() call (the
    # n-gram proposer searches it every step).
    _token_buf: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        buf = self._token_buf
        if buf is not None:
            n = len(self.all_token_ids)
            if n > len(buf):
                buf = self._token_buf = np.resize(buf, 2 * n)
            buf[n - 1] = token_id

    def token_array(self) -> np.ndarray:
        """`all_token_ids` as an int64 array (a view: valid until the next append)."""
        n = len(self.all_token_ids)
        if self._token_buf is None:
            self._token_buf = np.zeros(max(2 * n, 64), dtype=np.int64)
            self._token_buf[:n] = self.all_token_ids
        return self._token_buf[:n]


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


def padded_block_table(block_ids: list[list[int]]) -> np.ndarray:
    """`[num_reqs, max_blocks]` int32 block table, each row padded with 0."""
    table = np.zeros((len(block_ids), max(len(ids) for ids in block_ids)), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


def make_attention_metadata(
    num_scheduled: np.ndarray, computed: np.ndarray, block_table: np.ndarray, block_size: int
) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """The flattened batch's attention metadata and token positions: request i runs
    `num_scheduled[i]` tokens starting at position `computed[i]`, its KV in the blocks of
    `block_table[i]` (`[num_reqs, max_blocks]` int32, padded)."""
    num_reqs = len(num_scheduled)
    seq_lens_np = computed + num_scheduled  # [num_reqs]
    qsl_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qsl_np[1:])
    num_tokens = int(qsl_np[-1])
    # Per-token request index and position, then slots, all vectorised.
    req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)  # [num_tokens]
    positions_np = np.arange(num_tokens) - np.repeat(qsl_np[:-1] - computed, num_scheduled)
    slots_np = (
        block_table[req_of_token, positions_np // block_size].astype(np.int64) * block_size
        + positions_np % block_size
    )  # [num_tokens]
    common = CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl_np.astype(np.int32)),
        query_start_loc_cpu=qsl_np.tolist(),
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)),
        seq_lens_cpu=seq_lens_np.tolist(),
        num_computed_tokens_cpu=computed.tolist(),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens_np.max()),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots_np),
        block_size=block_size,
    )
    return common, positions_np


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
        draft_model: DraftModel | None = None,
        head_kv_cache: torch.Tensor | None = None,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        self.model = model
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
        self.sampler = Sampler(argmax=None if kernels is None else kernels.argmax_rows)
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
        self._update_states(so)
        connector = self.kv_connector
        if connector is None:
            return self._execute(so)
        connector.bind_connector_metadata(so.kv_connector_metadata or KVConnectorMetadata())
        try:
            connector.start_load_kv()
            output = self._execute(so)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        kv_output = connector.get_finished(so.finished_req_ids)
        if output is not None:  # nothing to compute: report the transfers alone
            output.kv_connector_output = kv_output
        else:
            assert self._step is not None
            self._step.kv_connector_output = kv_output
        return output

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if so.total_num_scheduled_tokens == 0:
            if self.kv_connector is not None:
                return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
            self._step = _StepState([], [], None, {})
            return None

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
                return None
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
        for req_id in req_ids:
            self.requests[req_id].num_computed_tokens += so.num_scheduled_tokens[req_id]
        self._step = _StepState(
            req_ids,
            sampling_req_ids,
            logits,
            prompt_logprobs,
            spec_drafts if drafts_of and any(spec_drafts) else None,
        )
        if self.proposer is not None and self.proposer.needs_hidden:
            self._step.hidden = hidden if aux is None else torch.cat([aux, hidden], dim=-1)
            self._step.runs = [
                (r, int(qsl_np[i]), int(computed_np[i]), int(num_scheduled[i]))
                for i, r in enumerate(req_ids)
            ]
        return None

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
            dtype = self.kv_caches[0].dtype if self.kv_caches else torch.float32
            intermediate = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            pp.recv(list(intermediate), pp.rank_in_group - 1)
        with set_forward_context(ctx):
            if pp.is_last_rank:
                return self.model(input_ids, positions, intermediate=intermediate)
            hidden, residual = self.model.forward_stage(input_ids, positions, intermediate)
        pp.send([hidden, residual], pp.rank_in_group + 1)
        return None

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
    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
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
            metadata = self._sampling_metadata(states)
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
                        metadata.max_num_logprobs,
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
    ) -> LogprobsLists:
        """Raw-distribution logprobs of each kept token: token j of a verified run was
        sampled at its request's logits row first + j."""
        rows = [first_row[r] + j for r, kept in zip(req_ids, token_lists) for j in range(len(kept))]
        tokens = torch.tensor([t for kept in token_lists for t in kept], dtype=torch.int64)
        raw = compute_logprobs(logits[torch.tensor(rows)])  # [num_kept, vocab_size]
        return LogprobsLists(*gather_logprobs(raw, num_logprobs, tokens).tolists())

    @staticmethod
    def _apply_grammar_bitmask(
        logits: torch.Tensor, first_row: dict[str, int], grammar_output
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

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        temps = [p.temperature for p in params]
        all_greedy = all(t < _GREEDY_EPS for t in temps)
        all_random = all(t >= _GREEDY_EPS for t in temps)
        top_ps = [p.top_p for p in params]
        top_ks = [p.top_k for p in params]
        min_ps = [p.min_p for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = None
        if wanted:
            max_num_logprobs = max(self.vocab_size if k == -1 else k for k in wanted)
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        rep = [p.repetition_penalty for p in params]
        no_penalties = (
            all(f == 0 for f in freq) and all(p == 0 for p in pres) and all(r == 1 for r in rep)
        )
        prompt_ids = None
        if any(r != 1 for r in rep):
            max_len = max(len(s.prompt_token_ids) for s in states)
            prompt_ids = torch.full((len(states), max_len), self.vocab_size, dtype=torch.int64)
            for i, s in enumerate(states):
                prompt_ids[i, : len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids)
        allowed_mask = None
        if any(p.allowed_token_ids is not None for p in params):
            allowed_mask = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    allowed_mask[i] = True
                    allowed_mask[i, p.allowed_token_ids] = False
        min_tokens = {
            i: (p.min_tokens, p.all_stop_token_ids)
            for i, p in enumerate(params)
            if p.min_tokens > 0 and len(states[i].output_token_ids) < p.min_tokens
        }
        return SamplingMetadata(
            temperature=None if all_greedy else torch.tensor(temps, dtype=torch.float32),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=None if all(p == 1.0 for p in top_ps) else torch.tensor(top_ps),
            top_k=None if all(k == 0 for k in top_ks) else torch.tensor(top_ks),
            min_p=None if all(m == 0 for m in min_ps) else torch.tensor(min_ps),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            max_num_logprobs=max_num_logprobs,
            no_penalties=no_penalties,
            prompt_token_ids=prompt_ids,
            output_token_ids=[s.output_token_ids for s in states],
            frequency_penalties=None if no_penalties else torch.tensor(freq),
            presence_penalties=None if no_penalties else torch.tensor(pres),
            repetition_penalties=None if no_penalties else torch.tensor(rep),
            logit_bias=[p.logit_bias for p in params],
            min_tokens=min_tokens,
            allowed_token_ids_mask=allowed_mask,
        )
