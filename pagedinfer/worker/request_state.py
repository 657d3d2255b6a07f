"""The model runner's per-request state, and the sampling metadata built from it.

`CachedRequestState` is what the runner remembers of a live request between steps: its
tokens (prompt and output, also as a growing numpy buffer for the n-gram search), block ids,
computed-token count, seeded generator and prompt logprobs gathered chunk by chunk. The runner
creates and updates it from each `SchedulerOutput`; the draft proposers read it (typing-only
imports in `spec_decode/`, which never imports the worker at runtime).
`build_sampling_metadata` turns the states of a step's sampling requests into the sampler's
`SamplingMetadata` (vLLM's `InputBatch` does both jobs).

Callers: `worker/model_runner.py`; `spec_decode/proposer.py` (types).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sample.metadata import SamplingMetadata
from pagedinfer.sampling_params import GREEDY_EPS

if TYPE_CHECKING:
    from pagedinfer.sample.metadata import LogprobsTensors
    from pagedinfer.sampling_params import SamplingParams

__all__ = ["CachedRequestState", "build_sampling_metadata"]


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
    # A pooling request: how to pool, and (mean pooling) the float32 sum of the hidden
    # states of the prompt chunks computed so far.
    pooling_params: PoolingParams | None = None
    pool_sum: torch.Tensor | None = None
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


def build_sampling_metadata(states: list[CachedRequestState], vocab_size: int) -> SamplingMetadata:
    """The sampler's inputs for `states` (row i: the i-th request that samples this step).
    A parameter no request uses stays None, so the all-greedy, penalty-free batch costs one
    argmax."""
    params = [s.sampling_params for s in states]
    temps = [p.temperature for p in params]
    all_greedy = all(t < GREEDY_EPS for t in temps)
    all_random = all(t >= GREEDY_EPS for t in temps)
    top_ps = [p.top_p for p in params]
    top_ks = [p.top_k for p in params]
    min_ps = [p.min_p for p in params]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    max_num_logprobs = None
    if wanted:
        max_num_logprobs = max(vocab_size if k == -1 else k for k in wanted)
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    rep = [p.repetition_penalty for p in params]
    no_penalties = (
        all(f == 0 for f in freq) and all(p == 0 for p in pres) and all(r == 1 for r in rep)
    )
    prompt_ids = None
    if any(r != 1 for r in rep):
        max_len = max(len(s.prompt_token_ids) for s in states)
        prompt_ids = torch.full((len(states), max_len), vocab_size, dtype=torch.int64)
        for i, s in enumerate(states):
            prompt_ids[i, : len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids)
    allowed_mask = None
    if any(p.allowed_token_ids is not None for p in params):
        allowed_mask = torch.zeros(len(states), vocab_size, dtype=torch.bool)
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
        bad_words={i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids},
    )
