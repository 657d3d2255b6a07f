"""OpenAI-compatible HTTP server over `AsyncLLM` (`pagedinfer serve`).

Endpoints: `/v1/completions`, `/v1/chat/completions` (JSON or SSE streaming), `/v1/models`,
`/health`, `/version`, `/tokenize`, `/detokenize`, and `/metrics` (Prometheus text format,
see `engine/metrics.py`). Request bodies are validated by pydantic models that forbid nothing
but check types and ranges; every problem is a 4xx with an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`), and a bad request never reaches the
engine. With `--api-key`, every `/v1` route wants `Authorization: Bearer <key>` (401).
A client that disconnects mid-stream closes its generator, which aborts the request in the
engine and frees its blocks; a non-streaming request's connection is watched while it runs,
with the same effect. If the engine process dies, requests fail with 503 and
`/health` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedinfer
from pagedinfer.engine.async_llm import AsyncLLM
from pagedinfer.engine.core_client import EngineDeadError
from pagedinfer.engine.metrics import PrometheusStatLogger
from pagedinfer.outputs import CompletionOutput, RequestOutput
from pagedinfer.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["build_app", "DEFAULT_MODEL_NAME"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` request field (the same names as StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(default=1, ge=1, le=16)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Guided decoding: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Disaggregated prefill (vLLM's field): to a prefill instance {"do_remote_decode":
    # true}; to a decode instance, what the prefill instance's response carried.
    kv_transfer_params: dict[str, Any] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        given = {
            "response_format": self.response_format is not None
            and self.response_format.type != "text",
            "structured_outputs": self.structured_outputs is not None,
            "guided_json": self.guided_json is not None,
            "guided_regex": self.guided_regex is not None,
            "guided_choice": self.guided_choice is not None,
            "guided_grammar": self.guided_grammar is not None,
        }
        named = [k for k, v in given.items() if v]
        if len(named) > 1:
            raise ValueError(f"give at most one of {', '.join(named)}")
        if not named:
            return None
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            return StructuredOutputsParams(**fields)
        if self.response_format is not None:
            if self.response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            fmt = self.response_format.json_schema
            if fmt is None or fmt.json_schema is None:
                raise ValueError("response_format: json_schema needs a 'schema'")
            return StructuredOutputsParams(json=fmt.json_schema)
        return StructuredOutputsParams(
            json=self.guided_json,
            regex=self.guided_regex,
            choice=self.guided_choice,
            grammar=self.guided_grammar,
        )

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.kv_transfer_params is not None and self.n != 1:
            # One prompt's KV goes to (or comes from) one request on the other instance.
            raise ValueError("kv_transfer_params needs n = 1")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as exc:
                raise ValueError(f"logit_bias keys must be token ids: {exc}") from exc
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
            extra_args=(
                {"kv_transfer_params": self.kv_transfer_params}
                if self.kv_transfer_params is not None
                else None
            ),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    """`prompt` (text, tokenized as a completion prompt is) or `messages` (rendered with the
    chat template, as a chat request is): exactly one of them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _error(status: int, message: str, param: str | None = None, kind: str | None = None):
    kind = kind or {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError",
        422: "BadRequestError",
        503: "ServiceUnavailableError",
    }.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _dead_message(exc: BaseException) -> str:
    """What a client is told when the engine is gone: the first line only (the engine's
    traceback, if it sent one, is in the server log, not in responses)."""
    return (str(exc).strip().splitlines() or ["The engine core is dead."])[0]


def _failure(results: list[RequestOutput]) -> str | None:
    """The engine's message for a request it finished with an error (e.g. a grammar that
    failed to compile), or None."""
    for res in results:
        for c in res.outputs:
            if c.finish_reason == "error":
                return str(c.stop_reason or "the request failed in the engine")
    return None


def _sse_error(exc: BaseException | str, status: int = 503) -> str:
    message = exc if isinstance(exc, str) else _dead_message(exc)
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return f"data: {json.dumps(body)}\n\n"


def _chat_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts are supported")
        parts.append(part["text"])
    return "\n".join(parts)


def _usage(
    prompt_tokens: int, completion_tokens: int, cached: int, external: int = 0
) -> dict[str, Any]:
    """OpenAI usage. `cached`: prompt tokens not computed here (prefix-cache hits and KV a
    connector loaded); `external` (only shown when non-zero): of those, the loaded ones."""
    details: dict[str, int] = {"cached_tokens": cached}
    if external:
        details["external_cached_tokens"] = external
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def _unless_disconnected(raw: Request, awaitable: Any) -> Any:
    """Await `awaitable` (a non-streaming request's generation, or a stream's first output)
    while watching the client's connection: if it goes away first, cancel it (which aborts its
    requests in the engine and frees their blocks, as a dropped stream does) and raise
    `_ClientGone`. The body has been read, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
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


def _with_kv_transfer_params(response: dict[str, Any], params: dict[str, Any] | None):
    """A KV connector's parameters for the next instance (disaggregated prefill), at the
    top level of the response as in vLLM; absent when there are none."""
    if params is not None:
        response["kv_transfer_params"] = params
    return response


def _completion_logprobs(c: CompletionOutput, tokenizer, offset0: int = 0) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = offset0
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = tokenizer.decode([token_id])
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob if token_id in entry else None)
        top.append(
            {(lp.decoded_token or tokenizer.decode([t])): lp.logprob for t, lp in entry.items()}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(c: CompletionOutput, tokenizer, top_n: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = tokenizer.decode([token_id])
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": entry[token_id].logprob if token_id in entry else None,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or tokenizer.decode([t]),
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or tokenizer.decode([t])).encode()),
                    }
                    for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def build_app(
    engine: AsyncLLM,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | None = None,
    *,
    shutdown_engine: bool = False,
) -> FastAPI:
    """The app over `engine`; with `shutdown_engine`, the app's lifespan ends it (so the
    engine process goes with the server however the ASGI server is stopped)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedinfer", version=pagedinfer.__version__, lifespan=lifespan)
    tokenizer = engine.tokenizer
    created = int(time.time())
    metrics = PrometheusStatLogger(model_name, engine.max_model_len)
    engine.stat_loggers.append(metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        # The framework's own errors (unknown route, wrong method, a body that is not
        # parseable at all) in the same OpenAI-style shape as ours.
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "Invalid or missing API key.")
        return await call_next(request)

    def _check_model(name: str | None):
        if name is not None and name != model_name:
            return _error(
                404,
                f"The model {name!r} does not exist; this server serves {model_name!r}.",
                "model",
            )
        return None

    @app.get("/health")
    async def health():
        if engine.errored:
            return _error(503, "The engine core is dead.")
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return {"version": pagedinfer.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        if not engine.errored:
            try:  # gauges as the engine core sees them now, not as of its last step
                now = await asyncio.wait_for(engine.get_scheduler_stats(), timeout=5)
                metrics.update_gauges(
                    now["num_running_reqs"], now["num_waiting_reqs"], now["kv_cache_usage"]
                )
            except (EngineDeadError, asyncio.TimeoutError):
                pass  # serve the last known values
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (bad := _check_model(body.model)) is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return _error(400, "Give exactly one of 'prompt' and 'messages'.", "prompt")
        try:
            if body.messages is not None:
                messages = [
                    {"role": m.role, "content": _chat_text(m.content)} for m in body.messages
                ]
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
                )
            else:
                ids = tokenizer.encode(body.prompt or "", body.add_special_tokens)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc), "messages" if body.messages is not None else "prompt")
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": list(ids),
        }
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (bad := _check_model(body.model)) is not None:
            return bad
        vocab = engine.input_processor.vocab_size
        bad_ids = [t for t in body.tokens if not 0 <= t < vocab]
        if bad_ids:
            return _error(400, f"tokens: ids out of range [0, {vocab}): {bad_ids[:5]}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedinfer",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def _run(
        prompt, params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        async for out in engine.generate(prompt, params, request_id):
            yield out

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        if (bad := _check_model(body.model)) is not None:
            return bad
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            return _error(400, "prompt: at least one prompt is needed", "prompt")
        if body.stream and len(prompts) > 1:
            return _error(400, "prompt: streaming takes one prompt", "prompt")
        if body.kv_transfer_params is not None and len(prompts) > 1:
            return _error(400, "prompt: kv_transfer_params takes one prompt", "prompt")
        try:
            params = body.sampling_params(body.max_tokens or 16, body.logprobs)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        inputs = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        if body.stream:
            gen = _run(inputs[0], params, request_id)
            try:
                # Watched: a decode instance may wait on a KV transfer before the first token.
                first = await _unless_disconnected(raw, gen.__anext__())
            except _ClientGone:
                return _gone()
            except (ValueError, TypeError) as exc:
                return _error(400, str(exc))
            except EngineDeadError as exc:
                return _error(503, _dead_message(exc))
            return StreamingResponse(
                _stream_completion(first, gen, request_id, body, created_at=int(time.time())),
                media_type="text/event-stream",
            )

        async def final_output(i: int, prompt: Any) -> RequestOutput:
            final = None
            async for out in _run(prompt, params, f"{request_id}-{i}"):
                final = out
            assert final is not None
            return final

        try:
            # Validate every prompt before any runs: a bad one fails the request alone.
            for i, prompt in enumerate(inputs):
                engine.input_processor.process(f"{request_id}-check-{i}", prompt, params)
            results = await _unless_disconnected(
                raw, asyncio.gather(*(final_output(i, p) for i, p in enumerate(inputs)))
            )
        except _ClientGone:
            return _gone()
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except EngineDeadError as exc:
            return _error(503, _dead_message(exc))
        if (failed := _failure(results)) is not None:
            return _error(400, failed)
        choices, prompt_tokens, completion_tokens, cached, external = [], 0, 0, 0, 0
        for i, res in enumerate(results):
            prompt_tokens += len(res.prompt_token_ids)
            cached += res.num_cached_tokens
            external += res.num_external_cached_tokens
            prefix = (res.prompt or tokenizer.decode(res.prompt_token_ids)) if body.echo else ""
            for c in res.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": _completion_logprobs(c, tokenizer, len(prefix)),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        response = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached, external),
        }
        # One prompt per request in disaggregated serving (the proxy sends one).
        return _with_kv_transfer_params(
            response, results[0].kv_transfer_params if len(results) == 1 else None
        )

    async def _sse(first, gen, request_id: str, obj: str, created_at: int, usage: bool, choice):
        """SSE stream of `first` and the rest of `gen`: one chunk per output, each choice
        built by `choice(out, completion)`; then the usage chunk (if asked) and [DONE]."""
        counts: dict[int, int] = {}
        cached = first.num_cached_tokens

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            data = {"id": request_id, "object": obj, "created": created_at, "model": model_name}
            return f"data: {json.dumps({**data, 'choices': choices, **extra})}\n\n"

        def chunk(out: RequestOutput) -> str:
            for c in out.outputs:
                counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
            return event([choice(out, c) for c in out.outputs])

        try:
            for out in (first,):
                if (failed := _failure([out])) is not None:
                    yield _sse_error(failed, 400)
                    return
            yield chunk(first)
            async for out in gen:
                if (failed := _failure([out])) is not None:
                    yield _sse_error(failed, 400)
                    return
                cached = max(cached, out.num_cached_tokens)
                yield chunk(out)
        except EngineDeadError as exc:
            yield _sse_error(exc)
        finally:
            await gen.aclose()
        if usage:
            tokens = _usage(len(first.prompt_token_ids), sum(counts.values()), cached)
            yield event([], usage=tokens)
        yield "data: [DONE]\n\n"

    def _stream_completion(first, gen, request_id, body: CompletionRequest, created_at: int):
        echoed: set[int] = set()

        def choice(out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
            text = c.text
            if body.echo and c.index not in echoed:
                echoed.add(c.index)
                text = (out.prompt or tokenizer.decode(out.prompt_token_ids)) + text
            return {
                "index": c.index,
                "text": text,
                "logprobs": _completion_logprobs(c, tokenizer),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }

        usage = body.stream_options is not None and body.stream_options.include_usage
        return _sse(first, gen, request_id, "text_completion", created_at, usage, choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        if (bad := _check_model(body.model)) is not None:
            return bad
        try:
            messages = [{"role": m.role, "content": _chat_text(m.content)} for m in body.messages]
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
            )
            top_n = body.top_logprobs or 0
            params = body.sampling_params(
                body.max_completion_tokens or body.max_tokens, top_n if body.logprobs else None
            )
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = _run({"prompt_token_ids": prompt_ids}, params, request_id)

        async def last() -> RequestOutput:
            # Not streamed (FINAL_ONLY): the first output is usually the last.
            final = None
            async for out in gen:
                final = out
            assert final is not None
            return final

        created_at = int(time.time())
        try:
            if body.stream:
                first = await _unless_disconnected(raw, gen.__anext__())
                return StreamingResponse(
                    _stream_chat(first, gen, request_id, body, created_at, top_n),
                    media_type="text/event-stream",
                )
            final = await _unless_disconnected(raw, last())
        except _ClientGone:
            return _gone()
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except EngineDeadError as exc:
            return _error(503, _dead_message(exc))
        finally:
            if not body.stream:
                await gen.aclose()
        if (failed := _failure([final])) is not None:
            return _error(400, failed)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, tokenizer, top_n) if body.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": created_at,
            "model": model_name,
            "choices": choices,
            "usage": _usage(
                len(final.prompt_token_ids),
                completion_tokens,
                final.num_cached_tokens,
                final.num_external_cached_tokens,
            ),
        }
        return _with_kv_transfer_params(response, final.kv_transfer_params)

    def _stream_chat(first, gen, request_id, body: ChatCompletionRequest, created_at, top_n):
        started: set[int] = set()

        def choice(out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": c.text}
            if c.index not in started:
                started.add(c.index)
                delta["role"] = "assistant"
            return {
                "index": c.index,
                "delta": delta,
                "logprobs": _chat_logprobs(c, tokenizer, top_n) if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }

        usage = body.stream_options is not None and body.stream_options.include_usage
        return _sse(first, gen, request_id, "chat.completion.chunk", created_at, usage, choice)

    return app
