"""`/v1/chat/completions`: the messages rendered with the model's chat template, answered as
one JSON body or as an SSE stream of deltas.

A message that the template cannot render (or a content part that is not text) is a 400
with `param` "messages". In a stream, each choice's first delta carries `role`. Logprobs, when
asked for, list every generated token with its `top_logprobs` best alternatives. Built and
routed by `api_server.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, cast

from fastapi.responses import Response, StreamingResponse

from pagedinfer.entrypoints.openai.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatTopLogprob,
    DeltaMessage,
)
from pagedinfer.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_room,
    error_response,
    failure,
    json_response,
    prompt_logprobs_body,
    template_message,
    to_sampling_params,
    usage_info,
    watched,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from fastapi import Request

    from pagedinfer.outputs import CompletionOutput, RequestOutput
    from pagedinfer.tokenizer import Tokenizer

__all__ = ["OpenAIServingChat", "chat_logprobs"]


def chat_logprobs(
    c: CompletionOutput, tokenizer: Tokenizer, top_n: int
) -> ChatCompletionLogprobs | None:
    """Chat logprobs of `c`'s tokens, each with its `top_n` most likely alternatives."""
    if c.logprobs is None:
        return None
    content: list[ChatLogprobToken] = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = tokenizer.decode([token_id])
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        top: list[ChatTopLogprob] = []
        for t, lp in ranked:
            top_text = lp.decoded_token or tokenizer.decode([t])
            top.append(
                ChatTopLogprob(token=top_text, logprob=lp.logprob, bytes=list(top_text.encode()))
            )
        content.append(
            ChatLogprobToken(
                token=text,
                logprob=entry[token_id].logprob if token_id in entry else None,
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    """Handles `/v1/chat/completions`."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        try:
            messages = [template_message(m) for m in request.messages]
            prompt_ids = cast(
                "list[int]",
                self.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    tokenize=True,
                    chat_template=self.chat_template,
                ),
            )
            top_n = request.top_logprobs or 0
            params = to_sampling_params(
                request,
                request.max_completion_tokens or request.max_tokens,
                top_n if request.logprobs else None,
            )
            check_room(len(prompt_ids), params.max_tokens, self.engine_client.max_model_len)
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.engine_client.generate({"prompt_token_ids": prompt_ids}, params, request_id)
        created = int(time.time())
        if request.stream:
            first = await watched(raw_request, gen.__anext__())
            if isinstance(first, Response):
                return first
            events = self._stream(request, first, gen, request_id, created, top_n)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            final = await watched(raw_request, _last(gen))
        finally:
            await gen.aclose()
        if isinstance(final, Response):
            return final
        if (failed := failure([final])) is not None:
            return error_response(400, failed)
        return json_response(self._response(request, final, request_id, created, top_n))

    def _response(
        self,
        request: ChatCompletionRequest,
        final: RequestOutput,
        request_id: str,
        created: int,
        top_n: int,
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=chat_logprobs(c, self.tokenizer, top_n) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = ChatCompletionResponse(
            id=request_id,
            object="chat.completion",
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(
                len(final.prompt_token_ids),
                completion_tokens,
                final.num_cached_tokens,
                final.num_external_cached_tokens,
            ),
        )
        if request.prompt_logprobs is not None:
            body = prompt_logprobs_body(final.prompt_logprobs, self.tokenizer)
            response["prompt_logprobs"] = body or []
        if final.kv_transfer_params is not None:
            response["kv_transfer_params"] = final.kv_transfer_params
        return response

    def _stream(
        self,
        request: ChatCompletionRequest,
        first: RequestOutput,
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        created: int,
        top_n: int,
    ) -> AsyncGenerator[str, None]:
        started: set[int] = set()

        def choice(out: RequestOutput, c: CompletionOutput) -> ChatCompletionStreamChoice:
            delta = DeltaMessage(content=c.text)
            if c.index not in started:
                started.add(c.index)
                delta["role"] = "assistant"
            return ChatCompletionStreamChoice(
                index=c.index,
                delta=delta,
                logprobs=chat_logprobs(c, self.tokenizer, top_n) if request.logprobs else None,
                finish_reason=c.finish_reason,
            )

        def chunk(choices: list[ChatCompletionStreamChoice]) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=choices,
            )

        return self.stream_events(first, gen, choice, chunk, request.include_usage)


async def _last(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The last output of `gen` (not streamed, FINAL_ONLY: usually its first)."""
    final = None
    async for out in gen:
        final = out
    assert final is not None
    return final
