"""The worker: owns the device, the model weights, the KV cache tensors and the runner.

Startup (`Worker.load_model` then `initialize_cache`) mirrors vLLM: load weights, size the
KV cache from the configured byte budget, allocate one `[2, num_blocks, block_size,
num_kv_heads, head_dim]` tensor per layer, and report the number of blocks back to the
engine, which builds its scheduler around it. Per step the executor calls
`execute_model` / `sample_tokens`, which the runner implements.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedinfer.attention.backend import AttentionBackend
from pagedinfer.attention.cpu_sdpa import CpuPagedBackend, CpuSdpaBackend
from pagedinfer.attention.torch_ref import TorchRefBackend
from pagedinfer.config import EngineConfig
from pagedinfer.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.model.loader import ModelArchConfig, load_model_weights, load_quant_blocks
from pagedinfer.platform import HeapTrimmer, release_free_heap
from pagedinfer.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["Worker", "resolve_dtype", "kv_cache_bytes_per_block"]

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
    """AVX512-BF16 or AMX-BF16: where bf16 matmuls measured ~2x fp32 on our machines."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * elem


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dtype = resolve_dtype(config.model_config.dtype)
        if config.model_config.num_threads is not None:
            torch.set_num_threads(config.model_config.num_threads)
        self.arch: ModelArchConfig | None = None
        self.model: LlamaForCausalLM | None = None
        self.runner: ModelRunner | None = None
        self.load_time_s = 0.0
        self.heap_trimmer = HeapTrimmer()

    def load_model(self) -> ModelArchConfig:
        arch = self._load_model()
        # Loading's temporaries died with _load_model's frame: hand their pages back before
        # the KV cache is allocated, so the process peak stays weights + KV + overhead.
        release_free_heap()
        return arch

    def _load_model(self) -> ModelArchConfig:
        start = time.perf_counter()
        torch.manual_seed(self.config.model_config.seed)
        arch, state_dict = load_model_weights(self.config.model_config.model, self.dtype)
        backend = self._make_backend(arch)
        # Built on the meta device: load_weights installs the loaded tensors as parameters,
        # so the weights exist once in memory, not twice.
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, backend)
        model.rotary = type(model.rotary)(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta
        )  # RoPE tables: real buffers, computed here
        model.load_weights(state_dict)
        del state_dict
        max_rows = self.config.model_config.quant_max_tokens
        if max_rows > 0 and isinstance(backend, CpuPagedBackend):
            blocks = load_quant_blocks(self.config.model_config.model, arch)
            num_quant = model.load_quantized(
                blocks, backend.kernel, max_rows, quantize_lm_head=self.dtype != torch.float32
            )
            logger.info(
                "Quantised weights (the file's own blocks) for steps of <= %d tokens on %d "
                "matrices%s.",
                max_rows,
                num_quant,
                " (int8 activations, VNNI)"
                if self.dtype != torch.float32
                and backend.kernel.quant_linear_uses_int8_activations()
                else "",
            )
        if self.dtype == torch.bfloat16:
            # oneDNN's own weight layout, once, instead of a reorder in every matmul.
            model.prepack_dense_weights(PREPACK_BATCH_HINT)
        if isinstance(backend, CpuPagedBackend):
            # The C++ build the paged backend uses also has the fused layer ops.
            model.enable_fused_ops(backend.kernel)
        model.eval()
        self.arch, self.model, self.backend = arch, model, backend
        self.load_time_s = time.perf_counter() - start
        return arch

    def _make_backend(self, arch: ModelArchConfig) -> AttentionBackend:
        name = self.config.model_config.attention_backend
        args = (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
        scale = arch.head_dim**-0.5
        if name == "auto":
            try:
                return CpuPagedBackend(*args, scale)
            except RuntimeError:
                return CpuSdpaBackend(*args, scale)
        return _BACKENDS[name](*args, scale)

    def kv_bytes_per_block(self) -> int:
        assert self.arch is not None
        return kv_cache_bytes_per_block(self.arch, self.config.cache_config.block_size, self.dtype)

    def num_kv_blocks(self) -> int:
        return self.config.cache_config.kv_cache_memory_bytes // self.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.arch is not None and self.model is not None
        arch, bs = self.arch, self.config.cache_config.block_size
        # Zero-filled, so a padded gather never reads NaN garbage from an unwritten slot.
        kv_caches = [
            torch.zeros(
                2, num_blocks, bs, arch.num_key_value_heads, arch.head_dim, dtype=self.dtype
            )  # [2, num_blocks, block_size, num_kv_heads, head_dim]
            for _ in range(arch.num_hidden_layers)
        ]
        self.runner = ModelRunner(
            self.model, self.backend, kv_caches, bs, vocab_size=arch.vocab_size
        )
        release_free_heap()  # loading's temporaries (~150 MB); see pagedinfer/platform.py

    def _after_step(self) -> None:
        self.heap_trimmer.maybe_trim()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
        assert self.runner is not None
        output = self.runner.sample_tokens(grammar_output)
        self._after_step()
        return output
