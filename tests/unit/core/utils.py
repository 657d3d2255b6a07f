"""Factories for scheduler tests: no model runs; outputs are hand-built ModelRunnerOutputs."""

from __future__ import annotations

from pagedinfer.config import CacheConfig, SchedulerConfig
from pagedinfer.core.kv_cache_utils import BlockHasher, get_hash_fn
from pagedinfer.core.request import Request
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedinfer.core.scheduler import Scheduler
from pagedinfer.sampling_params import SamplingParams

EOS = 0


def create_scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    step_latency_target_ms: float = 0.0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,  # type: ignore[arg-type]
            step_latency_target_ms=step_latency_target_ms,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    start: int = 0,
    prompt_token_ids: list[int] | None = None,
    block_hasher: BlockHasher | None = None,
    cache_salt: str | None = None,
    **params: object,
) -> list[Request]:
    """Requests with prompt [100 + i] * num_tokens (or the given prompt); with a
    block_hasher they take part in prefix caching."""
    out = []
    for i in range(start, start + num_requests):
        sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        sp.update_from_eos((EOS,))
        prompt = list(prompt_token_ids) if prompt_token_ids is not None else [100 + i] * num_tokens
        out.append(
            Request(
                request_id=str(i),
                prompt_token_ids=prompt,
                sampling_params=sp,
                eos_token_id=EOS,
                arrival_time=float(i),
                cache_salt=cache_salt,
                block_hasher=block_hasher,
            )
        )
    return out


def make_hasher(block_size: int = 16, algo: str = "sha256") -> BlockHasher:
    return BlockHasher(block_size, get_hash_fn(algo))


def make_output(so: SchedulerOutput, scheduler: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Every request whose chunk reaches the end of its known tokens samples `token`."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


class ScriptedGrammar:
    """A stand-in grammar that takes exactly the tokens of `script`, in order, then is
    complete (all or nothing per call, as the real backends)."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.pos = script, 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.script[self.pos : self.pos + len(tokens)] != tokens:
            return False
        self.pos += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        n = 0
        while n < len(tokens) and self.pos + n < len(self.script):
            if self.script[self.pos + n] != tokens[n]:
                break
            n += 1
        return tokens[:n]

    def is_terminated(self) -> bool:
        return self.pos == len(self.script)


def add_guided_request(scheduler: Scheduler, request: Request, grammar: ScriptedGrammar) -> None:
    """Give `scheduler` a structured-output manager and add `request`, already compiled to
    `grammar`."""
    from pagedinfer.config import EngineConfig
    from pagedinfer.sampling_params import StructuredOutputsParams
    from pagedinfer.structured_output.manager import (
        StructuredOutputManager,
        StructuredOutputRequest,
        spec_key,
    )

    if scheduler.structured_output_manager is None:
        scheduler.structured_output_manager = StructuredOutputManager(
            EngineConfig(), 1000, scheduler.max_num_running_reqs
        )
    params = StructuredOutputsParams(regex="x")
    request.structured_output_request = StructuredOutputRequest(
        params,
        "xgrammar",
        spec_key(params),
        grammar=grammar,  # type: ignore[arg-type]
    )
    scheduler.add_request(request)
