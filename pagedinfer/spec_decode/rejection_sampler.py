"""Verifies speculative drafts against the target model's logits (exact speculative sampling).

Role: the model runner calls `RejectionSampler.forward(draft_token_ids, draft_probs, logits,
metadata)` once per step for the requests that sample, instead of `Sampler.forward`. Request i
proposed `k_i >= 0` draft tokens; the target scored them in one forward pass, giving `k_i + 1`
rows of logits. The result keeps, per request, the longest accepted prefix of its drafts plus
ONE more token: the correction at the first rejected position, or the bonus token when every
draft was accepted. So each request gains between 1 and `k_i + 1` tokens per step.

Row layout (flattened, request order, no padding):
  - `logits` `[sum_i (k_i + 1), vocab_size]`: request i's rows are contiguous; its row j is the
    target's distribution for the token after `drafts_i[:j]` (row k_i: the bonus position);
  - `draft_probs` `[sum_i k_i, vocab_size]` (or None): the distribution draft j of request i
    was drawn from, rows in the same order as the drafts flattened.
`metadata` is the per-REQUEST `SamplingMetadata` the normal `Sampler` would get; it is
expanded here to one row per logits row, with `output_token_ids + drafts[:j]` as row j's
history, so that penalties and min_tokens act exactly as in non-speculative decoding.

Verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"):
  - greedy requests (temperature < GREEDY_EPS): accept draft j while it equals the argmax of
    processed row j; the output is exactly what non-speculative greedy decoding gives;
  - random requests: p_j = softmax(top-k/top-p/min-p(processed row j / T)) as in `Sampler`.
    Draft d at position j is accepted iff p_j(d) > 0, q_j(d) > 0 and u * q_j(d) <= p_j(d),
    u ~ U[0, 1) in float64 (accept with probability min(1, p/q)). The first rejection emits
    a token from the residual max(0, p_j - q_j) (normalisation is implicit in the
    exponential race); with no rejection the bonus token is drawn from p_{k_i}. Every emitted
    token is then distributed exactly as the target would have sampled it.
    Drafts without probabilities (`draft_probs is None`: n-gram or argmax drafters) are point
    masses: q_j(d) = 1, so d is accepted with probability p_j(d) and the residual is p_j with
    d removed.

Invariants:
  - `logits` and `draft_probs` are never modified.
  - A request with a generator in `metadata.generators` draws all its randomness from it, in
    a fixed order: exactly k_i float64 uniforms (one per draft, even those after a
    rejection), then `vocab_size` float32 exponentials for its final token. A seeded request
    therefore gives the same tokens whatever else is in the batch; with k_i = 0 it gives the
    same token as `Sampler` with the same seed. Greedy requests consume no randomness.
  - An accepted token always has p > 0 under the processed target, so a draft that is
    disallowed at its position (allowed ids, grammar mask, top-k...) is always rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.sample.metadata import SamplingMetadata
from pagedinfer.sample.sampler import (
    GREEDY_EPS,
    Sampler,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    random_sample,
)

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionOutput", "RejectionSampler"]

PLACEHOLDER_TOKEN_ID = -1
"""Pads ragged per-request token lists into a rectangle; never a real token id."""


@dataclass
class RejectionOutput:
    sampled_token_ids: list[list[int]]
    """Per request: its accepted drafts, then ONE more token (the correction after a
    rejection, or the bonus token when every draft was accepted). Length 1..k_i + 1."""
    num_accepted: list[int]
    """Per request: the number of accepted drafts (= len(sampled_token_ids[i]) - 1)."""


@dataclass
class _Layout:
    """Where each request's rows live in the flattened `logits` and `draft_probs`."""

    num_drafts: torch.Tensor
    """[num_reqs] int64 (CPU): k_i."""
    row_starts: torch.Tensor
    """[num_reqs] int64 (CPU): first `logits` row of request i."""
    draft_starts: torch.Tensor
    """[num_reqs] int64 (CPU): first draft (`draft_probs` row) of request i."""
    num_rows: int
    num_draft_rows: int


class RejectionSampler(torch.nn.Module):
    """Stateless; see the module docstring. Composes `sampler` for its row argmax (and the
    static `Sampler.apply_logits_processors`); the sampler itself is not modified."""

    def __init__(self, sampler: Sampler) -> None:
        super().__init__()
        self.sampler = sampler

    def forward(
        self,
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> RejectionOutput:
        """Verify `draft_token_ids[i]` (k_i >= 0 ids) against `logits`
        `[sum_i (k_i + 1), vocab_size]` (raw, any float dtype) with the per-request
        `metadata`; `draft_probs` is `[sum_i k_i, vocab_size]` or None (point-mass drafts)."""
        num_reqs = len(draft_token_ids)
        if num_reqs == 0:
            return RejectionOutput(sampled_token_ids=[], num_accepted=[])
        layout = _make_layout(draft_token_ids)
        _check_inputs(layout, draft_probs, logits, metadata)
        device = logits.device

        row_metadata = _expand_metadata(metadata, draft_token_ids, layout)
        # May alias `logits` when no processor applies: read only from here on.
        processed = Sampler.apply_logits_processors(logits, row_metadata)  # [num_rows, vocab]

        flat_drafts = [token for drafts in draft_token_ids for token in drafts]
        drafts = torch.tensor(flat_drafts, dtype=torch.int64)  # [num_draft_rows]
        draft_req = torch.repeat_interleave(torch.arange(num_reqs), layout.num_drafts)
        draft_pos = _segment_arange(torch.zeros_like(layout.num_drafts), layout.num_drafts)
        draft_rows = layout.row_starts[draft_req] + draft_pos  # [num_draft_rows] logits rows

        is_greedy = _greedy_requests(metadata, num_reqs)  # [num_reqs] bool (CPU)
        random_ids = (~is_greedy).nonzero().squeeze(1)  # [num_random]
        accepted = torch.zeros(layout.num_draft_rows, dtype=torch.bool, device=device)
        row_argmax = None
        if bool(is_greedy.any()):
            row_argmax = self.sampler.argmax(processed)  # [num_rows]
            # Random requests' entries are overwritten below.
            accepted = row_argmax[draft_rows.to(device)] == drafts.to(device)
        random_state = None
        if random_ids.numel() > 0:
            random_state = _RandomRequests(
                layout, random_ids, row_metadata, processed, metadata.generators
            )
            random_state.verify(accepted, drafts, draft_probs)

        num_accepted = _count_accepted(accepted.cpu(), draft_req, draft_pos, num_reqs)
        final = torch.empty(num_reqs, dtype=torch.int64)  # [num_reqs]
        if row_argmax is not None:
            greedy_ids = is_greedy.nonzero().squeeze(1)  # [num_greedy]
            final_rows = layout.row_starts[greedy_ids] + num_accepted[greedy_ids]
            final[greedy_ids] = row_argmax[final_rows.to(device)].cpu()
        if random_state is not None:
            final[random_ids] = random_state.final_tokens(
                num_accepted[random_ids], drafts, draft_probs, self.sampler
            ).cpu()

        num_accepted_list = num_accepted.tolist()
        sampled = [
            drafts_i[:n] + [token]
            for drafts_i, n, token in zip(draft_token_ids, num_accepted_list, final.tolist())
        ]
        return RejectionOutput(sampled_token_ids=sampled, num_accepted=num_accepted_list)


class _RandomRequests:
    """The random (non-greedy) requests of one step: their target probabilities, and the
    acceptance test and final draw for each. Index tensors are CPU int64; `sub` rows index
    `self.probs`, which holds only these requests' rows (all rows when all are random)."""

    def __init__(
        self,
        layout: _Layout,
        random_ids: torch.Tensor,
        row_metadata: SamplingMetadata,
        processed: torch.Tensor,
        generators: dict[int, torch.Generator],
    ) -> None:
        self.random_ids = random_ids  # [num_random] request indices
        # Request-indexed generators, re-keyed by position in this sub-batch.
        self.generators = {
            local: generators[req]
            for local, req in enumerate(random_ids.tolist())
            if req in generators
        }
        self.num_drafts = layout.num_drafts[random_ids]  # [num_random]
        self.draft_starts = layout.draft_starts[random_ids]  # [num_random]
        num_rows = self.num_drafts + 1  # [num_random]
        self.sub_starts = torch.cumsum(num_rows, 0) - num_rows  # [num_random]
        rows = None
        if random_ids.numel() < layout.num_drafts.numel():
            rows = _segment_arange(layout.row_starts[random_ids], num_rows)  # [num_sub_rows]
        self.probs = _target_probs(processed, row_metadata, rows)  # [num_sub_rows, vocab]

    def verify(
        self,
        accepted: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> None:
        """Write the acceptance of these requests' drafts into `accepted` `[num_draft_rows]`
        (IN PLACE). Draws the k_i uniforms of every request (seeded: from its generator)."""
        device = self.probs.device
        flat = _segment_arange(self.draft_starts, self.num_drafts)  # [num_rand_drafts]
        if flat.numel() == 0:
            return
        local = torch.repeat_interleave(torch.arange(len(self.random_ids)), self.num_drafts)
        pos = flat - self.draft_starts[local]  # [num_rand_drafts] position j within request
        sub_rows = self.sub_starts[local] + pos  # [num_rand_drafts]
        tokens = drafts[flat].to(device)  # [num_rand_drafts]
        p = self.probs[sub_rows.to(device), tokens].to(torch.float64)  # [num_rand_drafts]
        if draft_probs is None:
            q = torch.ones_like(p)  # [num_rand_drafts]
        else:
            q = draft_probs[flat.to(draft_probs.device), tokens.to(draft_probs.device)]
            q = q.to(device=device, dtype=torch.float64)  # [num_rand_drafts]

        u = self._uniforms(flat.numel(), device)  # [num_rand_drafts] float64
        ok = (p > 0) & (q > 0) & (u * q <= p)  # [num_rand_drafts]
        accepted[flat.to(device)] = ok

    def _uniforms(self, num_rand_drafts: int, device: torch.device) -> torch.Tensor:
        """k_i float64 uniforms per request, concatenated in request order: seeded requests
        from their own generator, the others from one batched default-generator draw."""
        num_drafts = self.num_drafts.tolist()
        offsets = (torch.cumsum(self.num_drafts, 0) - self.num_drafts).tolist()
        u = torch.empty(num_rand_drafts, dtype=torch.float64, device=device)  # [num_rand_drafts]
        if sum(num_drafts[local] for local in self.generators) < num_rand_drafts:
            u.uniform_()
        for local, generator in self.generators.items():
            start, k = offsets[local], num_drafts[local]
            if k > 0:
                u[start : start + k] = torch.rand(
                    k, dtype=torch.float64, device=device, generator=generator
                )
        return u

    def final_tokens(
        self,
        num_accepted: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        sampler: Sampler,
    ) -> torch.Tensor:
        """One token per random request (`num_accepted` `[num_random]`): from the residual at
        its first rejected position, or from p at its bonus position. Returns
        `[num_random]` int64 on the probs' device."""
        device = self.probs.device
        final_rows = self.sub_starts + num_accepted  # [num_random]
        dist = self.probs[final_rows.to(device)]  # [num_random, vocab] (a new tensor)
        rejected = (num_accepted < self.num_drafts).nonzero().squeeze(1)  # [num_rejected]
        if rejected.numel() > 0:
            flat = self.draft_starts[rejected] + num_accepted[rejected]  # [num_rejected]
            rejected_dev = rejected.to(device)
            target = dist[rejected_dev]  # [num_rejected, vocab]
            if draft_probs is None:
                # Point-mass draft: max(0, p - onehot(d)) is p with d removed.
                residual = target.scatter(1, drafts[flat].to(device).unsqueeze(1), 0.0)
            else:
                q = draft_probs[flat.to(draft_probs.device)]  # [num_rejected, vocab]
                residual = (target - q.to(device=device, dtype=target.dtype)).clamp_min_(0.0)
            # p == q everywhere leaves no residual mass (only reachable with inconsistent
            # inputs, e.g. q(d) = 0): fall back to the target itself.
            has_mass = residual.sum(dim=1, keepdim=True) > 0  # [num_rejected, 1]
            dist[rejected_dev] = torch.where(has_mass, residual, target)
        # The exponential race needs no normalisation: argmax(w / E) ~ w / sum(w).
        return random_sample(dist, self.generators, sampler.argmax)  # [num_random]


# --------------------------------------------------------------------------- helpers


def _make_layout(draft_token_ids: list[list[int]]) -> _Layout:
    num_drafts = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
    num_rows = num_drafts + 1  # [num_reqs]
    row_ends = torch.cumsum(num_rows, 0)  # [num_reqs]
    draft_ends = torch.cumsum(num_drafts, 0)  # [num_reqs]
    return _Layout(
        num_drafts=num_drafts,
        row_starts=row_ends - num_rows,
        draft_starts=draft_ends - num_drafts,
        num_rows=int(row_ends[-1]),
        num_draft_rows=int(draft_ends[-1]),
    )


def _check_inputs(
    layout: _Layout,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
) -> None:
    num_reqs = layout.num_drafts.numel()
    if logits.dim() != 2 or logits.shape[0] != layout.num_rows:
        raise ValueError(
            f"logits must be [sum(k_i + 1) = {layout.num_rows}, vocab_size], "
            f"got {tuple(logits.shape)}."
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (
        layout.num_draft_rows,
        logits.shape[1],
    ):
        raise ValueError(
            f"draft_probs must be [sum(k_i) = {layout.num_draft_rows}, {logits.shape[1]}], "
            f"got {tuple(draft_probs.shape)}."
        )
    if len(metadata.output_token_ids) != num_reqs:
        raise ValueError(
            f"metadata has {len(metadata.output_token_ids)} requests, drafts have {num_reqs}."
        )
    if not metadata.all_greedy and metadata.temperature is None:
        raise ValueError("SamplingMetadata.temperature is required unless all_greedy.")


def _expand_metadata(
    metadata: SamplingMetadata, draft_token_ids: list[list[int]], layout: _Layout
) -> SamplingMetadata:
    """Per-request metadata -> per-row metadata: row j of request i sees the history
    `output_token_ids[i] + drafts_i[:j]`. Generators and logprobs are not carried over (the
    rejection sampler handles randomness itself)."""
    repeats = layout.num_drafts + 1  # [num_reqs]

    def per_row(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.repeat_interleave(repeats.to(t.device), dim=0)  # [num_rows, ...]

    counts = repeats.tolist()
    output_token_ids: list[list[int]] = []
    if not metadata.no_penalties or metadata.min_tokens or metadata.bad_words:
        for output, drafts in zip(metadata.output_token_ids, draft_token_ids):
            output = list(output)
            output_token_ids.extend(output + drafts[:j] for j in range(len(drafts) + 1))
    else:
        # Nothing reads the history: share the request's list across its rows.
        for output, count in zip(metadata.output_token_ids, counts):
            output_token_ids.extend([output] * count)
    logit_bias = [bias for bias, count in zip(metadata.logit_bias, counts) for _ in range(count)]
    row_starts = layout.row_starts.tolist()
    min_tokens = {
        row_starts[req] + j: value
        for req, value in metadata.min_tokens.items()
        for j in range(counts[req])
    }
    bad_words = {
        row_starts[req] + j: value
        for req, value in metadata.bad_words.items()
        for j in range(counts[req])
    }
    return SamplingMetadata(
        temperature=per_row(metadata.temperature),
        all_greedy=metadata.all_greedy,
        all_random=metadata.all_random,
        top_p=per_row(metadata.top_p),
        top_k=per_row(metadata.top_k),
        min_p=per_row(metadata.min_p),
        generators={},
        max_num_logprobs=None,
        no_penalties=metadata.no_penalties,
        prompt_token_ids=per_row(metadata.prompt_token_ids),
        output_token_ids=output_token_ids,
        frequency_penalties=per_row(metadata.frequency_penalties),
        presence_penalties=per_row(metadata.presence_penalties),
        repetition_penalties=per_row(metadata.repetition_penalties),
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        allowed_token_ids_mask=per_row(metadata.allowed_token_ids_mask),
        bad_words=bad_words,
    )


def _greedy_requests(metadata: SamplingMetadata, num_reqs: int) -> torch.Tensor:
    """[num_reqs] bool (CPU): True for requests decided by argmax."""
    if metadata.all_greedy:
        return torch.ones(num_reqs, dtype=torch.bool)
    if metadata.all_random:
        return torch.zeros(num_reqs, dtype=torch.bool)
    assert metadata.temperature is not None
    return metadata.temperature.cpu() < GREEDY_EPS  # [num_reqs]


def _target_probs(
    processed: torch.Tensor, row_metadata: SamplingMetadata, rows: torch.Tensor | None
) -> torch.Tensor:
    """Softmax of the tempered, top-k/top-p/min-p filtered `processed` rows (`rows` `[n]`, or
    None for all rows), exactly as `Sampler.sample` computes its random rows. Returns a new
    `[n, vocab_size]` float32 tensor."""

    def select(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or rows is None:
            return t
        return t[rows.to(t.device)]  # [n]

    logits = processed if rows is None else processed[rows.to(processed.device)]
    logits = logits.to(torch.float32)  # [n, vocab_size]
    temperature = select(row_metadata.temperature)
    assert temperature is not None
    scaled = apply_temperature(logits, temperature)  # new tensor, [n, vocab_size]
    apply_top_k_top_p(scaled, select(row_metadata.top_k), select(row_metadata.top_p))
    min_p = select(row_metadata.min_p)
    if min_p is not None:
        apply_min_p(scaled, min_p)
    return scaled.softmax(dim=-1)  # [n, vocab_size]


def _segment_arange(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of `range(starts[i], starts[i] + lengths[i])` over i: `[sum(lengths)]`
    int64. CPU, no Python loop."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths  # [n] start of each segment in the output
    within = torch.arange(total) - torch.repeat_interleave(offsets, lengths)  # [total]
    return torch.repeat_interleave(starts, lengths) + within  # [total]


def _count_accepted(
    accepted: torch.Tensor, draft_req: torch.Tensor, draft_pos: torch.Tensor, num_reqs: int
) -> torch.Tensor:
    """Length of each request's accepted prefix: `[num_reqs]` int64 (CPU) from the per-draft
    `accepted` `[num_draft_rows]` bool, whose draft d is position `draft_pos[d]` of request
    `draft_req[d]`."""
    if accepted.numel() == 0:
        return torch.zeros(num_reqs, dtype=torch.int64)
    max_k = int(draft_pos.max()) + 1
    # Padding stays 0, so the running product stops at the first rejection or at k_i.
    grid = torch.zeros(num_reqs, max_k, dtype=torch.int64)  # [num_reqs, max_k]
    grid[draft_req, draft_pos] = accepted.to(torch.int64)
    return grid.cumprod(dim=1).sum(dim=1)  # [num_reqs]
