"""What the completion and chat handlers share: the engine-client interface the server needs,
request fields -> `SamplingParams` (structured outputs included), OpenAI-style errors, usage,
client-disconnect watching and the SSE stream loop.

Invariants: a bad request is a 400 with the error body before anything reaches the engine;
a request the engine finished with `finish_reason == "error"` is a 400 (or, mid-stream, an
error event); a dead engine is a 503. A client that goes away cancels its generation, which
aborts its requests in the engine and frees their blocks. `OpenAIServing` is the base of
`OpenAIServingCompletion` and `OpenAIServingChat`; `api_server.py` builds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from pagedinfer.engine.core_client import EngineDeadError
from pagedinfer.entrypoints.openai.protocol import (
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobsBody,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
)
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedinfer.engine.input_processor import InputProcessor, PromptType
    from pagedinfer.engine.metrics import StatLogger
    from pagedinfer.outputs import CompletionOutput, PromptLogprobs, RequestOutput
    from pagedinfer.pooling_params import PoolingParams
    from pagedinfer.tokenizer import Tokenizer

__all__ = [
    "EngineClient",
    "check_room",
    "check_text_fits",
    "OpenAIServing",
    "chat_text",
    "error_response",
    "failure",
    "finite_logprob",
    "json_response",
    "prompt_logprobs_body",
    "request_structured_outputs",
    "template_message",
    "template_variables",
    "DEFAULT_OPTIONS",
    "ServingOptions",
    "prefix_salt",
    "salted",
    "to_sampling_params",
    "usage_info",
    "watched",
]

T = TypeVar("T")
C = TypeVar("C")  # a choice of a stream chunk
S = TypeVar("S", CompletionStreamResponse, ChatCompletionStreamResponse)  # a stream chunk

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "BadRequestError",
    503: "ServiceUnavailableError",
}


class EngineClient(Protocol):
    """What the server reads of `AsyncLLM` (a test may pass any object shaped like it)."""

    tokenizer: Tokenizer
    max_model_len: int
    input_processor: InputProcessor
    stat_loggers: list[StatLogger]

    @property
    def errored(self) -> bool: ...

    def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> RequestOutput: ...

    async def get_scheduler_stats(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


# --------------------------------------------------------------- request -> SamplingParams


def request_structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The guided-decoding constraint a request names (at most one of its fields), or None."""
    given = {
        "response_format": request.response_format is not None
        and request.response_format.type != "text",
        "structured_outputs": request.structured_outputs is not None,
        "guided_json": request.guided_json is not None,
        "guided_regex": request.guided_regex is not None,
        "guided_choice": request.guided_choice is not None,
        "guided_grammar": request.guided_grammar is not None,
    }
    named = [k for k, v in given.items() if v]
    if len(named) > 1:
        raise ValueError(f"give at most one of {', '.join(named)}")
    if not named:
        return None
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if named[0] == "response_format" and request.response_format is not None:
        if request.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        fmt = request.response_format.json_schema
        assert fmt is not None and fmt.json_schema is not None  # `ResponseFormat` checks it
        return StructuredOutputsParams(json=fmt.json_schema)
    return StructuredOutputsParams(
        json=request.guided_json,
        regex=request.guided_regex,
        choice=request.guided_choice,
        grammar=request.guided_grammar,
    )


def to_sampling_params(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's parameters for `request`; ValueError (a 400) for what the field types
    cannot express: max_tokens 0 (an echoed completion scores with 1, `serving_completion`),
    kv_transfer_params with n > 1, logit_bias keys that are not ids, two guided-decoding
    fields, and whatever SamplingParams itself rejects. `prompt_logprobs` defaults to the
    request's own field, and `structured_outputs` (what a tool choice imposes) to the one
    the request's fields name."""
    if max_tokens == 0:
        raise ValueError("max_tokens: 0 is only for /v1/completions with echo (scoring)")
    if request.kv_transfer_params is not None and request.n != 1:
        # One prompt's KV goes to (or comes from) one request on the other instance.
        raise ValueError("kv_transfer_params needs n = 1")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    bias = None
    if request.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in request.logit_bias.items()}
        except ValueError as exc:
            raise ValueError(f"logit_bias keys must be token ids: {exc}") from exc
    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=0 if request.top_k == -1 else request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=stop,
        stop_token_ids=request.stop_token_ids,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=bias,
        bad_words=request.bad_words,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs or request_structured_outputs(request),
        extra_args=(
            {"kv_transfer_params": request.kv_transfer_params}
            if request.kv_transfer_params is not None
            else None
        ),
    )


LOGPROB_FLOOR = -9999.0
"""A logprob below this (-inf: a token a bias or a grammar excluded) is sent as this, as
vLLM's server does: JSON has no infinity, and strict clients refuse `-Infinity`."""


def finite_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_logprobs_body(
    entries: PromptLogprobs | None, tokenizer: Tokenizer
) -> PromptLogprobsBody | None:
    """vLLM's `prompt_logprobs` field from the engine's (token ids as strings)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): PromptLogprob(
                logprob=finite_logprob(lp.logprob),
                rank=lp.rank,
                decoded_token=lp.decoded_token or tokenizer.decode([t]),
            )
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def prefix_salt(raw_request: Request, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its own `cache_salt` and the tenant the server
    isolates it as (`request.state.tenant`, set by the auth middleware with
    `--isolate-tenants`); None when it has neither. Requests share cached blocks only with
    requests of the same salt, so one tenant's `cached_tokens` (and latency) says nothing
    about another's prompts."""
    tenant = getattr(raw_request.state, "tenant", None)
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt])


def salted(prompt: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """`prompt` (a prompt dict) with `salt` as its `cache_salt`, when there is one."""
    return prompt if salt is None else {**prompt, "cache_salt": salt}


def check_text_fits(num_chars: int, max_model_len: int, max_token_chars: int, what: str) -> None:
    """ValueError (a 400) for a text of `num_chars` characters that needs more than
    `max_model_len` tokens however it is tokenized: no token stands for more than
    `max_token_chars` characters (`Tokenizer.max_token_chars`; twice that here, a margin
    for normalizers that merge characters). Cheap: such a text is refused before it is
    tokenized (10 MB would take ~10 s of CPU)."""
    if num_chars > 2 * max_token_chars * max_model_len:
        raise ValueError(
            f"{what}: {num_chars} characters cannot fit in this model's maximum context "
            f"length of {max_model_len} tokens"
        )


def check_room(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """ValueError (a 400) when the prompt and `max_tokens` together pass the model's
    length, as vLLM's server answers (offline, the engine stops at the length instead)."""
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion): reduce the prompt or max_tokens."
        )


# apply_chat_template's own arguments: a request sets them through its fields.
_TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "bos_token",
     "eos_token"}
)  # fmt: skip


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs`, checked: ValueError for a name the template call
    sets itself."""
    variables = dict(kwargs or {})
    taken = sorted(set(variables) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise ValueError(
            f"chat_template_kwargs: {', '.join(taken)} cannot be set this way (the request's "
            "own fields set them)"
        )
    return variables


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template sees it: role, text content, and `name` /
    `tool_call_id` / `tool_calls` when given. A call's arguments reach the template as an
    object, not JSON text (templates write them with `tojson`, as vLLM passes them);
    ValueError if they are not a JSON object (or empty)."""
    out: dict[str, Any] = {"role": message.role, "content": chat_text(message.content)}
    for key in ("name", "tool_call_id"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:  # empty text: a call without arguments (as vLLM reads it)
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                raise ValueError(
                    f"messages: the arguments of tool call {call.id!r} are not a JSON object"
                )
            function = {"name": call.function.name, "arguments": args}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    return out


def chat_text(content: str | list[dict[str, Any]] | None) -> str:
    """A chat message's text: a string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts are supported")
        parts.append(part["text"])
    return "\n".join(parts)


# --------------------------------------------------------------------------------- errors


def json_response(body: Mapping[str, Any]) -> JSONResponse:
    """A handler's answer, encoded as FastAPI encodes a returned dict (kv_transfer_params,
    whatever a connector put in them, included)."""
    return JSONResponse(jsonable_encoder(body))


def error_response(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    """OpenAI's error body, its `type` named after the status unless `kind` is given."""
    kind = kind or _ERROR_TYPES.get(
        status, "BadRequestError" if 400 <= status < 500 else "InternalServerError"
    )
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body, status_code=status)


def _dead_message(exc: BaseException) -> str:
    """What a client is told when the engine is gone: the first line only (the engine's
    traceback, if it sent one, is in the server log, not in responses)."""
    return (str(exc).strip().splitlines() or ["The engine core is dead."])[0]


def failure(results: list[RequestOutput]) -> str | None:
    """The engine's message for a request it finished with an error (e.g. a grammar that
    failed to compile), or None."""
    for res in results:
        for c in res.outputs:
            if c.finish_reason == "error":
                return str(c.stop_reason or "the request failed in the engine")
    return None


def _sse_error(exc: BaseException | str, status: int = 503) -> str:
    """An error event ending a stream: a failed request (400) or a dead engine (503)."""
    message = exc if isinstance(exc, str) else _dead_message(exc)
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    return _sse_event(ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)))


def _sse_event(body: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def usage_info(
    prompt_tokens: int, completion_tokens: int, cached: int, external: int = 0
) -> UsageInfo:
    """OpenAI usage. `cached`: prompt tokens not computed here (prefix-cache hits and KV a
    connector loaded); `external` (only shown when non-zero): of those, the loaded ones."""
    details = PromptTokensDetails(cached_tokens=cached)
    if external:
        details["external_cached_tokens"] = external
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


# ------------------------------------------------------------------- client disconnects


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def _unless_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` (a non-streaming request's generation, or a stream's first output)
    while watching the client's connection: if it goes away first, cancel it (which aborts its
    requests in the engine and frees their blocks, as a dropped stream does) and raise
    `_ClientGone`. The body has been read, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone
    finally:
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending


def _gone() -> Response:
    """No one reads it: the client is gone (nginx's code for "client closed request")."""
    return Response(status_code=499)


async def watched(raw_request: Request, awaitable: Awaitable[T]) -> T | Response:
    """`awaitable`'s result (see `_unless_disconnected`), or the answer to what stopped it:
    499 when the client went away, 400 for bad input (ValueError, TypeError), 503 when the
    engine is dead."""
    try:
        return await _unless_disconnected(raw_request, awaitable)
    except _ClientGone:
        return _gone()
    except (ValueError, TypeError) as exc:
        return error_response(400, str(exc))
    except EngineDeadError as exc:
        return error_response(503, _dead_message(exc))


# ------------------------------------------------------------------------- the base class


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide options the endpoint handlers read (the `serve` flags of the same names)."""

    accept_kv_transfer_params: bool = False
    """Take clients' `kv_transfer_params` (`trust.accepts_client_params`)."""
    max_sequences_per_request: int = 256
    """Prompts (or embedding inputs) times `n` in one request."""
    content_special_tokens_as_text: bool = False
    """Special-token strings in chat message content are encoded as plain text
    (`Tokenizer.apply_chat_template(content_as_text=True)`)."""


DEFAULT_OPTIONS = ServingOptions()


class OpenAIServing:
    """One endpoint's handler over the engine client: model-name checks and streaming."""

    def __init__(
        self,
        engine_client: EngineClient,
        model_name: str,
        chat_template: str | None = None,
        *,
        options: ServingOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.engine_client = engine_client
        self.model_name = model_name
        self.tokenizer = engine_client.tokenizer
        self.chat_template = chat_template
        """`--chat-template`: used instead of the model's own for chat requests."""
        self.options = options

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids of `messages` under the chat template (`--chat-template` or the
        model's), with the template `variables` and `tools`. Blocking: call off the loop."""
        extra = {"tools": tools} if tools else {}
        return cast(
            "list[int]",
            self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                chat_template=self.chat_template,
                content_as_text=self.options.content_special_tokens_as_text,
                **variables,
                **extra,
            ),
        )

    async def encode_prompts(self, texts: list[str], truncating: bool) -> list[list[int]]:
        """The token ids of text prompts, encoded on a worker thread (the tokenizer releases
        the GIL), so a long prompt does not stall the event loop and every stream on it.
        Unless the request truncates its prompt, a text that cannot fit the model is a
        ValueError first, without encoding (`check_text_fits`)."""
        if not truncating:
            for text in texts:
                check_text_fits(len(text), self.engine_client.max_model_len,
                                self.tokenizer.max_token_chars, "prompt")  # fmt: skip
        if not texts:
            return []
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])

    def check_sequences(self, num_prompts: int, n: int = 1) -> JSONResponse | None:
        """A 400 when a request asks for more sequences (prompts x n) than
        `--max-sequences-per-request`: one request must not occupy the engine alone."""
        cap = self.options.max_sequences_per_request
        if num_prompts * n <= cap:
            return None
        return error_response(
            400,
            f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; this server "
            f"takes at most {cap} per request (--max-sequences-per-request)",
            "prompt" if n == 1 else "n",
        )

    def refuse_kv_transfer_params(self, request: SamplingFields) -> JSONResponse | None:
        """A 400 for client `kv_transfer_params` on a server that does not take them: with
        no transfer secret they would choose which host the engine connects to and which
        KV it loads for the prompt (`distributed/kv_transfer/trust.py`)."""
        if request.kv_transfer_params is None or self.options.accept_kv_transfer_params:
            return None
        return error_response(
            400,
            "kv_transfer_params: not taken from clients by this server: configure a transfer "
            "secret (kv_connector_extra_config.secret or PAGEDINFER_KV_TRANSFER_SECRET) on "
            "every instance, or start it with --trust-kv-transfer-params behind a proxy that "
            "sets them",
            "kv_transfer_params",
        )

    def check_model(self, name: str | None) -> JSONResponse | None:
        """A 404 for a request naming another model than the one served, else None."""
        if name is not None and name != self.model_name:
            return error_response(
                404,
                f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                "model",
            )
        return None

    async def stream_events(
        self,
        first: RequestOutput,
        gen: AsyncGenerator[RequestOutput, None],
        choice: Callable[[RequestOutput, CompletionOutput], list[C]],
        chunk: Callable[[list[C]], S],
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncGenerator[str, None]:
        """SSE stream of `first` and the rest of `gen`: per output, `chunk(choices)`s whose
        choices `choice(out, completion)` builds (one entry per chunk: a completion that
        needs several successive deltas, a tool call's name and then its arguments, returns
        several, and the output takes as many chunks); then (with `include_usage`) a chunk with
        no choices and the usage, and [DONE]. A request the engine failed ends the
        stream at its error event; a dead engine's error event is followed by the usage
        chunk and [DONE]. With `continuous_usage` every chunk also carries the usage so
        far. `gen` is closed however the stream ends (aborting an unfinished request)."""
        counts: dict[int, int] = {}
        cached = first.num_cached_tokens
        num_prompt = len(first.prompt_token_ids)

        def event(out: RequestOutput) -> str:
            for c in out.outputs:
                counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
            entries = [choice(out, c) for c in out.outputs]
            depth = max((len(e) for e in entries), default=1)
            chunks = [chunk([e[k] for e in entries if k < len(e)]) for k in range(depth)]
            if continuous_usage:
                usage = usage_info(num_prompt, sum(counts.values()), cached)
                for body in chunks:
                    body["usage"] = usage
            return "".join(_sse_event(body) for body in chunks)

        try:
            if (failed := failure([first])) is not None:
                yield _sse_error(failed, 400)
                return
            yield event(first)
            async for out in gen:
                if (failed := failure([out])) is not None:
                    yield _sse_error(failed, 400)
                    return
                cached = max(cached, out.num_cached_tokens)
                yield event(out)
        except EngineDeadError as exc:
            yield _sse_error(exc)
        finally:
            await gen.aclose()
        if include_usage:
            last = chunk([])
            last["usage"] = usage_info(num_prompt, sum(counts.values()), cached)
            yield _sse_event(last)
        yield "data: [DONE]\n\n"
