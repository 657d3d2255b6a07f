"""The worker: owns the device, the model weights, the KV cache tensors and the runner.

Startup (`Worker.load_model` then `initialize_cache`) mirrors vLLM: load weights, size the
KV cache from the configured byte budget, report the number of blocks back to the engine,
which settles max_model_len and builds its scheduler around them, then allocate one
`[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer and build the RoPE
tables (longrope's factors depend on max_model_len). Per step the executor calls
`execute_model` / `sample_tokens`, which the runner implements.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from pagedinfer.attention.backend import AttentionBackend
from pagedinfer.attention.cpu_sdpa import CpuPagedBackend, CpuSdpaBackend
from pagedinfer.attention.kv_quant import cache_row_dim, resolve_kv_cache_dtype
from pagedinfer.attention.torch_ref import TorchRefBackend
from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedinfer.distributed.kv_transfer.base import layer_name as kv_layer_name
from pagedinfer.distributed.kv_transfer.factory import create_connector
from pagedinfer.distributed.parallel_state import get_pp_group, get_tp_group, init_distributed
from pagedinfer.kernels.cpu import kernel_isa
from pagedinfer.model.arch_config import ModelArchConfig
from pagedinfer.model.linear import Linear
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.model.loader import (
    gguf_matrix_type_counts,
    load_model_config,
    load_model_weights,
    load_quant_blocks,
    path_is_gguf,
)
from pagedinfer.model.quant import QuantMatrix
from pagedinfer.model.registry import get_model_class
from pagedinfer.model.sharding import PROJECTIONS, TPShard, WeightFilter, load_plan
from pagedinfer.model.weights import lm_head_name, quant_only_weight_names
from pagedinfer.platform import HeapTrimmer, ThreadGovernor, release_free_heap
from pagedinfer.spec_decode.draft_model import DraftModel
from pagedinfer.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_FLOAT_MATRIX_TYPES = frozenset({"F32", "F16", "BF16"})
"""GGUF matrix types that are not quantised."""

__all__ = [
    "Worker",
    "auto_int8_activations",
    "default_quant_max_tokens",
    "kv_cache_bytes_per_block",
    "resolve_dtype",
]

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_ref": TorchRefBackend,
    "cpu_sdpa": CpuSdpaBackend,
    "cpu_paged": CpuPagedBackend,
}


# Batch size oneDNN tunes the packed layout for (Linear.prepack). On the 200-request
# offline benchmark hints 32/64/128 measured 421/413-438/420 output tok/s (noise +-5%),
# unpacked 381: the hint matters little, packing does.
PREPACK_BATCH_HINT = 64


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: where bf16 matmuls measured ~2x fp32 on our machines.

    Only where torch itself runs its AVX-512 kernels: held to AVX2 (`ATEN_CPU_CAPABILITY`,
    as when measuring the AVX2 paths on an AVX-512 machine) its bf16 ops are emulated.
    """
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        # Held below AVX-512 by PAGEDINFER_MAX_CPU_ISA, the engine runs as it would on such a
        # CPU: float32, the dtype measured faster there.
        native = cpu_has_native_bf16() and kernel_isa() in ("avx512", "amx")
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


# The largest step (in rows) for which the quantised kernels beat the dense weights, per kernel
# tier and activation mode (docs/benchmarks.md, "quant_max_tokens"). On AVX-512 with bfloat16
# (int8 activations) steps of 16+ rows (32+ for Q5_0/K-quants) run a register-blocked VNNI GEMM
# over tiles of 6 rows (every format): on Zen 5 it beat oneDNN's dense bf16 at every size
# measured (SmolLM2's four Q4_1 products of a layer 1.37x at 512 rows, 1.35x at 2,048; Q5_0
# 1.39x, Q4_K 1.31-1.40x, Q5_K 1.26x at 512; Q6_K 1.05-1.15x since its zero point seeds the
# sums, 0.81-0.95x before), and with 2,048 a 512-token prefill ran 1.30x
# faster than with 256 (SmolLM2) and 1.17-1.29x than with 32 (Gemma 3, Q4_K_M), whose 200
# ShareGPT requests offline ran 1.22-1.30x faster (SmolLM2's: level, 749-769 vs 710-824).
# On AVX2 (float32 models) the quantised path won to 64 rows with exact activations (1.14x
# over 32 there, 0.96x at 128); with int8 ones every format's product beat dense float32 at
# every size measured (Q4_1 1.32x and Q8_0 1.13x at 1,024 rows, Q4_K 1.57x, Q5_0 1.24x,
# Q6_K 1.04x at 512). 2048 is the default token budget: every step up to it. Other tiers (no
# AVX2, NEON, float32 on AVX-512, AMX, whose dense bf16 GEMMs run on tiles) keep 32.
_QUANT_MAX_TOKENS = {("avx2", False): 64, ("avx2", True): 2048, ("avx512", True): 2048}
_QUANT_MAX_TOKENS_OTHER = 32


def default_quant_max_tokens(tier: str, int8_activations: bool) -> int:
    """`ModelConfig.quant_max_tokens` when left unset, for kernel tier `tier`."""
    return _QUANT_MAX_TOKENS.get((tier, int8_activations), _QUANT_MAX_TOKENS_OTHER)


def auto_int8_activations(dtype: torch.dtype, requested_dtype: str, tier: str) -> bool:
    """What `quant_activations="auto"` means for a model of `dtype` (`requested_dtype`: the
    config's, maybe "auto") on kernel tier `tier`: int8 for bfloat16/float16 models, and for
    float32 ones only where float32 is the AVX2 tier's `dtype="auto"` (the speed-first
    setting there: with int8 activations every row of the AVX2 table beside llama.cpp's AVX2
    build was at or above it, with exact ones batch-1 decode was below on every model;
    docs/benchmarks.md). An explicit `dtype="float32"` keeps exact activations (greedy
    parity with transformers). Float32 on AVX-512 without bf16 keeps them too: int8 there
    is unmeasured."""
    if dtype != torch.float32:
        return True
    return requested_dtype == "auto" and tier == "avx2"


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of every layer's K and V in a cache of `dtype` (int8: rows of
    head_dim codes and a 4-byte scale)."""
    elem = torch.empty((), dtype=dtype).element_size()
    row = cache_row_dim(arch.head_dim, dtype)
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * row * elem


def _without(wanted: WeightFilter | None, names: set[str]) -> WeightFilter:
    """`wanted` (None: every weight) less `names`."""
    return lambda name: name not in names and (wanted is None or wanted(name))


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        """`rank` in [0, tensor x pipeline parallel size); a worker of a larger world joins
        the process groups here (`distributed_init_method`: "tcp://host:port")."""
        self.config = config
        self.rank = rank
        self.dtype = resolve_dtype(config.model_config.dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, self.dtype)
        if config.model_config.num_threads is not None:
            torch.set_num_threads(config.model_config.num_threads)
        par = config.parallel_config
        if par.world_size > 1:
            assert distributed_init_method is not None
            init_distributed(
                rank,
                par.tensor_parallel_size,
                par.pipeline_parallel_size,
                distributed_init_method,
            )
        self.local_arch: ModelArchConfig | None = None
        """The architecture as this rank holds it: its KV heads and its stage's layers."""
        self.arch: ModelArchConfig | None = None
        self.model: LlamaForCausalLM | None = None
        self.quant_max_tokens = 0
        """The largest step run on the quantised matrices (the resolved `quant_max_tokens`)."""
        self.runner: ModelRunner | None = None
        self.kv_connector: KVConnectorBase | None = None
        # A separate draft model (speculative "draft_model" with `model`): arch, model, backend.
        self.draft: tuple[ModelArchConfig, LlamaForCausalLM, AttentionBackend] | None = None
        self.load_time_s = 0.0
        self.heap_trimmer = HeapTrimmer()
        self.thread_governor: ThreadGovernor | None = None
        if config.model_config.adapt_threads:
            self.thread_governor = ThreadGovernor(torch.set_num_threads, torch.get_num_threads())

    def load_model(self) -> ModelArchConfig:
        arch = self._load_model()
        # Loading's temporaries died with _load_model's frame: hand their pages back before
        # the KV cache is allocated, so the process peak stays weights + KV + overhead.
        release_free_heap()
        return arch

    def _load_model(self) -> ModelArchConfig:
        start = time.perf_counter()
        torch.manual_seed(self.config.model_config.seed)
        arch, model, backend = self._build_model(self.config.model_config.model)
        self.arch, self.model, self.backend = arch, model, backend
        self.local_arch = dataclasses.replace(
            arch,
            num_attention_heads=model.shard.num_heads,
            num_key_value_heads=model.shard.num_kv_heads,
            num_hidden_layers=model.num_local_layers,
            layer_types=None
            if arch.layer_types is None
            else arch.layer_types[model.layer_start : model.layer_end],
        )
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model" and spec.model is not None:
            draft_arch, draft, draft_backend = self._build_model(spec.model)
            if draft_arch.vocab_size != arch.vocab_size:
                raise ValueError(
                    f"The draft model's vocabulary ({draft_arch.vocab_size} tokens) differs "
                    f"from the target's ({arch.vocab_size}): it must share the tokenizer."
                )
            self.draft = (draft_arch, draft, draft_backend)
            logger.info(
                "Draft model %s: %d layers, hidden size %d.",
                spec.model, draft_arch.num_hidden_layers, draft_arch.hidden_size,
            )  # fmt: skip
        self.load_time_s = time.perf_counter() - start
        return arch

    def _build_model(
        self, path: str | None
    ) -> tuple[ModelArchConfig, LlamaForCausalLM, AttentionBackend]:
        """Load a model's weights into a model built on the meta device; its RoPE tables
        come in `initialize_cache` (`_build_rotary`)."""
        tp, pp = get_tp_group(), get_pp_group()
        arch = load_model_config(path)
        wanted: WeightFilter | None = None
        rows = None
        if tp.world_size * pp.world_size > 1:
            # Read only this rank's layers and rows of the file, not the whole model.
            wanted, rows = load_plan(
                arch, tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
            )
        shard = TPShard.of(arch, tp.rank_in_group, tp.world_size)
        backend = self._make_backend(
            dataclasses.replace(
                arch, num_attention_heads=shard.num_heads, num_key_value_heads=shard.num_kv_heads
            )
        )
        # Built on the meta device: load_weights installs the loaded tensors as parameters,
        # so the weights exist once in memory, not twice.
        model_class = get_model_class(arch.architecture)
        with torch.device("meta"):
            model = model_class(arch, backend)
        kernels = backend.kernel if isinstance(backend, CpuPagedBackend) else None
        max_rows = 0
        activations = self.config.model_config.quant_activations
        int8 = False
        if kernels is not None:  # the paged backend's C++ build
            int8 = (
                activations == "int8"
                or (
                    activations == "auto"
                    and auto_int8_activations(
                        self.dtype, self.config.model_config.dtype, kernel_isa()
                    )
                )
            ) and kernels.quant_linear_uses_int8_activations()
            if activations == "auto":  # resolved once here, not per call from x's dtype
                activations = "int8" if int8 else "float32"
            wanted_rows = self.config.model_config.quant_max_tokens
            max_rows = (
                default_quant_max_tokens(kernel_isa(), int8) if wanted_rows is None else wanted_rows
            )
        self.quant_max_tokens = max_rows
        blocks: dict[str, QuantMatrix] = {}
        num_quant = 0
        skip: set[str] = set()
        if kernels is not None and max_rows > 0:
            blocks = load_quant_blocks(path, arch, wanted)
            # When the quantised kernels take every step the scheduler can form, the dense
            # copies would never be read: they are neither loaded nor kept.
            keep_dense = max_rows < self.config.scheduler_config.max_num_batched_tokens
            num_quant = model.load_quantized(blocks, kernels, max_rows, activations, keep_dense)
            # The projections' blocks are packed now; only the head's are still to be used
            # (Q4/Q8 blocks are copies out of the file: don't hold them while loading).
            head = lm_head_name(model)
            blocks = {head: blocks[head]} if head in blocks else {}
            skip = quant_only_weight_names(model)
            if skip:
                wanted = _without(wanted, skip)
        _, state_dict = load_model_weights(path, self.dtype, wanted=wanted, rows=rows)
        model.load_weights(state_dict)
        del state_dict
        if kernels is not None and max_rows > 0:
            num_quant += model.load_quantized_head(
                blocks,
                kernels,
                max_rows,
                quantize_lm_head=self.dtype != torch.float32,
                activations=activations,
            )
            dense = model.num_local_layers * len(PROJECTIONS) + int(model.pp.is_last_rank)
            dense -= num_quant
            types = gguf_matrix_type_counts(path) if path_is_gguf(path) else []
            if dense > 0 and {kind for kind, _ in types} - _FLOAT_MATRIX_TYPES:
                # Say it: the file is quantised, but these matrices are not run that way.
                logger.info(
                    "%d of the model's matrices run dense (dequantised to %s) at every batch "
                    "size: the quantised kernels take Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and "
                    "Q6_K blocks (matrix types in this file: %s).",
                    dense,
                    str(self.dtype).removeprefix("torch."),
                    ", ".join(f"{kind} x{n}" for kind, n in types),
                )
            if num_quant:
                logger.info(
                    "Quantised weights (the file's own blocks) for steps of <= %d tokens on "
                    "%d matrices%s%s.",
                    max_rows,
                    num_quant,
                    " (int8 activations)" if int8 else "",
                    "; no dense copy of the projections: every step runs them" if skip else "",
                )
        if self.dtype == torch.bfloat16:
            # oneDNN's own weight layout, once, instead of a reorder in every matmul.
            model.prepack_dense_weights(PREPACK_BATCH_HINT)
        if isinstance(backend, CpuPagedBackend):
            # The C++ build the paged backend uses also has the fused layer ops.
            model.enable_fused_ops(backend.kernel)
        model.eval()
        return arch, model, backend

    def _make_backend(self, arch: ModelArchConfig) -> AttentionBackend:
        name = self.config.model_config.attention_backend
        args = (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
        scale = arch.head_dim**-0.5
        quantized = self.kv_cache_dtype == torch.int8
        if name == "auto":
            try:
                return CpuPagedBackend(*args, scale, quantized_cache=quantized)
            except RuntimeError:
                return CpuSdpaBackend(*args, scale)
        if name == "cpu_paged":
            return CpuPagedBackend(*args, scale, quantized_cache=quantized)
        return _BACKENDS[name](*args, scale)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block over all layers (a separate draft model's included: its
        cache has the same blocks)."""
        assert self.local_arch is not None
        bs = self.config.cache_config.block_size
        dtype = self.kv_cache_dtype
        total = kv_cache_bytes_per_block(self.local_arch, bs, dtype)
        if self.draft is not None:
            total += kv_cache_bytes_per_block(self.draft[0], bs, dtype)
        if self._eagle():
            assert self.arch is not None
            total += kv_cache_bytes_per_block(self.arch, bs, dtype) // max(
                self.arch.num_hidden_layers, 1
            )  # the head's one decoder layer
        return total

    def _eagle(self) -> bool:
        spec = self.config.speculative_config
        return spec is not None and spec.method == "eagle"

    def num_kv_blocks(self) -> int:
        return self.config.cache_config.kv_cache_memory_bytes // self.kv_bytes_per_block()

    def _build_rotary(self, max_model_len: int) -> None:
        """The RoPE tables, real buffers, for every position of the model's context."""
        assert self.arch is not None and self.model is not None
        num_positions = self.arch.max_position_embeddings
        self.model.build_rotary(num_positions, max_model_len)
        if self.draft is not None:
            draft_arch, draft, _ = self.draft
            # As long as the target's: the draft sees the same positions.
            draft.build_rotary(
                max(draft_arch.max_position_embeddings, num_positions), max_model_len
            )

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV cache and the runner for the engine's `max_model_len` (settled
        from `num_kv_blocks` by the engine)."""
        assert self.local_arch is not None and self.model is not None
        self._build_rotary(max_model_len)
        arch, bs = self.local_arch, self.config.cache_config.block_size
        kv_caches = self._kv_caches(arch, num_blocks)
        draft_model = None
        if self.draft is not None:
            draft_arch, draft, draft_backend = self.draft
            draft_model = DraftModel(draft, draft_backend, self._kv_caches(draft_arch, num_blocks))
        head_kv_cache = None
        if self._eagle():  # one layer shaped as the target's
            one_layer = dataclasses.replace(arch, num_hidden_layers=1, layer_types=None)
            head_kv_cache = self._kv_caches(one_layer, num_blocks)[0]
        kv_connector = create_connector(self.config, KVConnectorRole.WORKER)
        if kv_connector is not None:
            start = self.model.layer_start
            kv_connector.register_kv_caches(
                {kv_layer_name(start + i): cache for i, cache in enumerate(kv_caches)}
            )
        self.kv_connector = kv_connector
        self.runner = ModelRunner(
            self.model,
            self.backend,
            kv_caches,
            bs,
            vocab_size=arch.vocab_size,
            speculative_config=self.config.speculative_config,
            logprobs_mode=self.config.model_config.logprobs_mode,
            draft_model=draft_model,
            head_kv_cache=head_kv_cache,
            kv_connector=kv_connector,
            dtype=self.dtype,
        )
        release_free_heap()  # loading's temporaries (~150 MB); see pagedinfer/platform.py

    def _kv_caches(self, arch: ModelArchConfig, num_blocks: int) -> list[torch.Tensor]:
        bs = self.config.cache_config.block_size
        # Zero-filled, so a padded gather never reads NaN garbage from an unwritten slot.
        dtype = self.kv_cache_dtype
        row = cache_row_dim(arch.head_dim, dtype)  # head_dim (+ the int8 rows' scale)
        return [
            torch.zeros(2, num_blocks, bs, arch.num_key_value_heads, row, dtype=dtype)
            for _ in range(arch.num_hidden_layers)
        ]  # [2, num_blocks, block_size, num_kv_heads, row] per layer

    def shutdown(self) -> None:
        """Release what outlives a step: the KV connector's threads and sockets."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def ping(self) -> str:
        return "pong"

    def rank_info(self) -> dict[str, Any]:
        """This rank's place and share of the model (tests and logs): its pid, tensor and
        pipeline ranks, decoder layers, heads, parameter bytes (dense) and the bytes of the
        quantised matrices beside them."""
        assert self.model is not None
        model = self.model
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "tp_rank": model.tp.rank_in_group,
            "pp_rank": model.pp.rank_in_group,
            "layers": [model.layer_start, model.layer_end],
            "num_heads": model.shard.num_heads,
            "num_kv_heads": model.shard.num_kv_heads,
            "kv_head_start": model.shard.kv_head_start(model.config.num_key_value_heads),
            # Storage, not element counts: a shard that kept its whole matrix alive shows.
            "param_bytes": sum(
                p.numel() * p.dtype.itemsize if p.is_mkldnn else p.untyped_storage().nbytes()
                for p in model.parameters()
            ),
            "quant_bytes": sum(
                m.quant.nbytes
                for m in model.modules()
                if isinstance(m, Linear) and m.quant is not None
            )
            + (model.lm_head_quant.nbytes if model.lm_head_quant is not None else 0),
        }

    def _after_step(self) -> None:
        self.heap_trimmer.maybe_trim()
        if self.thread_governor is not None:
            self.thread_governor.after_step()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        assert self.runner is not None
        output = self.runner.sample_tokens(grammar_output)
        self._after_step()
        return output
