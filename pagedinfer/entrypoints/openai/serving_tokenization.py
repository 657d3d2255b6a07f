"""`/tokenize`, `/detokenize` and `/tokenizer_info` (vLLM's extensions): the served model's
tokenizer, without running the model.

`/tokenize` takes exactly one of `prompt` (encoded as a completion prompt is) and `messages`
(rendered with the chat template, as a chat request is); `/detokenize` rejects ids outside
the vocabulary with a 400; `/tokenizer_info` describes the tokenizer (special tokens, chat
template) and answers only on a server started with `--enable-tokenizer-info-endpoint`, as
vLLM's (it shows the chat template). Built and routed by `api_server.py`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pagedinfer.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from pagedinfer.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_response,
    json_response,
    template_message,
    template_variables,
)

if TYPE_CHECKING:
    from fastapi.responses import Response

__all__ = ["OpenAIServingTokenization"]


class OpenAIServingTokenization(OpenAIServing):
    """Handles `/tokenize`, `/detokenize` and `/tokenizer_info`."""

    async def create_tokenize(self, request: TokenizeRequest) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        if (request.prompt is None) == (request.messages is None):
            return error_response(400, "Give exactly one of 'prompt' and 'messages'.", "prompt")
        try:
            # Off the event loop: a long text must not stall the streams on it.
            ids = await asyncio.to_thread(self._ids, request)
        except (ValueError, TypeError) as exc:
            param = "messages" if request.messages is not None else "prompt"
            return error_response(400, str(exc), param)
        response = TokenizeResponse(
            count=len(ids), max_model_len=self.engine_client.max_model_len, tokens=list(ids)
        )
        if request.return_token_strs:
            response["token_strs"] = self.tokenizer.convert_ids_to_tokens(list(ids))
        return json_response(response)

    def _ids(self, request: TokenizeRequest) -> list[int]:
        if request.messages is None:
            return self.tokenizer.encode(request.prompt or "", request.add_special_tokens)
        messages = [template_message(m) for m in request.messages]
        variables = template_variables(request.chat_template_kwargs)
        return self.render_chat(messages, request.add_generation_prompt, variables)

    async def create_detokenize(self, request: DetokenizeRequest) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        vocab = self.engine_client.input_processor.vocab_size
        bad_ids = [t for t in request.tokens if not 0 <= t < vocab]
        if bad_ids:
            return error_response(
                400, f"tokens: ids out of range [0, {vocab}): {bad_ids[:5]}", "tokens"
            )
        return json_response(DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens)))

    def tokenizer_info(self) -> TokenizerInfoResponse:
        tok = self.tokenizer
        return TokenizerInfoResponse(
            tokenizer_class="PreTrainedTokenizerFast",  # what `save_hf` writes: same encodings
            bos_token=tok.token_text(tok.bos_token_id),
            eos_token=tok.token_text(tok.eos_token_id),
            pad_token=tok.token_text(tok.pad_token_id),
            unk_token=tok.token_text(tok.unk_token_id),
            add_bos_token=tok.add_bos_token,
            add_eos_token=tok.add_eos_token,
            chat_template=self.chat_template or tok.chat_template,
            model_max_length=self.engine_client.max_model_len,
            vocab_size=tok.vocab_size,
        )
