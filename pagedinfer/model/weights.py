"""Checkpoint weights onto the decoder's parameters: names, fusion, TP slices, quant blocks.

Role: the seam between the loader's HF-named tensors (`model/loader.py`) and the model's
own parameters (`model/llama.py`). `gguf_to_hf_name` maps llama.cpp tensor names to Hugging
Face ones (the loader reads GGUF files under HF names); `fused_parts` says how a checkpoint
that stores q/k/v or gate/up fused (Phi-3) splits into Llama's separate matrices, which the
loader hands on, so that sharding and quantised blocks see one layout; `install_weights`
fuses q/k/v and gate/up (`sharding.PROJECTIONS`, their biases alike), keeps this rank's
slices and stage's layers and makes the tensors the parameters; `install_quantized` gives
the projections the file's own quantised blocks, cut the same way.

Invariants:
- `install_weights` covers every parameter exactly once and refuses leftovers; it consumes
  the state dict as it goes and installs the loaded tensors themselves (no copy into
  preallocated parameters), so peak memory stays near one copy of the weights and the
  model may be built on the meta device.
- A matrix may arrive whole or already cut to this rank's rows (`sharding.load_plan`);
  both give the same parameters.
- A projection given only its quantised weight (`install_quantized(keep_dense=False)`,
  before `install_weights`) has no dense parameter: `install_weights` neither expects nor
  keeps one for it, and the loader need not read it (`quant_only_weight_names`).

Callers: `LlamaForCausalLM.load_weights` / `load_quantized` (the worker calls those) and
the loader (`gguf_to_hf_name`, `fused_parts`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedinfer.model.quant import (
    GROUP_SIZE,
    QuantizedParts,
    QuantizedWeight,
    QuantMatrix,
    concat_blocks,
    quantize_q8_0,
)
from pagedinfer.model.sharding import PROJECTIONS, keep_part, shard_ranges, vocab_slice

if TYPE_CHECKING:
    from pagedinfer.model.arch_config import ModelArchConfig
    from pagedinfer.model.llama import LlamaForCausalLM

__all__ = [
    "fused_parts",
    "gguf_to_hf_name",
    "install_quantized",
    "install_quantized_head",
    "install_weights",
    "lm_head_name",
    "quant_only_weight_names",
    "quantized_projections",
]

# llama.cpp tensor name -> HF name; `{i}` is the layer index.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    # Gemma's four norms: llama.cpp's `ffn_norm` is the one before the MLP here.
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_PHI3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    # llama.cpp's phi3 keeps Phi-3's fused matrices: [q; k; v] rows, and [gate; up] rows
    # under `ffn_up` (its SwiGLU takes the first half as the gate, as Phi3MLP's chunk does).
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, config: ModelArchConfig) -> str:
    """A llama.cpp tensor name -> its Hugging Face name for `config`'s family (Gemma's four
    norms, Phi-3's fused matrices); ValueError if it has none."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _GGUF_LAYER_NAMES
    if config.gemma_norms:
        layer_names = _GGUF_GEMMA_LAYER_NAMES
    elif config.architecture == "Phi3ForCausalLM":
        layer_names = _GGUF_PHI3_LAYER_NAMES
    match = _GGUF_LAYER_RE.match(name)
    if match is None or match.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} is not supported (no equivalent in the model)")
    return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"


_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def fused_parts(name: str, config: ModelArchConfig) -> list[tuple[str, int, int]] | None:
    """A fused checkpoint matrix, named as the model's fused parameter (Phi-3's
    `self_attn.qkv_proj`, `mlp.gate_up_proj`) -> each part's Llama name and its rows
    [start, end) in the fused matrix, in `PROJECTIONS`' order; None for any other name."""
    match = _HF_LAYER_RE.match(name)
    parts = PROJECTIONS.get(match.group(2)) if match is not None else None
    if match is None or parts is None or len(parts) == 1:
        return None
    hd = config.head_dim
    rows = {
        "q": config.num_attention_heads * hd,
        "kv": config.num_key_value_heads * hd,
        "mlp": config.intermediate_size,
    }
    layer, kind = match.group(1), match.group(3)
    out, start = [], 0
    for part in parts:
        assert part.rows is not None  # fused parts are stacked by rows
        out.append((f"model.layers.{layer}.{part.name}.{kind}", start, start + rows[part.rows]))
        start += rows[part.rows]
    return out


@torch.no_grad()
def install_weights(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Install HF-named Llama weights into `model` (see the module invariants); under
    tensor/pipeline parallelism only this rank's slices and its stage's layers, dropping
    the rest as it goes. ValueError on a shape mismatch, a leftover or a missing weight."""
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()

    def put(name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        tensor = tensor.contiguous()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            # A shard is a view of the whole matrix: copy it, so the rest can be freed.
            tensor = tensor.clone()
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        loaded.add(name)

    sd = state_dict
    config, shard = model.config, model.shard
    ranges = shard_ranges(config, shard)
    embed = sd.pop("model.embed_tokens.weight", None)
    if model.embed_tokens is not None:
        assert embed is not None, "model.embed_tokens.weight was not loaded"
        put("embed_tokens.weight", vocab_slice(embed, config, shard))
    del embed
    norm = sd.pop("model.norm.weight", None)
    if model.norm is not None:
        assert norm is not None, "model.norm.weight was not loaded"
        put("norm.weight", norm)
    head = sd.pop("lm_head.weight", None)
    if model.lm_head is not None:
        assert head is not None, "an untied model without lm_head.weight"
        put("lm_head.weight", vocab_slice(head, config, shard))
    del head
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if not model.layer_start <= i < model.layer_end:
            for k in [k for k in sd if k.startswith(p)]:  # another pipeline stage's layer
                del sd[k]
            continue
        local = i - model.layer_start
        m = f"layers.{local}."
        layer = model.layers[local]
        for target, parts in PROJECTIONS.items():
            kinds = (
                ("weight", "bias") if layer.get_submodule(target).bias is not None else ("weight",)
            )
            for kind in kinds:
                if getattr(layer.get_submodule(target), kind) is None:
                    # Quantised only (`Linear.set_quant(keep_dense=False)`): not loaded, or
                    # dropped here if it was (an HF directory is read whole).
                    for part in parts:
                        sd.pop(f"{p}{part.name}.{kind}", None)
                    continue
                pieces = [
                    keep_part(sd.pop(f"{p}{part.name}.{kind}"), part, ranges) for part in parts
                ]
                put(f"{m}{target}.{kind}", pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        for name, _ in list(layer.named_parameters()):
            if f"{m}{name}" not in loaded:  # norms: the same name in file and model
                put(f"{m}{name}", sd.pop(f"{p}{name}"))
    # Rotary inverse frequencies are recomputed, never loaded.
    leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"Unexpected weights: {leftover[:5]}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"Missing weights: {sorted(missing)[:5]}")


def quantized_projections(
    model: LlamaForCausalLM,
    blocks: dict[str, QuantMatrix],
    kernels: Any,
    activations: str = "auto",
) -> dict[str, QuantizedWeight | QuantizedParts]:
    """This rank's projections that `blocks` (the file's quantised matrices) cover, cut as
    its dense weights are: {module path ("layers.3.mlp.gate_up_proj"): kernel-ready
    weight}. Reads only the model's shapes and sharding, so it works on a model still on
    the meta device (before its dense weights exist)."""
    out: dict[str, QuantizedWeight | QuantizedParts] = {}
    ranges = shard_ranges(model.config, model.shard)
    row_ids = {kind: np.arange(*ranges[kind]) for kind in ("q", "kv", "mlp")}
    sharded = model.tp.world_size > 1
    for local in range(model.num_local_layers):
        i = model.layer_start + local
        for target, parts in PROJECTIONS.items():
            names = [f"model.layers.{i}.{part.name}.weight" for part in parts]
            if not all(n in blocks for n in names):
                continue
            pieces = []
            try:
                for name, part in zip(names, parts):
                    b = blocks[name]
                    if sharded and part.rows is not None:
                        b = b.take_rows(row_ids[part.rows])
                    if sharded and part.cols is not None:
                        b = b.take_cols(*ranges[part.cols])
                    pieces.append(b)
            except ValueError:  # a shard boundary inside a file block: this one runs dense
                continue
            joined = concat_blocks(pieces)
            # Parts in different formats (Gemma 3's Q5_0 q/k and Q8_0 v): one kernel each.
            out[f"layers.{local}.{target}"] = (
                QuantizedWeight(joined, kernels, activations)
                if joined is not None
                else QuantizedParts([QuantizedWeight(b, kernels, activations) for b in pieces])
            )
    return out


def quant_only_weight_names(model: LlamaForCausalLM) -> set[str]:
    """HF names of the file's matrices that no dense parameter of `model` needs: the parts
    of every projection given its quantised weight with `keep_dense=False`
    (`Linear.set_quant`). The loader skips them (`load_model_weights(wanted=...)`)."""
    names: set[str] = set()
    for local, layer in enumerate(model.layers):
        i = model.layer_start + local
        for target, parts in PROJECTIONS.items():
            if layer.get_submodule(target).weight is None:
                names.update(f"model.layers.{i}.{part.name}.weight" for part in parts)
    return names


def install_quantized(
    model: LlamaForCausalLM,
    blocks: dict[str, QuantMatrix],
    kernels: Any,
    max_rows: int,
    activations: str = "auto",
    keep_dense: bool = True,
) -> int:
    """Give `model`'s projections for steps of <= max_rows rows the file's own quantised
    matrices (`quantized_projections`); the contract is `LlamaForCausalLM.load_quantized`'s.
    `keep_dense=False`: every step runs them and the dense weights are dropped (call this
    before `install_weights`, which then expects no dense weight for them). Returns the
    number of matrices given a quantised path."""
    quants = quantized_projections(model, blocks, kernels, activations)
    for path, quant in quants.items():
        model.get_submodule(path).set_quant(quant, max_rows, keep_dense=keep_dense)
    return len(quants)


def lm_head_name(model: LlamaForCausalLM) -> str:
    """The HF name of the matrix the LM head multiplies by (tied: the embedding's)."""
    return "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"


def install_quantized_head(
    model: LlamaForCausalLM,
    blocks: dict[str, QuantMatrix],
    kernels: Any,
    max_rows: int,
    quantize_lm_head: bool,
    activations: str = "auto",
) -> int:
    """Give the LM head for steps of <= max_rows rows the file's quantised copy of its
    matrix (tied: the embedding's), else, if `quantize_lm_head`, a Q8_0 quantisation of
    the dense one (so after `install_weights`). Returns 1 if it got one, else 0."""
    if not model.pp.is_last_rank:
        return 0
    head_blocks = blocks.get(lm_head_name(model))
    lo, hi = shard_ranges(model.config, model.shard)["vocab"]
    if head_blocks is not None and model.tp.world_size > 1:
        head_blocks = head_blocks.take_rows(np.arange(lo, hi))
    if head_blocks is None and quantize_lm_head and model.config.hidden_size % GROUP_SIZE == 0:
        head_blocks = quantize_q8_0(model.lm_head_weight[: hi - lo])
    if head_blocks is None:
        return 0
    model.lm_head_quant = QuantizedWeight(head_blocks, kernels, activations)
    model.lm_head_quant_max_rows = max_rows
    return 1
