"""Sampling parameters of one request.

`SamplingParams` is a msgspec struct so that it can cross a process boundary (front end ->
engine core) without pickle. All validation happens at construction (`__post_init__`), so an
invalid request raises `ValueError` in the caller's thread, before it reaches the engine.
Checks that need the model (vocabulary size, `max_model_len`) are done by the input processor.

Semantics follow vLLM's `SamplingParams` (see docs/architecture.md):
- `temperature < 1e-5` means greedy; then top_p/top_k/min_p are reset to neutral values.
- `top_k` of 0 or -1 disables top-k; `seed=-1` means no seed.
- `min_tokens` masks every stop token id (EOS included) until that many tokens exist.
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any

import msgspec

__all__ = [
    "GREEDY_EPS",
    "SamplingParams",
    "RequestOutputKind",
    "SamplingType",
    "StructuredOutputsParams",
]

# A temperature below this samples greedily (argmax); the worker batches by the same rule.
GREEDY_EPS = 1e-5
_MAX_LOGIT_BIAS = 100.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a streaming request carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain a request's output to a grammar: exactly one of `json`, `json_object`,
    `regex`, `choice`, `grammar`, `structural_tag` (vLLM's names). Compiled by the engine's
    structured-output backend (`structured_outputs_config.backend`); an invalid spec is a
    ValueError in the front end, before the request is queued."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict or its JSON text): the output is a JSON value that matches it."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    regex: str | None = None
    """The output matches this regular expression in full."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar: EBNF/GBNF (`root ::= ...`, both backends) or Lark (`start: ...`, through
    llguidance)."""
    structural_tag: str | dict[str, Any] | None = None
    """vLLM's structural tag, `{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}`: free text until a trigger starts one of the `begin`s, then that structure's
    schema up to its `end` (how strict tool calls are constrained)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact); also an engine-wide option."""
    disable_additional_properties: bool = False
    """Schemas that do not say otherwise get `additionalProperties: false`."""
    reasoning_end: str | None = None
    """The grammar applies only after this text appears in the output (the end of a
    reasoning block, `</think>`; the server sets it under `--reasoning-parser`): the
    tokens up to and including it are unconstrained, the grammar starts after them."""
    close_within_max_tokens: bool = False
    """With `json`: the output is a complete instance even when the token budget
    (max_tokens, max_model_len) runs out first. Once the budget left comes near what the
    shortest completion of the text so far needs (strings closed, missing required
    properties at their minimal values: `structured_output/json_closer.py`), the engine
    forces that completion, token by token, each checked by the grammar. Such an output
    finishes with reason "length": it was cut, yet it parses and validates. The server sets
    it for forced tool calls; a pagedinfer extension (vLLM has none)."""
    resolved_backend: str | None = None
    """Set by the front end: the backend that validated the spec ("xgrammar" or
    "guidance"; with the engine's "auto", the one that can take it). Not for users."""

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object is not None else [])
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice, "
                f"grammar and structural_tag; got {', '.join(given) or 'none'}."
            )
        if self.json_object is False:
            raise ValueError("structured outputs: json_object must be true if given.")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs: choice needs a list of non-empty strings.")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                raise ValueError(f"structured outputs: {name} must not be empty.")
        if self.close_within_max_tokens and self.json is None:
            raise ValueError("structured outputs: close_within_max_tokens needs a json schema.")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample the output tokens of one request (vLLM-compatible names and defaults)."""

    n: int = 1
    """Number of output sequences for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token that already appears in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in prompt or output."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-5 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    seed: int | None = None
    """Per-request random seed: the same seed gives the same output whatever the batch."""
    stop: list[str] | None = None
    """Stop strings; they are cut from the output unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in the output)."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to max_model_len."""
    min_tokens: int = 0
    """Stop tokens (and EOS) are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Number of top log-probabilities to return per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Number of top log-probabilities to return per prompt token."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids (clamped to +-100)."""
    allowed_token_ids: list[int] | None = None
    """If set, only these token ids can be sampled."""
    bad_words: list[str] | None = None
    """Words never generated: each one's tokens (with and without a leading space) are
    banned as a sequence, the last token masked wherever the output ends with the others."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (-1: the model's maximum length)."""
    detokenize: bool = True
    """Produce text; stop strings need it."""
    skip_special_tokens: bool = True
    """Drop special tokens from the output text."""
    spaces_between_special_tokens: bool = True
    """Kept for API compatibility with vLLM."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """CUMULATIVE, DELTA or FINAL_ONLY outputs when streaming."""
    extra_args: dict[str, Any] | None = None
    """Free-form extension point (e.g. kv_transfer_params in later features)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Guided decoding: the output follows a JSON schema, regex, choice or grammar."""

    # Derived at construction, not user-facing.
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    output_text_buffer_length: int = 0
    bad_words_token_ids: list[list[int]] | None = None
    """`bad_words` as token sequences (set by the engine's input processor)."""

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not all(math.isfinite(float(b)) for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be finite numbers.")
            self.logit_bias = {
                int(tok): max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, float(bias)))
                for tok, bias in self.logit_bias.items()
            }
        self._verify_args()
        if self.temperature < GREEDY_EPS:
            # Greedy: the other sampling knobs are meaningless, reset them to neutral.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.stop and not self.include_stop_str_in_output:
            # Hold back enough characters that a partial stop string is never streamed.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    def _verify_args(self) -> None:
        # Every integer crosses to the engine core as a msgpack int and ends in int64
        # tensors: one out of range must fail here, not in the engine's step.
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
                raise ValueError(f"{name} is out of range: {value}.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be non-negative or -1 (all), got {value}.")
        if self.stop and any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True.")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be non-negative.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must not be empty.")
        if self.bad_words is not None and not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise ValueError("bad_words must be non-empty strings.")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0
        ):
            raise ValueError(
                "truncate_prompt_tokens must be a positive number of tokens or -1 (the "
                f"model's maximum length), got {self.truncate_prompt_tokens}."
            )
        if self.temperature < GREEDY_EPS and self.n > 1:
            raise ValueError("n must be 1 when using greedy sampling (temperature 0).")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def update_from_eos(self, eos_token_ids: tuple[int, ...]) -> None:
        """Fold the model's EOS ids into the stop set (masked by min_tokens, like vLLM)."""
        self.all_stop_token_ids.update(eos_token_ids)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
