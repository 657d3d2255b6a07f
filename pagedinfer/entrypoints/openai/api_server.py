"""The OpenAI-compatible HTTP server over an engine client (`pagedinfer serve`).

Endpoints: `/v1/completions`, `/v1/chat/completions` (JSON or SSE streaming),
`/v1/embeddings`, `/v1/responses`, Anthropic's `/v1/messages`, `/v1/models`,
`/health`, `/version`, `/tokenize`, `/detokenize`, and `/metrics` (Prometheus text format,
see `engine/metrics.py`). Request bodies are validated by the pydantic models of
`protocol.py`; every problem is a 4xx with an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`), and a bad request never reaches the
engine. With an `api_key`, every `/v1` route wants `Authorization: Bearer <key>` (401).
A client that disconnects mid-stream closes its generator, which aborts the request in the
engine and frees its blocks; a non-streaming request's connection is watched while it runs,
with the same effect. If the engine process dies, requests fail with 503 and `/health`
answers 503.

`build_app` puts the per-endpoint handlers (`serving_*.py`) and the settings on `app.state`;
the routes here only parse and dispatch. Called by `entrypoints/cli.py` (`serve`) and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedinfer
from pagedinfer.engine.core_client import EngineDeadError
from pagedinfer.engine.metrics import PrometheusStatLogger
from pagedinfer.entrypoints.anthropic.serving_messages import (
    AnthropicServingMessages,
    MessagesRequest,
    anthropic_error,
)
from pagedinfer.entrypoints.openai.http_limits import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    RequestBodyLimits,
)
from pagedinfer.entrypoints.openai.openapi import honest_openapi
from pagedinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from pagedinfer.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedinfer.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedinfer.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedinfer.entrypoints.openai.serving_engine import (
    EngineClient,
    ServingOptions,
    error_response,
    json_response,
)
from pagedinfer.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedinfer.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAME", "build_app", "check_tenant_source"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

router = APIRouter()


@router.get("/health")
async def health(raw_request: Request) -> Response:
    if raw_request.app.state.engine_client.errored:
        return error_response(503, "The engine core is dead.")
    return JSONResponse({})


@router.get("/version", responses={200: {"model": VersionResponse}})
async def version() -> Response:
    return json_response(VersionResponse(version=pagedinfer.__version__))


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    engine_client: EngineClient = raw_request.app.state.engine_client
    stat_logger: PrometheusStatLogger = raw_request.app.state.metrics
    if not engine_client.errored:
        try:  # gauges as the engine core sees them now, not as of its last step
            now = await asyncio.wait_for(engine_client.get_scheduler_stats(), timeout=5)
            stat_logger.update_gauges(
                int(now["num_running_reqs"]), int(now["num_waiting_reqs"]), now["kv_cache_usage"]
            )
        except (EngineDeadError, asyncio.TimeoutError):
            pass  # serve the last known values
    if engine_client.errored:
        stat_logger.update_gauges(0, 0, 0.0)  # a dead engine runs nothing and holds nothing
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}})
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    return await handler.create_tokenize(request)


@router.post("/detokenize", responses={200: {"model": DetokenizeResponse}})
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    return await handler.create_detokenize(request)


@router.get("/tokenizer_info", responses={200: {"model": TokenizerInfoResponse}})
async def tokenizer_info(raw_request: Request) -> Response:
    if not raw_request.app.state.enable_tokenizer_info:
        return error_response(
            404, "/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint."
        )
    handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
    return json_response(handler.tokenizer_info())


def _model_card(state: Any) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        object="model",
        created=state.created,
        owned_by="pagedinfer",
        max_model_len=state.engine_client.max_model_len,
    )


@router.get("/v1/models", responses={200: {"model": ModelList}})
async def show_available_models(raw_request: Request) -> Response:
    return json_response(ModelList(object="list", data=[_model_card(raw_request.app.state)]))


@router.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}})
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """OpenAI's `models.retrieve`: the served model's card, else a 404 naming it."""
    state = raw_request.app.state
    if model_id != state.model_name:
        return error_response(
            404,
            f"The model {model_id!r} does not exist; this server serves {state.model_name!r}.",
            "model",
        )
    return json_response(_model_card(state))


@router.post("/v1/completions", responses={200: {"model": CompletionResponse}})
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
    return await handler.create_completion(request, raw_request)


@router.post("/v1/messages")
async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
    handler: AnthropicServingMessages = raw_request.app.state.anthropic_serving_messages
    return await handler.create_message(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    handler: OpenAIServingResponses = raw_request.app.state.openai_serving_responses
    return await handler.create_response(request, raw_request)


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}})
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    handler: OpenAIServingEmbedding = raw_request.app.state.openai_serving_embedding
    return await handler.create_embedding(request, raw_request)


@router.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}})
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
    return await handler.create_chat_completion(request, raw_request)


async def _http_error(request: Request, exc: Exception) -> Response:
    # The framework's own errors (unknown route, wrong method, a body that is not parseable
    # at all) in the same OpenAI-style shape as ours (Anthropic's on its route).
    assert isinstance(exc, StarletteHTTPException)
    if request.url.path == "/v1/messages":
        response = anthropic_error(exc.status_code, str(exc.detail))
    else:
        response = error_response(exc.status_code, str(exc.detail))
    response.headers.update(exc.headers or {})  # a 405's `Allow`
    return response


async def _invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    given = first.get("input")
    if first.get("type") == "literal_error" and isinstance(given, str) and len(given) <= 64:
        message += f", got {given!r}"  # a wrong tag ("type": "web_search") named
    if request.url.path == "/v1/messages":
        return anthropic_error(400, f"{param or 'body'}: {message}")
    return error_response(400, f"{param or 'body'}: {message}", param)


def check_tenant_source(isolate_tenants: str | None, has_keys: bool) -> None:
    """ValueError unless `--isolate-tenants` is unset, "api-key" (with keys) or
    "header:NAME"."""
    if isolate_tenants is None or (isolate_tenants == "api-key" and has_keys):
        return
    if isolate_tenants.startswith("header:") and isolate_tenants != "header:":
        return
    raise ValueError(
        f"--isolate-tenants {isolate_tenants!r}: 'api-key' (with --api-key) or 'header:NAME'"
    )


def _given_key(request: Request) -> str | None:
    """The API key a request presents: `Authorization: Bearer` (OpenAI's clients) or
    `x-api-key` (Anthropic's)."""
    auth = request.headers.get("authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer ") :]
    return request.headers.get("x-api-key")


def _matching_key(given: str | None, keys: tuple[str, ...]) -> str | None:
    """The configured key equal to `given` (compared in constant time), or None."""
    if given is None:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


async def _auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    state = request.app.state
    if not request.url.path.startswith("/v1"):
        return await call_next(request)
    key = _matching_key(_given_key(request), state.api_keys)
    error = None
    if state.api_keys and key is None:
        error = (401, "Invalid or missing API key.")
    elif state.isolate_tenants == "api-key":
        assert key is not None
        # The key's digest, not the key: salts reach block hashes and traces.
        request.state.tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    elif state.isolate_tenants is not None:
        header = state.isolate_tenants.removeprefix("header:")
        given = request.headers.getlist(header)
        if len(given) > 1:  # which one a proxy added cannot be told: none is believed
            error = (400, f"The {header} header (the request's tenant) is given {len(given)} "
                     "times; give it once.")  # fmt: skip
        elif not given or not given[0]:
            error = (400, f"The {header} header (the request's tenant) is required.")
        else:
            request.state.tenant = "header:" + given[0]
    if error is not None:
        if request.url.path == "/v1/messages":
            return anthropic_error(*error)
        return error_response(*error)
    return await call_next(request)


class _NoTracebacks:
    """ASGI middleware: an exception no handler answered becomes OpenAI's error shape
    (Anthropic's on its route) and one log line, not a plain-text 500 and a traceback per
    request: a RecursionError (a body or field nested too deeply for a copy or a parser) is
    the client's 400, anything else our 500. The server keeps serving either way. Plain
    ASGI, not `BaseHTTPMiddleware`: it adds nothing to each chunk of a stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise  # mid-response: nothing else can be sent
            if isinstance(exc, RecursionError):
                status, text = 400, "The request is nested too deeply."
            else:
                status, text = 500, f"Internal error ({type(exc).__name__}); see the server log."
            path = scope.get("path", "")
            logger.error(
                "%s %s -> %d: %s: %s",
                scope.get("method"), path, status, type(exc).__name__, str(exc)[:200],
            )  # fmt: skip
            if path == "/v1/messages":
                response = anthropic_error(status, text)
            else:
                response = error_response(status, text)
            await response(scope, receive, send)


async def _request_id(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """A client's `X-Request-Id` comes back on the response (errors and streams too), so
    it can match answers to requests across proxies."""
    response = await call_next(request)
    if (request_id := request.headers.get("x-request-id")) is not None:
        response.headers["X-Request-Id"] = request_id
    return response


def build_app(
    engine_client: EngineClient,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | Sequence[str] | None = None,
    *,
    shutdown_engine: bool = False,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    enable_tokenizer_info: bool = False,
    accept_kv_transfer_params: bool = False,
    isolate_tenants: str | None = None,
    max_sequences_per_request: int = 256,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
    content_special_tokens_as_text: bool = False,
) -> FastAPI:
    """The app over `engine_client` (an `AsyncLLM`); with `shutdown_engine`, the app's
    lifespan ends it (so the engine process goes with the server however the ASGI server is
    stopped). `chat_template` (a jinja template) replaces the model's own for chat and
    tokenize requests; `tool_call_parser`, `enable_auto_tool_choice` and `reasoning_parser`
    are the `serve` flags (`tool_choice.py`, `reasoning.py`), and so is
    `enable_tokenizer_info` (`GET /tokenizer_info`, off by default as in vLLM) and
    `accept_kv_transfer_params` (clients' `kv_transfer_params`: with a transfer secret, or
    `--trust-kv-transfer-params`; see `distributed/kv_transfer/trust.py`). `api_key`: one
    key or several (one per tenant); `isolate_tenants` ("api-key", or "header:NAME") salts
    every request's prefix-cache blocks with its tenant (`serving_engine.prefix_salt`), so
    tenants share no blocks. ValueError for "api-key" without keys. A request may ask for
    `max_sequences_per_request` sequences (prompts x n) and send `max_request_bytes` of
    body within `client_timeout_s` (`http_limits.py`; the head's timeout is uvicorn's
    protocol's, set by `serve`). `content_special_tokens_as_text`: a chat message's
    "<|im_start|>" is text, not the control token. Adds the
    app's Prometheus logger to the engine's `stat_loggers`."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            engine_client.shutdown()

    app = FastAPI(title="pagedinfer", version=pagedinfer.__version__, lifespan=lifespan)
    vocab_size = engine_client.input_processor.vocab_size
    app.openapi = lambda: honest_openapi(  # type: ignore[method-assign]
        app, vocab_size, accept_kv_transfer_params
    )
    app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_middleware(
        RequestBodyLimits, max_bytes=max_request_bytes, timeout_s=client_timeout_s
    )  # innermost: after the auth check
    app.middleware("http")(_auth)
    app.add_middleware(_NoTracebacks)
    app.middleware("http")(_request_id)  # outermost: it also tags the 401s and 500s

    state = app.state
    state.engine_client = engine_client
    state.model_name = model_name
    state.api_keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    check_tenant_source(isolate_tenants, bool(state.api_keys))
    state.isolate_tenants = isolate_tenants
    state.enable_tokenizer_info = enable_tokenizer_info
    state.created = int(time.time())
    state.metrics = PrometheusStatLogger(model_name, engine_client.max_model_len)
    engine_client.stat_loggers.append(state.metrics)
    options = ServingOptions(
        accept_kv_transfer_params, max_sequences_per_request, content_special_tokens_as_text
    )
    state.openai_serving_completion = OpenAIServingCompletion(
        engine_client, model_name, options=options
    )
    state.openai_serving_chat = OpenAIServingChat(
        engine_client,
        model_name,
        chat_template,
        tool_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
        options=options,
    )
    state.openai_serving_embedding = OpenAIServingEmbedding(
        engine_client, model_name, options=options
    )
    state.openai_serving_responses = OpenAIServingResponses(state.openai_serving_chat)
    state.anthropic_serving_messages = AnthropicServingMessages(state.openai_serving_chat)
    state.openai_serving_tokenization = OpenAIServingTokenization(
        engine_client, model_name, chat_template, options=options
    )
    return app
