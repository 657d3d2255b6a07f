"""`/v1/embeddings`: each input runs as a pooling request (`AsyncLLM.encode`), batched with
whatever else the engine runs, and comes back as one vector.

`input` is a string, a list of strings, a list of token ids or a list of those; every
input is validated before any runs, so one bad input fails the request alone. Vectors are
the final hidden states pooled over the prompt (`pooling_type` "last", the default, or
"mean"), unit length unless `normalize` is false; `encoding_format` "base64" sends each as
its float32 bytes (little-endian), which the official client decodes by default.
`dimensions` is a 400: shortening a vector is sound only for Matryoshka-trained models, and
none is served here (vLLM refuses it the same way). Built and routed by `api_server.py`.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np

from pagedinfer.engine.input_processor import pooling_sampling_params
from pagedinfer.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedinfer.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_response,
    json_response,
    prefix_salt,
    salted,
    watched,
)
from pagedinfer.pooling_params import PoolingParams

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from pagedinfer.engine.input_processor import PromptType
    from pagedinfer.outputs import RequestOutput

__all__ = ["OpenAIServingEmbedding"]


class OpenAIServingEmbedding(OpenAIServing):
    """Handles `/v1/embeddings`."""

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        if (bad := self.check_model(request.model)) is not None:
            return bad
        if request.dimensions is not None:
            return error_response(
                400,
                f"dimensions ({request.dimensions}): {self.model_name} is not a Matryoshka "
                "embedding model, so its vectors cannot be shortened",
                "dimensions",
            )
        raw = request.input
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        if not items:
            return error_response(400, "input: at least one input is needed", "input")
        if (too_many := self.check_sequences(len(items))) is not None:
            return too_many
        salt = prefix_salt(raw_request, None)
        request_id = f"embd-{uuid.uuid4().hex}"
        try:  # the options, then every input, validated before any runs
            texts = [x for x in items if isinstance(x, str)]
            truncating = request.truncate_prompt_tokens is not None
            encoded = iter(await self.encode_prompts(texts, truncating))
            inputs: list[PromptType] = [
                salted(
                    {"prompt": x, "prompt_token_ids": next(encoded)}
                    if isinstance(x, str)
                    else {"prompt_token_ids": list(x)},  # type: ignore[arg-type]
                    salt,
                )
                for x in items
            ]
            pooling = PoolingParams(pooling_type=request.pooling_type, normalize=request.normalize)
            params = pooling_sampling_params(request.truncate_prompt_tokens)
            for i, prompt in enumerate(inputs):
                self.engine_client.input_processor.process(
                    f"{request_id}-check-{i}", prompt, params, pooling_params=pooling
                )
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), "input")
        results = await watched(
            raw_request,
            asyncio.gather(
                *(
                    self.engine_client.encode(
                        prompt,
                        pooling,
                        f"{request_id}-{i}",
                        truncate_prompt_tokens=request.truncate_prompt_tokens,
                    )
                    for i, prompt in enumerate(inputs)
                )
            ),
        )
        if not isinstance(results, list):
            return results  # the 499 / 400 / 503 `watched` answered
        return json_response(self._response(request, results, request_id))

    def _response(
        self, request: EmbeddingRequest, results: list[RequestOutput], request_id: str
    ) -> EmbeddingResponse:
        data = []
        for i, out in enumerate(results):
            if out.pooled is None:
                raise RuntimeError(f"input {i}: the engine returned no vector")
            vector: list[float] | str = out.pooled
            if request.encoding_format == "base64":
                raw = np.asarray(out.pooled, dtype="<f4").tobytes()
                vector = base64.b64encode(raw).decode("ascii")
            data.append(EmbeddingData(object="embedding", embedding=vector, index=i))
        num_prompt = sum(len(out.prompt_token_ids) for out in results)
        return EmbeddingResponse(
            id=request_id,
            object="list",
            created=int(time.time()),
            model=self.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_prompt, total_tokens=num_prompt),
        )
