"""Turn a user prompt + SamplingParams into a validated `EngineCoreRequest`.

All per-request validation that needs the model (vocabulary, context length) happens here,
in the caller's thread, so a bad request raises `ValueError` before it reaches the engine
and no other request is affected.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Union

from pagedinfer.config import StructuredOutputsConfig
from pagedinfer.core.messages import EngineCoreRequest
from pagedinfer.distributed.kv_transfer.trust import KVTransferRefused, check_remote
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedinfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

__all__ = ["InputProcessor", "PromptType", "pooling_sampling_params"]

# A text prompt, a list of token ids, or a dict with "prompt" or "prompt_token_ids"
# (plus optional "cache_salt"), as vLLM accepts.
PromptType = Union[str, list[int], dict[str, Any]]

MAX_LOGPROBS = 20


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        structured_outputs_config: StructuredOutputsConfig | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.kv_transfer_config = kv_transfer_config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = tokenizer.eos_token_id
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        # (backend, whitespace, additional properties) -> a backend that validates specs
        self._validators: dict[tuple[str, bool, bool], Any] = {}

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the engine request and the prompt text (None for token-id prompts).
        With `pooling_params` the request is a pooling one: `params` then carries only
        `truncate_prompt_tokens` (see `pooling_sampling_params`)."""
        if pooling_params is not None:
            _check_pooling(params)
        text, token_ids, cache_salt = self._tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.max_model_len
        if keep is not None and len(token_ids) > keep:
            token_ids = token_ids[-keep:]  # the end of the prompt: what the answer continues
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        self._validate(token_ids, params)
        if params.structured_outputs is not None:
            # Before the copy below: a spec nested 500 deep is a RecursionError in deepcopy.
            _check_spec_bounds(params.structured_outputs)
        params = params.clone()
        if params.extra_args and "kv_transfer_params" in params.extra_args:
            self._check_kv_transfer_params(request_id, token_ids, params)
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        if params.top_k >= self.vocab_size:
            params.top_k = 0  # keeps the whole vocabulary either way; 0 says so cheaply
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
            if params.min_tokens > params.max_tokens:
                raise ValueError(
                    f"min_tokens ({params.min_tokens}) is more than the {params.max_tokens} "
                    f"tokens left after the prompt (maximum model length {self.max_model_len})."
                )
        if self.eos_token_id is not None:
            # Masked until min_tokens is reached, even with ignore_eos (as vLLM does).
            params.update_from_eos((self.eos_token_id,))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
        )
        return request, text

    def _check_kv_transfer_params(
        self, request_id: str, token_ids: list[int], params: SamplingParams
    ) -> None:
        """Remote prefill params this instance does not believe (`trust.check_remote`):
        a ValueError naming why with kv_load_failure_policy "fail", else the params are
        dropped (with a warning) and the prompt is computed here."""
        assert params.extra_args is not None
        kv_params = params.extra_args["kv_transfer_params"]
        if not isinstance(kv_params, dict):
            raise ValueError("kv_transfer_params must be an object")
        kv = self.kv_transfer_config
        try:
            check_remote(kv_params, kv, token_ids)
        except KVTransferRefused as exc:
            if kv is not None and kv.kv_load_failure_policy == "fail":
                raise
            logger.warning("request %s: %s; computing the prompt locally", request_id, exc)
            params.extra_args = {
                k: v for k, v in params.extra_args.items() if k != "kv_transfer_params"
            }

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as written mid-text (" word") and at the start ("word"),
        distinct sequences only (vLLM bans both forms)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"bad_words: {word!r} encodes to token {bad[0]}, outside "
                                     f"the vocabulary (size {self.vocab_size}).")  # fmt: skip
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), cache_salt
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), cache_salt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), cache_salt
        raise ValueError(
            f"Unsupported prompt type {type(prompt).__name__}: pass a string, a list of token "
            "ids, or a dict with 'prompt' or 'prompt_token_ids'."
        )

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty: at least one token is needed.")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} in the prompt is out of vocabulary (size {self.vocab_size})."
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt (length {len(token_ids)}) is longer than the maximum model length "
                f"of {self.max_model_len} minus one token to generate."
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"Requested {name}={k}, more than max_logprobs={MAX_LOGPROBS}.")
        for name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary "
                    f"(size {self.vocab_size})."
                )

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Validate the grammar spec here (a 400, not an engine error) and record which
        backend takes it: the engine's, or with "auto" xgrammar unless it cannot compile
        the spec, then llguidance (vLLM's fallback)."""
        from pagedinfer.structured_output.backend import create_backend, resolve_auto_backend
        from pagedinfer.structured_output.manager import spec_key

        so = params.structured_outputs
        assert so is not None
        if so.resolved_backend is not None:
            raise ValueError(
                "structured outputs: the backend is chosen per engine, not per request."
            )
        kind, spec = spec_key(so)
        cfg = self.structured_outputs_config
        whitespace = so.disable_any_whitespace or cfg.disable_any_whitespace
        additional = so.disable_additional_properties or cfg.disable_additional_properties
        try:
            if cfg.structured_outputs_backend == "auto":
                so.resolved_backend = resolve_auto_backend(
                    kind,
                    spec,
                    disable_any_whitespace=whitespace,
                    disable_additional_properties=additional,
                )
                return
            name = cfg.structured_outputs_backend
            key = (name, whitespace, additional)
            validator = self._validators.get(key)
            if validator is None:
                validator = create_backend(
                    name,
                    self.tokenizer,
                    self.vocab_size,
                    disable_any_whitespace=whitespace,
                    disable_additional_properties=additional,
                )
                self._validators[key] = validator
            validator.validate(kind, spec)
            so.resolved_backend = name
        except ValueError as exc:
            raise ValueError(f"Invalid structured outputs ({kind.name.lower()}): {exc}") from exc


def pooling_sampling_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams a pooling request travels with: one final output, no text."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        truncate_prompt_tokens=truncate_prompt_tokens,
    )


def _check_spec_bounds(so: StructuredOutputsParams) -> None:
    """ValueError naming the field of a structured-outputs spec too deep or too long."""
    from pagedinfer.structured_output.specs import check_spec_bounds

    for name in ("json", "regex", "choice", "grammar", "structural_tag"):
        value = getattr(so, name)
        if value is not None:
            check_spec_bounds(f"structured outputs {name}", value)


def _check_pooling(params: SamplingParams) -> None:
    """A pooling request samples nothing: sampling options would be silently unused."""
    if (
        params.n != 1
        or params.structured_outputs is not None
        or params.logprobs is not None
        or params.prompt_logprobs is not None
        or params.extra_args
    ):
        raise ValueError(
            "a pooling request takes no sampling options (n, logprobs, prompt_logprobs, "
            "structured outputs, kv_transfer_params): build its SamplingParams with "
            "pooling_sampling_params()"
        )
