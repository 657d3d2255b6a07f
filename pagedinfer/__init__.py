"""pagedinfer: an LLM inference engine with a paged KV cache and continuous batching.

Public API only; everything else is internal.
"""

from pagedinfer.platform import configure_matmul_caches

configure_matmul_caches()  # before any matmul runs; see pagedinfer/platform.py

# ruff: noqa: E402

from pagedinfer.entrypoints.llm import LLM
from pagedinfer.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from pagedinfer.pooling_params import PoolingParams
from pagedinfer.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
    "PoolingParams",
    "EmbeddingRequestOutput",
]
__version__ = "0.1.0"
