"""A Hugging Face `config.json` -> `ModelArchConfig`, refusing what the model code lacks.

Every key of `config.json` is accounted for, one of three ways:
- *read*: it sets a `ModelArchConfig` field (hidden sizes, heads, RoPE, norms, ids...);
- *checked*: it changes the math, and only some values are implemented (`attention_bias`
  must be false for Llama; RoPE may be plain or scaled by `linear`, `llama3`, `yarn` or
  Phi-3's `longrope`). Another value is refused with the key and its value named;
- *inert*: it does not change a forward pass (dropout rates, `use_cache`, label maps, the
  transformers version, generation defaults of old configs). `INERT_KEYS` lists them.
A key in none of these is refused too, naming it: a field this code has never seen may
change the math (a sliding window, experts, a soft cap), and serving it wrong is worse than
not serving it. Supporting a new field means reading or checking it here and implementing
it in the model.

Callers: `model/loader.py` (`load_model_config`, `load_model_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from pagedinfer.model.arch_config import (
    FULL_ATTENTION_LAYER,
    ROPE_SCALING_KEYS,
    SLIDING_LAYER,
    ModelArchConfig,
    RopeScaling,
)
from pagedinfer.model.registry import architecture_features, check_architecture

__all__ = ["INERT_KEYS", "read_json", "hf_arch_config"]

INERT_KEYS = frozenset(
    {
        # Bookkeeping and outputs of PretrainedConfig.
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
        "torch_dtype", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
        "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
        "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
        "cross_attention_hidden_size", "id2label", "label2id", "problem_type", "finetuning_task",
        "prefix", "task_specific_params", "tokenizer_class", "pad_token_id", "sep_token_id",
        "decoder_start_token_id", "output_router_logits",
        # Where remote code for the architecture lives (Phi-3's configs carry it): never run
        # here; the architecture is implemented as transformers' own class is.
        "auto_map",
        # Training only.
        "initializer_range", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop",
        "router_aux_loss_coef",
        # Generation defaults that old configs carry (generation_config.json's job; the
        # request's sampling parameters decide here).
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens",
        # Llama's `pretraining_tp` splits the projections' matmuls into slices that are
        # summed: the same product, only a different summation order.
        "pretraining_tp",
    }
)  # fmt: skip

_READ_KEYS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act",
    }
)  # fmt: skip

_ROPE_NO_OP: dict[str, object] = {"partial_rotary_factor": 1.0}
"""RoPE parameters whose value here changes nothing."""

_Check = Callable[[Any], bool]
"""Whether a value of a checked key is one the model code implements."""


def _false(value: Any) -> bool:
    return value is None or value is False


def _silu(value: Any) -> bool:
    return value == "silu"


def _gelu_tanh(value: Any) -> bool:
    return value in ("gelu_pytorch_tanh", "gelu_tanh")


def _one(value: Any) -> bool:
    return value is None or value == 1.0


_CHECKED: dict[str, dict[str, _Check]] = {
    "LlamaForCausalLM": {
        "attention_bias": _false,
        "mlp_bias": _false,
        "hidden_act": _silu,
    },
    "MistralForCausalLM": {"hidden_act": _silu},
    "Qwen2ForCausalLM": {"hidden_act": _silu},
    "Qwen3ForCausalLM": {"attention_bias": _false, "hidden_act": _silu},
    "Gemma2ForCausalLM": {
        "attention_bias": _false,
        "hidden_act": _gelu_tanh,
        "hidden_activation": _gelu_tanh,
        "use_bidirectional_attention": _false,
    },
    "Gemma3ForCausalLM": {
        "attention_bias": _false,
        "hidden_act": _gelu_tanh,
        "hidden_activation": _gelu_tanh,
        "use_bidirectional_attention": _false,
    },
    # Phi3Config has no attention_bias (Phi3Attention has no biases), but released configs
    # carry `false`; a rotary share below 1 (Phi-4-mini: 0.75) rotates only part of each
    # head, which the rotary code does not implement.
    "Phi3ForCausalLM": {
        "attention_bias": _false,
        "hidden_act": _silu,
        "partial_rotary_factor": _one,
    },
}
"""architecture -> {config key: accepted values}: the keys its model code implements for
some values only (or, `_any`, that matter only with another key's refused value)."""


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's RoPE: (global base, global scaling, the sliding layers' base), from
    `rope_parameters` per layer type (transformers >= 5) or from `rope_theta`,
    `rope_scaling` and `rope_local_base_freq` (older configs). The sliding layers' RoPE
    must be plain."""
    params = cfg.get("rope_parameters") or {}
    if FULL_ATTENTION_LAYER in params or SLIDING_LAYER in params:
        theta, scaling = _rope({"rope_parameters": params.get(FULL_ATTENTION_LAYER, {})})
        local = params.get(SLIDING_LAYER, {})
        local_theta, local_scaling = _rope({"rope_parameters": local})
        if local_scaling is not None:
            raise ValueError(
                f"config.json: rope_parameters.{SLIDING_LAYER} {local} is not supported "
                "(the sliding layers' RoPE must be plain)"
            )
        return theta, scaling, local_theta
    theta, scaling = _rope(cfg)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10000.0))


def _rope(cfg: dict[str, Any], longrope: bool = False) -> tuple[float, RopeScaling | None]:
    """(RoPE base, scaling) from `rope_parameters` or the older `rope_scaling` (both are
    checked when both are present). A RoPE type or key the code does not implement is
    refused by name; `longrope` only where asked (Phi-3: `_phi3_rope` reads its defaults
    as transformers' Phi3Config does)."""
    theta = cfg.get("rope_theta")
    scaling: RopeScaling | None = None
    types = [t for t in ROPE_SCALING_KEYS if longrope or t != "longrope"]
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" and rope_type not in types:
            raise ValueError(
                f"config.json: {key} {rope} (rope_type {rope_type!r}) is not supported "
                f"(supported: default, {', '.join(types)})"
            )
        allowed = ROPE_SCALING_KEYS.get(rope_type, ())
        for name, value in rope.items():
            if name in ("rope_type", "type", "rope_theta") or name in allowed:
                continue
            if value != _ROPE_NO_OP.get(name):
                raise ValueError(f"config.json: {key}.{name}={value!r} is not supported")
        if theta is None:
            theta = rope.get("rope_theta")
        if rope_type != "default" and scaling is None:
            fields = {
                name: tuple(rope[name]) if isinstance(rope[name], list) else rope[name]
                for name in allowed
                if rope.get(name) is not None
            }  # lists (longrope's factors) as tuples: RopeScaling is frozen
            if "factor" not in fields:
                raise ValueError(f"config.json: {key} of type {rope_type!r} lacks 'factor'")
            scaling = RopeScaling(rope_type=rope_type, **fields)
    return float(10000.0 if theta is None else theta), scaling


_PHI3_LONGROPE_ALIASES = ("su", "yarn", "longrope")
"""Phi-3's RoPE types that transformers' Phi3Config reads as longrope (`su` is the early
configs' name; `yarn` is mapped too)."""


def _max_position_embeddings(cfg: dict[str, Any], architecture: str) -> int:
    """`max_position_embeddings`, or the config class's default (Phi3Config's is 4096)."""
    default = 4096 if architecture == "Phi3ForCausalLM" else 2048
    return int(cfg.get("max_position_embeddings", default))


def _phi3_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Phi-3's RoPE, plain or longrope, read as transformers' Phi3Config does: the aliases
    above, the top-level `original_max_position_embeddings` (default 4096) over the RoPE
    dict's own, and `factor` (which sets the attention factor) defaulting to
    max_position_embeddings / original_max_position_embeddings."""
    cfg = dict(cfg)
    original = int(cfg.get("original_max_position_embeddings", 4096))
    for key in ("rope_parameters", "rope_scaling"):
        rope = dict(cfg.get(key) or {})
        if rope.get("rope_type", rope.get("type")) in _PHI3_LONGROPE_ALIASES:
            rope.pop("type", None)
            rope["rope_type"] = "longrope"
            rope["original_max_position_embeddings"] = original
            if rope.get("factor") is None:
                rope["factor"] = _max_position_embeddings(cfg, "Phi3ForCausalLM") / original
            cfg[key] = rope
    return _rope(cfg, longrope=True)


def _architecture(cfg: dict[str, Any]) -> str:
    """`architectures[0]`; a config without it is taken as Llama only if its `model_type`
    says so (or is absent, as in hand-written configs)."""
    if cfg.get("architectures"):
        return str(cfg["architectures"][0])
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"config.json has no 'architectures' and model_type {model_type!r}: name the "
            "model class in 'architectures'"
        )
    return "LlamaForCausalLM"


_FAMILY_READ_KEYS: dict[str, frozenset[str]] = {
    "MistralForCausalLM": frozenset({"sliding_window"}),
    "Phi3ForCausalLM": frozenset({"sliding_window", "original_max_position_embeddings"}),
    "Qwen2ForCausalLM": frozenset(
        {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    ),
    "Gemma2ForCausalLM": frozenset(
        {"sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
         "final_logit_softcapping", "cache_implementation"}
    ),
    "Gemma3ForCausalLM": frozenset(
        {"sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
         "final_logit_softcapping", "rope_local_base_freq", "sliding_window_pattern",
         "_sliding_window_pattern", "cache_implementation"}
    ),
}  # fmt: skip
"""architecture -> the keys `_family_fields` reads beyond `_READ_KEYS`."""
_FAMILY_READ_KEYS["Qwen3ForCausalLM"] = _FAMILY_READ_KEYS["Qwen2ForCausalLM"]


def _layer_types(cfg: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """`layer_types`, or transformers' default when absent: every `pattern`-th layer
    global, the others sliding (Gemma 2: 2, Gemma 3: 6)."""
    if cfg.get("layer_types") is not None:
        return tuple(cfg["layer_types"])
    return tuple(
        FULL_ATTENTION_LAYER if (i + 1) % pattern == 0 else SLIDING_LAYER
        for i in range(int(cfg["num_hidden_layers"]))
    )


def _family_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The `ModelArchConfig` fields of a family's own keys (windows, soft caps...)."""
    if architecture == "MistralForCausalLM":
        return {"sliding_window": cfg.get("sliding_window")}
    if architecture == "Phi3ForCausalLM":
        # As transformers' Phi3Attention: the window, if any, on every layer. One that spans
        # the whole context (Phi-3-mini-128k: 262144) never masks anything: dropped, so
        # those layers keep the kernels that take no window.
        window = cfg.get("sliding_window")
        max_len = _max_position_embeddings(cfg, architecture)
        return {"sliding_window": window if window is not None and window < max_len else None}
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # As transformers: the window applies only with `use_sliding_window`, on the layers
        # `layer_types` marks (by default those from `max_window_layers` up).
        if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
            return {}
        types = cfg.get("layer_types") or [
            SLIDING_LAYER if i >= int(cfg.get("max_window_layers", 28)) else FULL_ATTENTION_LAYER
            for i in range(int(cfg["num_hidden_layers"]))
        ]
        return {"sliding_window": int(cfg["sliding_window"]), "layer_types": tuple(types)}
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        pattern = 2 if architecture == "Gemma2ForCausalLM" else int(
            cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        )  # fmt: skip
        caps = {
            key: None if cfg.get(key) is None else float(cfg[key])
            for key in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        return {
            "sliding_window": int(cfg.get("sliding_window", 4096)),
            "layer_types": _layer_types(cfg, pattern),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            **caps,
        }
    return {}


def _check_keys(cfg: dict[str, Any], architecture: str) -> None:
    checked = _CHECKED.get(architecture, {})
    family_keys = _FAMILY_READ_KEYS.get(architecture, frozenset())
    for key, value in cfg.items():
        if key in family_keys:
            continue
        if key in checked:
            if not checked[key](value):
                raise ValueError(
                    f"config.json: {key}={value!r} is not supported for {architecture}"
                )
        elif key not in _READ_KEYS and key not in INERT_KEYS:
            raise ValueError(
                f"config.json: field {key!r} (= {value!r}) is not supported for "
                f"{architecture}: pagedinfer does not implement it, and it may change the "
                "model's outputs"
            )


def hf_arch_config(model_dir: str, has_lm_head: bool) -> ModelArchConfig:
    """The config of a Hugging Face model directory (`config.json`, plus the extra stop ids
    of `generation_config.json`); tied embeddings if declared or if there is no lm_head.
    ValueError naming the architecture or the first key the model code does not implement."""
    cfg = read_json(os.path.join(model_dir, "config.json"))
    architecture = check_architecture(_architecture(cfg))
    _check_keys(cfg, architecture)
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    fields = _family_fields(cfg, architecture)
    if architecture == "Gemma3ForCausalLM":
        rope_theta, rope_scaling, fields["sliding_rope_theta"] = _gemma3_rope(cfg)
    elif architecture == "Phi3ForCausalLM":
        rope_theta, rope_scaling = _phi3_rope(cfg)
    else:
        rope_theta, rope_scaling = _rope(cfg)
    # Stop ids: config.json's EOS first, then any extra ones generation_config.json lists.
    eos_ids = list(_as_id_tuple(cfg.get("eos_token_id")))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        extra = _as_id_tuple(read_json(gen_path).get("eos_token_id"))
        eos_ids += [i for i in extra if i not in eos_ids]
    tie = bool(cfg.get("tie_word_embeddings", False)) or not has_lm_head
    config = ModelArchConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_max_position_embeddings(cfg, architecture),
        tie_word_embeddings=tie,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        architecture=architecture,
        hidden_act=cfg.get("hidden_act", "silu"),
        **fields,
    )
    return dataclasses.replace(config, **architecture_features(architecture))
