"""`/v1/completions`: one or more prompts (text or token ids), answered as one JSON body or,
for a single prompt, as an SSE stream.

Every prompt of a non-streaming request is validated before any runs, so one bad prompt
fails the whole request with a 400 and nothing reaches the engine. Choice `i * n + j` is
output `j` of prompt `i`. With `echo`, a choice's text starts with its prompt (in a stream,
on that choice's first chunk), and with `logprobs` its logprobs start with the prompt
tokens' (the first one's null), as OpenAI's legacy API and vLLM answer: what evaluation
tools (lm-evaluation-harness's `local-completions`) score continuations with. `max_tokens`
0 with `echo` scores the prompt without generating (the engine runs one token, which is
dropped). Built and routed by `api_server.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

from fastapi.responses import Response, StreamingResponse

from pagedinfer.entrypoints.openai.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from pagedinfer.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_room,
    error_response,
    failure,
    finite_logprob,
    json_response,
    prefix_salt,
    prompt_logprobs_body,
    salted,
    to_sampling_params,
    usage_info,
    watched,
)

if TYPE_CHECKING:
    from fastapi import Request

    from pagedinfer.engine.input_processor import PromptType
    from pagedinfer.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedinfer.sampling_params import SamplingParams
    from pagedinfer.tokenizer import Tokenizer

__all__ = ["OpenAIServingCompletion", "completion_logprobs", "echo_logprobs"]


def _position_logprobs(
    entry: dict[int, Logprob], token_id: int, tokenizer: Tokenizer
) -> tuple[float | None, dict[str, float]]:
    """One position's legacy logprobs: the chosen token's, and text -> logprob of the
    top ones (finite, `finite_logprob`)."""
    chosen = finite_logprob(entry[token_id].logprob) if token_id in entry else None
    top = {
        (lp.decoded_token or tokenizer.decode([t])): finite_logprob(lp.logprob)
        for t, lp in entry.items()
    }
    return chosen, top


def completion_logprobs(
    c: CompletionOutput, tokenizer: Tokenizer, offset0: int = 0
) -> CompletionLogprobs | None:
    """The legacy logprobs of `c`'s tokens; offsets count from `offset0` (an echoed prompt)."""
    if c.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = offset0
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = tokenizer.decode([token_id])
        tokens.append(text)
        chosen, alternatives = _position_logprobs(entry, token_id, tokenizer)
        token_logprobs.append(chosen)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )


def echo_logprobs(
    res: RequestOutput, tokenizer: Tokenizer
) -> tuple[CompletionLogprobs, int] | None:
    """The legacy logprobs of `res`'s prompt tokens (the first token's null: nothing
    predicts it) and the length of their text; None without prompt logprobs."""
    if res.prompt_logprobs is None:
        return None
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for token_id, entry in zip(res.prompt_token_ids, res.prompt_logprobs):
        text = tokenizer.decode([token_id])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, alternatives = _position_logprobs(entry, token_id, tokenizer)
        out["token_logprobs"].append(chosen)
        out["top_logprobs"].append(alternatives)
    return out, offset


def _joined(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    if then is None:
        return first
    return CompletionLogprobs(
        tokens=first["tokens"] + then["tokens"],
        token_logprobs=first["token_logprobs"] + then["token_logprobs"],
        top_logprobs=first["top_logprobs"] + then["top_logprobs"],
        text_offset=first["text_offset"] + then["text_offset"],
    )


class OpenAIServingCompletion(OpenAIServing):
    """Handles `/v1/completions`."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        if (refused := self.refuse_kv_transfer_params(request)) is not None:
            return refused
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[assignment]
        if not prompts:
            return error_response(400, "prompt: at least one prompt is needed", "prompt")
        if (too_many := self.check_sequences(len(prompts), request.n)) is not None:
            return too_many
        if request.stream and len(prompts) > 1:
            return error_response(400, "prompt: streaming takes one prompt", "prompt")
        if request.kv_transfer_params is not None and len(prompts) > 1:
            return error_response(400, "prompt: kv_transfer_params takes one prompt", "prompt")
        score_only = request.max_tokens == 0
        if score_only and (not request.echo or request.stream):
            return error_response(
                400, "max_tokens: 0 scores an echoed prompt: it needs echo and no stream",
                "max_tokens",
            )  # fmt: skip
        # Echoed logprobs cover the prompt too, with as many top entries as the rest.
        prompt_k = request.logprobs if request.echo and request.logprobs is not None else None
        if request.prompt_logprobs is not None:
            prompt_k = max(prompt_k or 0, request.prompt_logprobs)
        max_tokens = 1 if score_only else request.max_tokens or 16
        try:
            params = to_sampling_params(request, max_tokens, request.logprobs, prompt_k)
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        salt = prefix_salt(raw_request, request.cache_salt)
        try:
            texts = [p for p in prompts if isinstance(p, str)]
            encoded = iter(
                await self.encode_prompts(texts, params.truncate_prompt_tokens is not None)
            )
            inputs: list[PromptType] = [
                salted(
                    {"prompt": p, "prompt_token_ids": next(encoded)}
                    if isinstance(p, str)
                    else {"prompt_token_ids": p},
                    salt,
                )
                for p in prompts
            ]
            # Every prompt validated before any runs: a bad one fails the request alone.
            for i, prompt in enumerate(inputs):
                check, _ = self.engine_client.input_processor.process(
                    f"{request_id}-check-{i}", prompt, params
                )
                room_needed = None if score_only else params.max_tokens
                check_room(
                    len(check.prompt_token_ids), room_needed, self.engine_client.max_model_len
                )
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc))
        if request.stream:
            return await self._stream(request, raw_request, inputs[0], params, request_id)
        results = await watched(raw_request, self._run_all(inputs, params, request_id))
        if isinstance(results, Response):
            return results
        if (failed := failure(results)) is not None:
            return error_response(400, failed)
        return json_response(self._response(request, params, results, request_id))

    async def _run_all(
        self, inputs: list[PromptType], params: SamplingParams, request_id: str
    ) -> list[RequestOutput]:
        """The final outputs of all prompts (validated by the caller), run concurrently
        (request ids `<id>-<i>`)."""
        return await asyncio.gather(
            *(self._final(p, params, f"{request_id}-{i}") for i, p in enumerate(inputs))
        )

    async def _final(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> RequestOutput:
        """The one output of a FINAL_ONLY request."""
        final = None
        async for out in self.engine_client.generate(prompt, params, request_id):
            final = out
        assert final is not None
        return final

    def _response(
        self,
        request: CompletionRequest,
        params: SamplingParams,
        results: list[RequestOutput],
        request_id: str,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        prompt_tokens, completion_tokens, cached, external = 0, 0, 0, 0
        for i, res in enumerate(results):
            prompt_tokens += len(res.prompt_token_ids)
            cached += res.num_cached_tokens
            external += res.num_external_cached_tokens
            prefix = ""
            echoed = None
            if request.echo:
                prefix = res.prompt or self.tokenizer.decode(res.prompt_token_ids)
                if request.logprobs is not None:
                    echoed = echo_logprobs(res, self.tokenizer)
            score_only = request.max_tokens == 0
            for c in res.outputs:
                generated = None if score_only else completion_logprobs(
                    c, self.tokenizer, len(prefix) if echoed is None else echoed[1]
                )  # fmt: skip
                logprobs = generated if echoed is None else _joined(echoed[0], generated)
                completion_tokens += 0 if score_only else len(c.token_ids)
                choice = CompletionResponseChoice(
                    index=i * params.n + c.index,
                    text=prefix + ("" if score_only else c.text),
                    logprobs=logprobs,
                    finish_reason="length" if score_only else c.finish_reason,
                    stop_reason=None if score_only else c.stop_reason,
                )
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = (
                        prompt_logprobs_body(res.prompt_logprobs, self.tokenizer) or []
                    )
                choices.append(choice)
        response = CompletionResponse(
            id=request_id,
            object="text_completion",
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=usage_info(prompt_tokens, completion_tokens, cached, external),
        )
        # One prompt per request in disaggregated serving (the proxy sends one).
        if len(results) == 1 and results[0].kv_transfer_params is not None:
            response["kv_transfer_params"] = results[0].kv_transfer_params
        return response

    async def _stream(
        self,
        request: CompletionRequest,
        raw_request: Request,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
    ) -> Response:
        """The SSE response, once the first output is there (a bad prompt is still a 400)."""
        gen = self.engine_client.generate(prompt, params, request_id)
        # Watched: a decode instance may wait on a KV transfer before the first token.
        first = await watched(raw_request, gen.__anext__())
        if isinstance(first, Response):
            return first
        created = int(time.time())
        echoed: set[int] = set()

        def choice(out: RequestOutput, c: CompletionOutput) -> list[CompletionResponseChoice]:
            text = c.text
            logprobs = completion_logprobs(c, self.tokenizer)
            first_chunk = c.index not in echoed
            if request.echo and first_chunk:
                text = (out.prompt or self.tokenizer.decode(out.prompt_token_ids)) + text
                if request.logprobs is not None and (prompt := echo_logprobs(out, self.tokenizer)):
                    # Offsets of the generated tokens count from the end of the prompt.
                    logprobs = _joined(prompt[0], completion_logprobs(c, self.tokenizer, prompt[1]))
            echoed.add(c.index)
            body = CompletionResponseChoice(
                index=c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            if request.prompt_logprobs is not None and first_chunk:
                body["prompt_logprobs"] = (
                    prompt_logprobs_body(out.prompt_logprobs, self.tokenizer) or []
                )
            return [body]

        def chunk(choices: list[CompletionResponseChoice]) -> CompletionStreamResponse:
            return CompletionStreamResponse(
                id=request_id,
                object="text_completion",
                created=created,
                model=self.model_name,
                choices=choices,
            )

        events = self.stream_events(
            first, gen, choice, chunk, request.include_usage, request.continuous_usage
        )
        return StreamingResponse(events, media_type="text/event-stream")
