"""`/v1/chat/completions`: the messages rendered with the model's chat template, answered as
one JSON body or as an SSE stream of deltas.

A message that the template cannot render (or a content part that is not text) is a 400
with `param` "messages". In a stream, each choice's first delta carries `role`. Logprobs, when
asked for, list every generated token with its `top_logprobs` best alternatives. Tools:
`tool_choice.py` decides what a request's tools do, a `ToolParser` per choice reads its
calls (the same stream, streamed or not), and a stream sends each call as two deltas, its
index, id and name, then its arguments. Reasoning (`--reasoning-parser`, `reasoning.py`):
each choice's text goes through a `ReasoningStream` first; its reasoning parts become
`reasoning` (and `reasoning_content`), its content parts go on to the tool parser, and
guided decoding starts after the block (`StructuredOutputsParams.reasoning_end`). Built and
routed by `api_server.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
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
    DeltaToolCall,
    FunctionCallBody,
    ToolCallBody,
)
from pagedinfer.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    split_reasoning,
)
from pagedinfer.entrypoints.openai.serving_engine import (
    DEFAULT_OPTIONS,
    EngineClient,
    OpenAIServing,
    ServingOptions,
    check_room,
    check_text_fits,
    error_response,
    failure,
    finite_logprob,
    json_response,
    prefix_salt,
    prompt_logprobs_body,
    salted,
    template_message,
    template_variables,
    to_sampling_params,
    usage_info,
    watched,
)
from pagedinfer.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from pagedinfer.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    ToolCallStream,
    parse_tool_calls,
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
                ChatTopLogprob(
                    token=top_text,
                    logprob=finite_logprob(lp.logprob),
                    bytes=list(top_text.encode()),
                )
            )
        content.append(
            ChatLogprobToken(
                token=text,
                logprob=finite_logprob(entry[token_id].logprob) if token_id in entry else None,
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogprobs(content=content)


def _tool_call_body(call: FunctionCall) -> ToolCallBody:
    return ToolCallBody(
        id=f"chatcmpl-tool-{uuid.uuid4().hex}",
        type="function",
        function=FunctionCallBody(name=call.name, arguments=call.arguments),
    )


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended with tool calls says so (not when it ran out of tokens)."""
    return "tool_calls" if called and reason == "stop" else reason


class OpenAIServingChat(OpenAIServing):
    """Handles `/v1/chat/completions`."""

    def __init__(
        self,
        engine_client: EngineClient,
        model_name: str,
        chat_template: str | None = None,
        *,
        tool_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        options: ServingOptions = DEFAULT_OPTIONS,
    ) -> None:
        super().__init__(engine_client, model_name, chat_template, options=options)
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool_parser!r}: not one of {', '.join(TOOL_PARSERS)}"
            )
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {reasoning_parser!r}: not one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning: ReasoningParser | None = (
            None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        if (refused := self.refuse_kv_transfer_params(request)) is not None:
            return refused
        try:
            plan = plan_tools(request, self.tool_parser, self.enable_auto_tool_choice)
        except ValueError as exc:
            return error_response(400, str(exc), "tool_choice")
        try:
            messages = [template_message(m) for m in request.messages]
            if request.truncate_prompt_tokens is None:
                chars = sum(
                    len(m["content"]) for m in messages if isinstance(m.get("content"), str)
                )
                check_text_fits(chars, self.engine_client.max_model_len,
                                self.tokenizer.max_token_chars, "messages")  # fmt: skip
            # Templating and tokenizing off the event loop: the streams on it keep flowing.
            prompt_ids = await asyncio.to_thread(self._render, messages, plan, request)
            top_n = request.top_logprobs or 0
            params = to_sampling_params(
                request,
                request.max_completion_tokens or request.max_tokens,
                top_n if request.logprobs else None,
                structured_outputs=plan.structured_outputs,
            )
            if plan.keep_special_tokens:
                params.skip_special_tokens = False
            max_len = self.engine_client.max_model_len
            keep = params.truncate_prompt_tokens  # the engine truncates; count what it keeps
            prompt_len = len(prompt_ids)
            if keep is not None:
                prompt_len = min(prompt_len, max_len if keep == -1 else keep)
            check_room(prompt_len, params.max_tokens, max_len)
            in_reasoning = self._starts_in_reasoning(prompt_ids)
            if in_reasoning and params.structured_outputs is not None:
                assert self.reasoning is not None
                params.structured_outputs = msgspec.structs.replace(
                    params.structured_outputs, reasoning_end=self.reasoning.end
                )
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = salted(
            {"prompt_token_ids": prompt_ids}, prefix_salt(raw_request, request.cache_salt)
        )
        gen = self.engine_client.generate(prompt, params, request_id)
        created = int(time.time())
        if request.stream:
            first = await watched(raw_request, gen.__anext__())
            if isinstance(first, Response):
                return first
            events = self._stream(
                request, plan, in_reasoning, first, gen, request_id, created, top_n
            )
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            final = await watched(raw_request, _last(gen))
        finally:
            await gen.aclose()
        if isinstance(final, Response):
            return final
        if (failed := failure([final])) is not None:
            return error_response(400, failed)
        return json_response(
            self._response(request, plan, in_reasoning, final, request_id, created, top_n)
        )

    def _starts_in_reasoning(self, prompt_ids: list[int]) -> bool | None:
        """Whether the answer starts inside a reasoning block (`ReasoningParser.
        starts_in_reasoning` on the prompt's end); False without a reasoning parser."""
        if self.reasoning is None:
            return False
        tail = self.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
        return self.reasoning.starts_in_reasoning(tail)

    def _render(
        self, messages: list[dict[str, Any]], plan: ToolPlan, request: ChatCompletionRequest
    ) -> list[int]:
        """The prompt's token ids, `chat_template_kwargs` passed to the template. A forced
        call under a template that ignores `tools` (the same ids with and without them)
        gets the tools as a system message instead (`ToolPlan.fallback_system`), joined to
        the conversation's own system message."""
        variables = template_variables(request.chat_template_kwargs)

        def render(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
            return self.render_chat(msgs, request.add_generation_prompt, variables, tools)

        ids = render(messages, plan.template_tools)
        if plan.fallback_system is None or ids != render(messages, None):
            return ids
        if (
            messages
            and messages[0].get("role") == "system"
            and isinstance(messages[0].get("content"), str)
        ):
            head = {**messages[0], "content": f"{messages[0]['content']}\n\n{plan.fallback_system}"}
            return render([head, *messages[1:]], None)
        return render([{"role": "system", "content": plan.fallback_system}, *messages], None)

    def _response(
        self,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        in_reasoning: bool | None,
        final: RequestOutput,
        request_id: str,
        created: int,
        top_n: int,
    ) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            content: str | None = c.text
            message = ChatResponseMessage(role="assistant", content=content)
            if self.reasoning is not None:
                reasoning, content = split_reasoning(self.reasoning, in_reasoning, c.text)
                message["content"] = content
                if request.include_reasoning:
                    message["reasoning"] = message["reasoning_content"] = reasoning
            calls: list[FunctionCall] = []
            if plan.new_parser is not None:
                message["content"], calls = parse_tool_calls(plan.new_parser(), content or "")
                if calls:
                    message["tool_calls"] = [_tool_call_body(call) for call in calls]
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=chat_logprobs(c, self.tokenizer, top_n) if request.logprobs else None,
                    finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                    stop_reason=c.stop_reason,
                )
            )
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
        plan: ToolPlan,
        in_reasoning: bool | None,
        first: RequestOutput,
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        created: int,
        top_n: int,
    ) -> AsyncGenerator[str, None]:
        started: set[int] = set()
        streams: dict[int, ToolCallStream] = {}
        thinking: dict[int, ReasoningStream] = {}

        def deltas(c: CompletionOutput) -> list[DeltaMessage]:
            """The choice's deltas for this output: reasoning pieces (with a reasoning
            parser), then its content, or (with a tool parser) the content and calls the
            content settled, each call as two deltas."""
            if self.reasoning is None:
                return content_deltas(c, c.text)
            split = thinking.setdefault(c.index, ReasoningStream(self.reasoning, in_reasoning))
            parts = split.feed(c.text) + (split.finish() if c.finish_reason else [])
            out: list[DeltaMessage] = []
            content = ""
            for kind, text in parts:
                if kind == "content":
                    content += text
                elif request.include_reasoning:
                    out.append(DeltaMessage(reasoning=text, reasoning_content=text))
            body = content_deltas(c, content)
            if out and body == [DeltaMessage(content="")]:
                return out  # reasoning only: no empty content delta beside it
            return out + body

        def content_deltas(c: CompletionOutput, text: str) -> list[DeltaMessage]:
            if plan.new_parser is None:
                return [DeltaMessage(content=text)]
            stream = streams.setdefault(c.index, ToolCallStream(plan.new_parser()))
            before = stream.num_calls
            items = stream.feed(text) + (stream.finish() if c.finish_reason else [])
            out: list[DeltaMessage] = []
            for item in items:
                if isinstance(item, str):
                    out.append(DeltaMessage(content=item))
                    continue
                body = _tool_call_body(item)
                head = DeltaToolCall(
                    index=before, id=body["id"], type="function",
                    function={"name": item.name, "arguments": ""},
                )  # fmt: skip
                args = DeltaToolCall(index=before, function={"arguments": item.arguments})
                out += [DeltaMessage(tool_calls=[head]), DeltaMessage(tool_calls=[args])]
                before += 1
            return out or [DeltaMessage(content="")]

        def choice(out: RequestOutput, c: CompletionOutput) -> list[ChatCompletionStreamChoice]:
            entries = deltas(c)
            if c.index not in started:
                started.add(c.index)
                entries[0] = DeltaMessage(role="assistant", **entries[0])
            called = c.index in streams and streams[c.index].num_calls > 0
            return [
                ChatCompletionStreamChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=(
                        chat_logprobs(c, self.tokenizer, top_n)
                        if request.logprobs and k == 0
                        else None
                    ),
                    finish_reason=(
                        _finish_reason(c.finish_reason, called) if k == len(entries) - 1 else None
                    ),
                )
                for k, delta in enumerate(entries)
            ]

        def chunk(choices: list[ChatCompletionStreamChoice]) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=choices,
            )

        return self.stream_events(
            first, gen, choice, chunk, request.include_usage, request.continuous_usage
        )


async def _last(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The last output of `gen` (not streamed, FINAL_ONLY: usually its first)."""
    final = None
    async for out in gen:
        final = out
    assert final is not None
    return final
