"""The OpenAI-compatible API's bodies: pydantic models for requests, TypedDicts for responses.

Requests check types and ranges only (cross-field rules and the conversion to
`SamplingParams` are in `serving_engine.py`). A completion or chat request field this server
does not implement is refused with a 400 naming it, never dropped silently (a dropped `tools`
looks like the model ignoring them); only the fields in `IGNORED_FIELDS`, which cannot change
an answer (bookkeeping such as `user` or `metadata`), or those at a value that changes
nothing (`IGNORED_AT_DEFAULT`, e.g. `best_of` equal to `n`), are accepted and ignored. The
request class names appear in validation messages that reach clients, so they are part of
the wire format.

Responses are TypedDicts: mypy checks every key and value where a handler builds one, and the
routes name them for the OpenAPI schema, but at run time each is the plain dict that is
serialized. A stream builds several per token (chunk, choice, delta, logprob entries), and
building and dumping pydantic models costs about twice what the rest of a chunk's way out
does. A `NotRequired` key is left out when it does not apply (`usage` on all but a stream's
last chunk, `kv_transfer_params`, a delta's `role` after the first); every other None is sent
as `null`. Keys are written in the order declared here. Used by `serving_*.py` and
`api_server.py`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from typing_extensions import NotRequired, Self, TypedDict

__all__ = [
    "StrictRequest",
    "ChatCompletionLogprobs",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatLogprobToken",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTool",
    "ChatTopLogprob",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamResponse",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCallBody",
    "FunctionDefinition",
    "IGNORED_AT_DEFAULT",
    "IGNORED_FIELDS",
    "JsonSchemaFormat",
    "MessageFunctionCall",
    "MessageToolCall",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "PromptLogprob",
    "PromptLogprobsBody",
    "PromptTokensDetails",
    "ResponseFormat",
    "ResponsesRequest",
    "SamplingFields",
    "StreamOptions",
    "StructuredOutputsFields",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizerInfoResponse",
    "ToolCallBody",
    "UsageInfo",
    "VersionResponse",
]


# ------------------------------------------------------------------------------ requests

IGNORED_FIELDS = frozenset(
    {
        # OpenAI's bookkeeping and hints: none of them changes the tokens or their order.
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prediction",
    }
)  # fmt: skip
"""Request fields accepted and ignored: they cannot change an answer."""

IGNORED_AT_DEFAULT: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
    "spaces_between_special_tokens": (True,),
    "echo_chat": (False,),
    "priority": (0,),
}
"""Request fields accepted only at values that change nothing (OpenAI's and vLLM's names):
another value is refused by name. (`best_of` equal to `n` is checked separately.)"""

_NOT_YET: dict[str, str] = {
    name: "deprecated by OpenAI: use tools and tool_choice"
    for name in ("functions", "function_call")
}
"""Fields refused with a reason of their own."""


def _same_json(value: object, default: object) -> bool:
    """Equal as JSON values: numbers by value (`0.0` is the `0` of `priority`, as in JSON
    Schema), but `false` is no `0` and `true` no `1`."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, int | float) and isinstance(default, int | float):
        return value == default
    return value == default and type(value) is type(default)


def _refuse_unknown(request: BaseModel, endpoint: str) -> None:
    """ValueError naming every field of `request` this server does not implement (those
    pydantic kept as extras), unless ignorable (`IGNORED_FIELDS`, `IGNORED_AT_DEFAULT`)."""
    extra = request.model_extra or {}
    refused = []
    for name, value in extra.items():
        if name in IGNORED_FIELDS:
            continue
        key = "echo_chat" if name == "echo" else name  # completions implement echo
        if key in IGNORED_AT_DEFAULT and any(_same_json(value, v) for v in IGNORED_AT_DEFAULT[key]):
            continue
        if name == "best_of" and _same_json(value, getattr(request, "n", 1)):
            continue
        why = _NOT_YET.get(name)
        if why is None and key in IGNORED_AT_DEFAULT:
            why = f"only {' or '.join(repr(v) for v in IGNORED_AT_DEFAULT[key])} is supported"
        refused.append(f"{name!r} ({why})" if why else repr(name))
    if refused:
        raise ValueError(
            f"unsupported field{'s' if len(refused) > 1 else ''} for {endpoint}: "
            f"{', '.join(refused)}; pagedinfer does not implement "
            f"{'them' if len(refused) > 1 else 'it'} (docs/serving.md lists the fields)"
        )


INT64_MAX = 2**63 - 1
"""Integers reach the engine's int64 tensors: larger ones are refused (`SamplingParams`)."""


def _integral(value: Any) -> Any:
    """Integral floats as ints, in lists too: JSON Schema's integers include 2.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class StrictRequest(BaseModel):
    """A request body, validated strictly (no "2" for 2, no 1 for true: what the OpenAPI
    document says is what is taken), except that an integer field takes 2.0 as 2, since
    JSON Schema's integers do."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        ints = _integer_fields(cls)
        return {k: _integral(v) if k in ints else v for k, v in data.items()}


def _admits(annotation: Any, kind: type) -> bool:
    """Whether a type annotation (unions, lists, Annotated included) admits `kind`."""
    return annotation is kind or any(_admits(arg, kind) for arg in get_args(annotation))


@functools.cache
def _integer_fields(cls: type[BaseModel]) -> frozenset[str]:
    """Fields of `cls` whose type admits integers but not floats."""
    return frozenset(
        name
        for name, info in cls.model_fields.items()
        if _admits(info.annotation, int) and not _admits(info.annotation, float)
    )


Text = Annotated[str, Field(min_length=1)]
"""Non-empty text (a prompt, a stop string, a guided choice or grammar)."""
# Prompts as the handlers take them: non-empty text or token ids (below the vocabulary
# size: the engine checks it, the OpenAPI document states it, `openapi.py`).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]
"""A token id: `openapi.honest_openapi` bounds it by the served model's vocabulary."""
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompts = (
    Text
    | TokenIds
    | Annotated[list[Text], Field(min_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1)]
)


def _only_null(schema: dict[str, Any]) -> None:
    """The schema of a field whose every value but null is refused (with a message that
    says why): its documented type is null."""
    schema.clear()
    schema["type"] = "null"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk with no choices carries the usage."""
    continuous_usage_stats: bool = False
    """With `include_usage`: every chunk carries the usage so far (vLLM's option)."""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)

    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                },
            },
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> Self:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self


Regex = Annotated[str, Field(min_length=1, json_schema_extra={"format": "regex"})]
"""A guided-decoding regular expression (the document's `format` lets generators make
valid ones)."""


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` request field (the same names as StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Regex | None = None
    choice: list[Text] | None = Field(default=None, min_length=1)
    grammar: Text | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class SamplingFields(StrictRequest):
    """The sampling, stop, guided-decoding and streaming fields that completion and chat
    requests share (`serving_engine.to_sampling_params` turns them into SamplingParams)."""

    # Extras are kept to be refused by name (`_refuse_unknown`), not dropped.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=16)
    max_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    """0 only on /v1/completions with `echo`: score the prompt without generating."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT64_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    """vLLM's field: words never generated (`SamplingParams.bad_words`)."""
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, le=2**31 - 1, json_schema_extra={"not": {"const": 0}}
    )
    """vLLM's field: keep only the prompt's last this many tokens (-1: the model length)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    """vLLM's field: the prompt tokens' logprobs (and this many top ones), returned as
    `prompt_logprobs` (per choice on /v1/completions, per response on chat)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Guided decoding: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: Regex | None = None
    guided_choice: list[Text] | None = Field(default=None, min_length=1)
    guided_grammar: Text | None = None
    # Disaggregated prefill (vLLM's field): to a prefill instance {"do_remote_decode":
    # true}; to a decode instance, what the prefill instance's response carried.
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM's field: requests share prefix-cache blocks only with requests of the same
    salt (and, with `--isolate-tenants`, of the same tenant): see docs/serving.md."""

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


def _nonempty_prompts(value: Any, what: str) -> Any:
    """Before the union of prompt forms is tried (its errors name no form the client
    meant): an empty prompt, list or id list is refused by name."""
    if value == "" or value == []:
        raise ValueError(f"at least one {what} is needed, and none may be empty")
    if isinstance(value, list) and any(v == "" or v == [] for v in value):
        raise ValueError(f"an empty {what} in the list: none may be empty")
    return value


class CompletionRequest(SamplingFields):
    prompt: Prompts
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _nonempty(cls, value: Any) -> Any:
        return _nonempty_prompts(value, "prompt")

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        _refuse_unknown(self, "/v1/completions")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (None: no arguments)."""
    strict: bool | None = None
    """Arguments constrained to `parameters` by guided decoding once a call starts (with
    `tool_choice` "auto"; "required" and named choices always are)."""


class ChatTool(BaseModel):
    """One entry of a chat request's `tools`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function to call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str
    """JSON text of the arguments object, as a response carried it."""


class MessageToolCall(BaseModel):
    """A call an assistant message of the history made (what an earlier response held)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


ChatTextPart = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        }
    ),
]
"""A content part: text only (`serving_engine.chat_text` refuses the others, naming them)."""


class ChatMessage(BaseModel):
    """One message of a chat history; `name`, `tool_call_id` and `tool_calls` reach the chat
    template as given (templates may render them; `serving_engine.template_message`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatTextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        _refuse_unknown(self, "a chat message")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: "auto" when there are tools, else "none" (OpenAI's default)."""
    parallel_tool_calls: bool = True
    """False: at most one call per answer."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. Qwen3's `enable_thinking`)."""
    include_reasoning: bool = True
    """False: a `--reasoning-parser` server drops the reasoning from the answer."""

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        _refuse_unknown(self, "/v1/chat/completions")
        return self


class EmbeddingRequest(StrictRequest):
    """`/v1/embeddings`: OpenAI's fields, vLLM's `normalize` and `truncate_prompt_tokens`,
    and `pooling_type` (pagedinfer's: vLLM fixes it per model)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, json_schema_extra=_only_null)
    """Refused (a 400): no model served here is a Matryoshka model."""
    user: str | None = None
    normalize: bool = True
    pooling_type: Literal["last", "mean"] = "last"
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, le=2**31 - 1, json_schema_extra={"not": {"const": 0}}
    )

    @field_validator("input", mode="before")
    @classmethod
    def _nonempty(cls, value: Any) -> Any:
        return _nonempty_prompts(value, "input")

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        _refuse_unknown(self, "/v1/embeddings")
        return self


class ResponsesTextPart(BaseModel):
    """A text part of an input message (an earlier output's `output_text` parts come
    back with their `annotations`: other fields are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesMessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesTextPart]


class ResponsesFunctionCallItem(BaseModel):
    """A call an earlier response made (its `id` and `status` are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1, max_length=64)
    arguments: str = "{}"
    """JSON text of the arguments object, as the response carried it."""


class ResponsesFunctionOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesTextPart] = ""


class ResponsesReasoningItem(BaseModel):
    """An earlier response's reasoning: dropped, as chat templates drop it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionOutputItem, Tag("function_call_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
"""An input item, chosen by its `type` ("message" when absent, as OpenAI's API reads it)."""


_SOME_MESSAGE = {
    "contains": {
        "anyOf": [
            {"type": "object", "not": {"required": ["type"]}},
            {"type": "object", "properties": {"type": {"not": {"const": "reasoning"}}}},
        ]
    }
}
"""Some input item other than reasoning: a conversation to answer (the chat handler
refuses one without messages)."""


class ResponsesTool(BaseModel):
    """A function tool (OpenAI's built-in tools, `web_search` and the like, are not served)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: str = Field(min_length=1)


class ResponsesPlainFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object"]


class ResponsesSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: (
        Annotated[ResponsesPlainFormat | ResponsesSchemaFormat, Field(discriminator="type")] | None
    ) = None


class ResponsesRequest(StrictRequest):
    """`/v1/responses` (stateless; `serving_responses.py` maps it onto a chat request)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | Annotated[list[ResponsesInputItem], Field(json_schema_extra=_SOME_MESSAGE)]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    """Accepted and ignored: nothing is stored (see `previous_response_id`)."""
    previous_response_id: str | None = Field(default=None, json_schema_extra=_only_null)
    """Refused with a 400: the server is stateless."""
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        _refuse_unknown(self, "/v1/responses")
        return self


class TokenizeRequest(StrictRequest):
    """`prompt` (text, tokenized as a completion prompt is) or `messages` (rendered with the
    chat template, as a chat request is): exactly one of them."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """As in a chat request: extra variables for the chat template."""


class DetokenizeRequest(StrictRequest):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[TokenId]


# ----------------------------------------------------------------------------- responses


class ErrorInfo(TypedDict):
    message: str
    type: str
    param: NotRequired[str | None]
    """The request field at fault; an error event inside an SSE stream has none."""
    code: int


class ErrorResponse(TypedDict):
    """OpenAI's error body (and, inside a stream, its last event)."""

    error: ErrorInfo


class PromptTokensDetails(TypedDict):
    cached_tokens: int
    """Prompt tokens not computed here: prefix-cache hits and KV a connector loaded."""
    external_cached_tokens: NotRequired[int]
    """Of those, the ones a KV connector loaded; only when there are some."""


class UsageInfo(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    """Legacy completions logprobs: per generated token its text, logprob, the top
    alternatives (text -> logprob) and its character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    """None for the first token of an echoed prompt (it has no logprob, as in OpenAI's API)."""
    text_offset: list[int]


class PromptLogprob(TypedDict):
    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobsBody = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token, token id (as a string) -> its logprob; None
for the first token, which nothing predicts."""


class CompletionResponseChoice(TypedDict):
    """One choice of a completion; the same shape in a stream chunk, `text` a delta."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: NotRequired[PromptLogprobsBody]


class CompletionResponse(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: NotRequired[dict[str, Any]]
    """What a decode instance needs to fetch this prompt's KV (disaggregated prefill)."""


class CompletionStreamResponse(TypedDict):
    """One SSE chunk of a completion; the last (with `include_usage`) has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: NotRequired[UsageInfo]


class ChatTopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatCompletionLogprobs(TypedDict):
    content: list[ChatLogprobToken]


class FunctionCallBody(TypedDict):
    name: str
    arguments: str
    """JSON text of the arguments object."""


class ToolCallBody(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCallBody


class ChatResponseMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    """None when the answer is only tool calls."""
    tool_calls: NotRequired[list[ToolCallBody]]
    """Only when the model called tools."""
    reasoning: NotRequired[str | None]
    """With `--reasoning-parser`: the answer's reasoning block (None: it had none)."""
    reasoning_content: NotRequired[str | None]
    """The same, under the name vLLM used first (and DeepSeek's API uses)."""


class ChatCompletionResponseChoice(TypedDict):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: NotRequired[PromptLogprobsBody]
    kv_transfer_params: NotRequired[dict[str, Any]]
    """What a decode instance needs to fetch this prompt's KV (disaggregated prefill)."""


class DeltaFunctionCall(TypedDict, total=False):
    name: str
    """Only in a call's first delta."""
    arguments: str
    """A fragment of the arguments' JSON text (the fragments joined are all of it)."""


class DeltaToolCall(TypedDict):
    index: int
    """The call's position in the choice's `tool_calls`."""
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: DeltaFunctionCall


class DeltaMessage(TypedDict, total=False):
    role: Literal["assistant"]
    """Only on a choice's first chunk."""
    content: str
    """Absent from a chunk that carries `tool_calls` or reasoning."""
    tool_calls: list[DeltaToolCall]
    reasoning: str
    """With `--reasoning-parser`: a piece of the reasoning block."""
    reasoning_content: str
    """The same piece, under vLLM's first name for it."""


class ChatCompletionStreamChoice(TypedDict):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None
    finish_reason: str | None


class ChatCompletionStreamResponse(TypedDict):
    """One SSE chunk of a chat completion; the last (with `include_usage`) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: NotRequired[UsageInfo]


class EmbeddingData(TypedDict):
    object: Literal["embedding"]
    embedding: list[float] | str
    """Floats, or (encoding_format "base64") their little-endian float32 bytes in base64."""
    index: int


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(TypedDict):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: NotRequired[list[str]]
    """The vocabulary strings of `tokens`, with `return_token_strs`."""


class DetokenizeResponse(TypedDict):
    prompt: str


class TokenizerInfoResponse(TypedDict):
    """`GET /tokenizer_info` (vLLM's, behind `--enable-tokenizer-info-endpoint`): what a
    client needs to tokenize and render chats as the server does, through `/tokenize`
    (lm-evaluation-harness's "remote" tokenizer reads it)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    """The template chat requests use: `--chat-template` if given, else the model's."""
    model_max_length: int
    vocab_size: int


class VersionResponse(TypedDict):
    version: str
