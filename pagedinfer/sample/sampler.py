"""Turns one step's logits into sampled token ids (and optional logprobs).

Role: `Sampler.forward(logits, metadata)` is called by the model runner once per step with
the last-position logits of every request that samples this step (`[num_reqs, vocab_size]`,
row i = request i in scheduler order) and the `SamplingMetadata` built from the persistent
batch. `compute_prompt_logprobs` is called by the runner for requests asking for prompt
logprobs. The helpers below are public so that each stage can be tested on its own.

Order of operations (vLLM V1 semantics):
  1. logprobs of the RAW logits (log_softmax of the input) when `max_num_logprobs` is set;
  2. allowed_token_ids mask, then bad_words, 3. min_tokens stop-id mask, 4. logit_bias,
  5. penalties (repetition over prompt+output, then frequency and presence over output);
  6. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
  7. random rows: divide by temperature (clamped to >= 0.01), top-k, top-p, min-p, then
     sample by the exponential race `argmax(probs / q)`, `q ~ Exp(1)`.

Invariants:
  - `Sampler.forward` never modifies the caller's `logits` tensor: it works on a private copy
    as soon as a stage needs to write. The `apply_*` helpers, in contrast, modify the tensor
    they are given IN PLACE and return it (documented on each); `apply_temperature` and
    `compute_logprobs` return new tensors.
  - A row with a generator in `metadata.generators` draws its noise from that generator only,
    exactly `vocab_size` exponentials per step, so a seeded request gives the same tokens
    whatever else is in the batch and wherever its row is. Unseeded rows share one batched
    draw from the default generator.
  - Filtering keeps ties: top-k keeps every token whose logit is >= the k-th largest value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from pagedinfer.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata

__all__ = [
    "GREEDY_EPS",
    "LOGPROBS_MODES",
    "LogprobsMode",
    "MIN_TEMPERATURE",
    "Sampler",
    "apply_allowed_token_ids",
    "apply_bad_words",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "compute_logprobs",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "random_sample",
]

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)

GREEDY_EPS = 1e-5
"""Rows whose temperature is below this are sampled greedily."""
MIN_TEMPERATURE = 0.01
"""Non-greedy temperatures are raised to at least this, for numerical safety."""

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- logprobs


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary, in float32. Returns a new tensor."""
    return logits.to(torch.float32).log_softmax(dim=-1)  # [num_rows, vocab_size]


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Pack the logprob of `token_ids` (column 0) and the top `num_logprobs` (columns 1..k).

    `logprobs` is `[num_rows, vocab_size]`, `token_ids` `[num_rows]`. `num_logprobs` of 0
    gives only the selected column; -1 or anything above the vocab size means all tokens.
    The rank of the selected token is 1 + the number of tokens with a strictly greater
    logprob.
    """
    vocab_size = logprobs.shape[-1]
    if num_logprobs < 0 or num_logprobs > vocab_size:
        num_logprobs = vocab_size
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [num_rows]
    if num_logprobs > 0:
        top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)  # [num_rows, k]
        ids = torch.cat([token_ids, top_ids], dim=-1)  # [num_rows, k + 1]
        values = torch.cat([token_logprobs, top_logprobs], dim=-1)  # [num_rows, k + 1]
    else:
        ids, values = token_ids, token_logprobs
    return LogprobsTensors(
        logprob_token_ids=ids,
        logprobs=values.to(torch.float32),
        selected_token_ranks=ranks.to(torch.int64),
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of the prompt: row t of `logits` `[num_tokens, vocab_size]` predicts
    `target_token_ids[t]` (the next prompt token). Raw log_softmax, same layout as
    `gather_logprobs`. Does not modify `logits`."""
    return gather_logprobs(compute_logprobs(logits), num_logprobs, target_token_ids)


# --------------------------------------------------------------------------- processors


def apply_allowed_token_ids(logits: torch.Tensor, disallowed_mask: torch.Tensor) -> torch.Tensor:
    """IN PLACE: -inf wherever `disallowed_mask` (`[num_reqs, vocab_size]` bool) is True."""
    return logits.masked_fill_(disallowed_mask.to(logits.device), _NEG_INF)


def apply_bad_words(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    bad_words: dict[int, list[list[int]]],
) -> torch.Tensor:
    """IN PLACE: for each row's banned sequences, -inf on the last token wherever the
    output ends with the ones before it (a one-token word: always)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, sequences in bad_words.items():
        output = output_token_ids[row]
        for seq in sequences:
            prefix = seq[:-1]
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
                rows.append(row)
                cols.append(seq[-1])
    if rows:
        logits[_as_index(rows, logits), _as_index(cols, logits)] = _NEG_INF
    return logits


def apply_min_tokens(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    min_tokens: dict[int, tuple[int, set[int]]],
) -> torch.Tensor:
    """IN PLACE: for each row in `min_tokens` whose output is still shorter than its
    min_tokens, set its stop token ids to -inf."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_toks, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) < min_toks:
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        logits[_as_index(rows, logits), _as_index(cols, logits)] = _NEG_INF
    return logits


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: list[dict[int, float] | None]
) -> torch.Tensor:
    """IN PLACE: add `logit_bias[row][token]` to `logits[row, token]`."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    if rows:
        values = torch.tensor(vals, dtype=logits.dtype, device=logits.device)  # [n_bias]
        logits.index_put_(
            (_as_index(rows, logits), _as_index(cols, logits)), values, accumulate=True
        )
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """IN PLACE: repetition, then frequency and presence penalties.

    - repetition (`[num_reqs]`, 1.0 = off): for tokens seen in the prompt or the output, a
      positive logit is divided by the penalty, a non-positive one multiplied by it;
    - frequency (`[num_reqs]`): subtract penalty * (count of the token in the output);
    - presence (`[num_reqs]`): subtract penalty once if the token occurs in the output.
    `prompt_token_ids` is `[num_reqs, max_prompt_len]` padded with vocab_size (ignored).
    Any penalty may be None (off for every row). Token ids must lie in [0, vocab_size].
    """
    num_reqs, vocab_size = logits.shape
    device = logits.device
    output = _pad_token_lists(output_token_ids, vocab_size, device)  # [num_reqs, max_out]
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, output, torch.ones_like(output))
    counts = counts[:, :vocab_size]  # [num_reqs, vocab_size]
    in_output = counts > 0  # [num_reqs, vocab_size]

    if repetition_penalties is not None:
        seen = in_output
        if prompt_token_ids is not None:
            prompt = prompt_token_ids.to(device=device, dtype=torch.int64)
            in_prompt = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=device)
            in_prompt.scatter_(1, prompt, True)
            seen = seen | in_prompt[:, :vocab_size]  # [num_reqs, vocab_size]
        rep = repetition_penalties.to(device=device, dtype=logits.dtype).unsqueeze(1)
        rep = rep.expand(num_reqs, vocab_size)  # [num_reqs, vocab_size]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if frequency_penalties is not None:
        freq = frequency_penalties.to(device=device, dtype=logits.dtype).unsqueeze(1)
        logits.sub_(freq * counts.to(logits.dtype))
    if presence_penalties is not None:
        pres = presence_penalties.to(device=device, dtype=logits.dtype).unsqueeze(1)
        logits.sub_(pres * in_output.to(logits.dtype))
    return logits


# --------------------------------------------------------------------------- sampling


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Return a NEW tensor `logits / T` per row. Greedy rows (T < 1e-5) are divided by 1
    (their random sample is discarded); other temperatures are raised to >= 0.01."""
    temp = temperature.to(device=logits.device, dtype=logits.dtype)  # [num_reqs]
    temp = torch.where(temp < GREEDY_EPS, torch.ones_like(temp), temp.clamp_min(MIN_TEMPERATURE))
    return logits / temp.unsqueeze(1)  # [num_reqs, vocab_size]


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """IN PLACE: -inf outside each row's top-k (ties with the k-th value kept) and outside
    its top-p nucleus (the smallest set of most likely tokens whose mass reaches p; the top
    token is always kept). `k` is `[num_reqs]` int (0 = off), `p` `[num_reqs]` float (1 =
    off); either may be None. Top-k alone uses `torch.topk`; top-p sorts once."""
    vocab_size = logits.shape[-1]
    if k is not None:
        k = k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k <= 0) | (k > vocab_size), torch.full_like(k, vocab_size), k)
        if bool((k >= vocab_size).all()):
            k = None
    if p is None:
        if k is None:
            return logits
        max_k = int(k.max())
        top_values = torch.topk(logits, max_k, dim=-1).values  # [num_reqs, max_k]
        kth = top_values.gather(1, (k.clamp_max(max_k) - 1).unsqueeze(1))  # [num_reqs, 1]
        # Rows with top-k off (k == vocab_size) keep everything.
        kth = kth.masked_fill_((k >= vocab_size).unsqueeze(1), _NEG_INF)
        return logits.masked_fill_(logits < kth, _NEG_INF)

    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending, [num_reqs, vocab_size]
    if k is not None:
        # The k-th largest value sits at position vocab_size - k; k == vocab_size -> min.
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_reqs, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)  # [num_reqs, vocab_size]
    cum = probs.cumsum(dim=-1)  # [num_reqs, vocab_size]
    p = p.to(device=logits.device, dtype=cum.dtype).unsqueeze(1)  # [num_reqs, 1]
    # Drop a token when the mass at or below it is <= 1 - p, i.e. the mass strictly above
    # it already reaches p. The most likely token (last column) always stays.
    drop_sorted = cum <= 1 - p  # [num_reqs, vocab_size]
    drop_sorted[:, -1] = False
    if k is not None:
        drop_sorted |= sorted_logits == _NEG_INF
    drop = torch.empty_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
    return logits.masked_fill_(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """IN PLACE: -inf on tokens whose probability is below min_p times the top token's
    probability (`[num_reqs]` min_p; 0 = off). Computed in log space:
    p_i / p_max = exp(l_i - l_max), so no softmax is needed."""
    min_p = min_p.to(device=logits.device, dtype=logits.dtype)  # [num_reqs]
    threshold = logits.amax(dim=-1) + torch.log(min_p)  # [num_reqs]; log(0) = -inf: off
    return logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sample one token per row by the exponential race `argmax(probs / q)`, q ~ Exp(1).

    Rows listed in `generators` draw their `vocab_size` exponentials from their own
    generator only; the other rows share one batched draw from the default generator.
    Returns `[num_reqs]` int64. Does not modify `probs`.
    """
    num_reqs = probs.shape[0]
    q = torch.empty_like(probs, dtype=torch.float32)  # [num_reqs, vocab_size]
    if len(generators) < num_reqs:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # An exact 0 from the draw would turn 0 / 0 into NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    race = probs / q  # [num_reqs, vocab_size]
    return race.argmax(dim=-1) if argmax is None else argmax(race)  # [num_reqs] int64


# --------------------------------------------------------------------------- sampler


class Sampler(torch.nn.Module):
    """Stateless sampler; see the module docstring for the order of operations.

    `argmax`: an optional row-wise argmax with torch's semantics (first maximum; NaN wins)
    for [rows, vocab] tensors, e.g. the C++ `argmax_rows`: torch's CPU argmax over the last
    dimension costs ~150-200 us per 49k-wide row, a sizeable part of a large decode step.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        logprobs_mode: LogprobsMode = "raw_logprobs",
    ) -> None:
        super().__init__()
        self._argmax = argmax
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: not one of {LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] -> [rows] int64."""
        if self._argmax is None or x.stride(-1) != 1:
            return x.argmax(dim=-1).to(torch.int64)
        return self._argmax(x)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """`logits` `[num_reqs, vocab_size]` (not modified). Returns the sampled ids and,
        when `metadata.max_num_logprobs` is not None, their logprobs (or logits) as
        `logprobs_mode` says: of the raw distribution, or of the processed one the token
        was drawn from."""
        num_logprobs = metadata.max_num_logprobs
        mode = self.logprobs_mode
        values = None
        if num_logprobs is not None and mode == "raw_logprobs":
            values = compute_logprobs(logits)
        elif num_logprobs is not None and mode == "raw_logits":
            values = logits.to(torch.float32)  # the stages below write only to copies

        logits = self.apply_logits_processors(logits, metadata)
        if num_logprobs is not None and values is None:
            sampled, processed = self.sample(logits, metadata, keep_processed=True)
            assert processed is not None
            values = processed if mode == "processed_logits" else processed.log_softmax(dim=-1)
        else:
            sampled, _ = self.sample(logits, metadata)  # [num_reqs]

        logprobs_tensors = None
        if values is not None and num_logprobs is not None:
            logprobs_tensors = gather_logprobs(values, num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Stages 2-5 (allowed ids, min_tokens, logit_bias, penalties) on a float32 copy of
        `logits`; when no stage applies, returns `logits` as float32 without copying it if it
        already is, or untouched in its own dtype for an all-greedy batch (argmax needs no
        conversion); the caller must then not write to the result."""
        use_bias = any(bias for bias in metadata.logit_bias)
        needs_write = (
            metadata.allowed_token_ids_mask is not None
            or bool(metadata.bad_words)
            or bool(metadata.min_tokens)
            or use_bias
            or not metadata.no_penalties
        )
        if not needs_write:
            return logits if metadata.all_greedy else logits.to(torch.float32)
        if logits.dtype == torch.float32:
            logits = logits.clone()  # [num_reqs, vocab_size]
        else:
            logits = logits.to(torch.float32)  # [num_reqs, vocab_size]

        if metadata.allowed_token_ids_mask is not None:
            apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
        if metadata.bad_words:
            apply_bad_words(logits, metadata.output_token_ids, metadata.bad_words)
        if metadata.min_tokens:
            apply_min_tokens(logits, metadata.output_token_ids, metadata.min_tokens)
        if use_bias:
            apply_logit_bias(logits, metadata.logit_bias)
        if not metadata.no_penalties:
            apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, keep_processed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stages 6-7 on processed `logits` (not modified). Returns `[num_reqs]` int64 and,
        with `keep_processed`, the float32 logits each row was decided on (greedy rows:
        `logits`; random rows: after temperature, top-k, top-p and min-p, -inf where
        filtered), else None."""
        if metadata.all_greedy:
            return self.argmax(logits), logits.to(torch.float32) if keep_processed else None
        if metadata.temperature is None:
            raise ValueError("SamplingMetadata.temperature is required unless all_greedy.")
        greedy = None if metadata.all_random else self.argmax(logits)

        scaled = apply_temperature(logits, metadata.temperature)  # new, [num_reqs, vocab]
        apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            apply_min_p(scaled, metadata.min_p)
        probs = scaled.softmax(dim=-1)  # [num_reqs, vocab_size]
        sampled = random_sample(probs, metadata.generators, self.argmax)  # [num_reqs]
        if greedy is None:
            return sampled, scaled if keep_processed else None
        is_greedy = metadata.temperature.to(logits.device) < GREEDY_EPS  # [num_reqs]
        processed = None
        if keep_processed:
            processed = torch.where(is_greedy.unsqueeze(-1), logits.to(torch.float32), scaled)
        return torch.where(is_greedy, greedy, sampled), processed


# --------------------------------------------------------------------------- helpers


def _as_index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)  # [len(values)]


def _pad_token_lists(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad per-row token lists with `pad` into `[num_rows, max(1, max_len)]` int64."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    width = max(width, 1)
    padded = [list(tokens) + [pad] * (width - len(tokens)) for tokens in token_lists]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(
        len(token_lists), width
    )  # [num_rows, width]
