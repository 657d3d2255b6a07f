"""Tiny random-weight checkpoints of each model family, built with transformers' own classes.

`make_family_dir(family, path)` builds the family's `*ForCausalLM` from a small config (odd
head counts where the family allows, GQA, the family's own features: QKV biases, QK-norm...),
gives it random weights from a seed, and saves it as a Hugging Face directory with a
byte-level tokenizer. `convert_to_gguf(hf_dir, path)` writes the same weights as a GGUF
file under llama.cpp's names (the `gguf` package's tensor-name map and metadata keys,
llama.cpp's Q/K row interleaving for its `llama` architecture, and what its converter
writes for Phi-3's longrope), in float32.

The reference for every test is transformers' forward on the saved directory
(`reference_greedy`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from tests.model.tiny import VOCAB, _tokenizer_json

__all__ = ["FAMILIES", "convert_to_gguf", "make_family_dir", "reference_greedy"]

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_rng = np.random.default_rng(3)
_SHORT_FACTORS = [round(float(f), 4) for f in 1.0 + 0.3 * _rng.random(8)]
_LONG_FACTORS = [round(float(f), 4) for f in np.sort(1.0 + 20.0 * _rng.random(8) ** 2)]
"""Random longrope factors for head_dim 16 (the long ones growing with the wavelength, as
Phi-3's do, and far enough from the short ones to change the tokens)."""

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "gguf_arch": "llama",
              "rope_theta": 10000.0},
    "qwen2": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM", "gguf_arch": "qwen2",
              "rope_theta": 1000000.0},
    "qwen3": {"config": "Qwen3Config", "model": "Qwen3ForCausalLM", "gguf_arch": "qwen3",
              "rope_theta": 1000000.0},
    # Llama 3.1's RoPE scaling; the 64-token original context puts the tiny model's 8
    # frequencies in all three bands (kept, blended, divided).
    "llama3": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "gguf_arch": "llama",
               "rope_theta": 500000.0,
               "rope": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # Qwen2.5's long-context YaRN; llama.cpp's YaRN differs from transformers', so the GGUF
    # reader refuses it and this variant is tested from its Hugging Face directory only.
    "qwen2-yarn": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM", "gguf_arch": None,
                   "rope_theta": 1000000.0,
                   "rope": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}},
    # A window (24) smaller than every prompt (30-120) and than a chunk of them. llama.cpp
    # converts Mistral to its `llama` architecture; the window travels as
    # llama.attention.sliding_window.
    "mistral": {"config": "MistralConfig", "model": "MistralForCausalLM", "gguf_arch": "llama",
                "rope_theta": 10000.0, "extra": {"sliding_window": 24}},
    # Qwen2's sliding layers: those from max_window_layers up (1 and 2 here). llama.cpp's
    # qwen2 has no per-layer window, so this variant has no GGUF form.
    "qwen2-swa": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM", "gguf_arch": None,
                  "rope_theta": 1000000.0,
                  "extra": {"use_sliding_window": True, "sliding_window": 20,
                            "max_window_layers": 1}},
    # Sliding (20), global, sliding; soft caps (1 on scores, 3 on logits) low enough to
    # bend the random model's scores and logits; query_pre_attn_scalar = head_dim, as
    # llama.cpp assumes for all but 27B.
    "gemma2": {"config": "Gemma2Config", "model": "Gemma2ForCausalLM", "gguf_arch": "gemma2",
               "rope_theta": 10000.0, "tie": True,
               "extra": {"sliding_window": 20, "query_pre_attn_scalar": 16,
                         "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0,
                         "hidden_activation": "gelu_pytorch_tanh"}},
    # Six layers: five sliding (window 20, RoPE base 10k) and a global one (base 1M), the
    # 5:1 pattern llama.cpp fixes for gemma3.
    "gemma3": {"config": "Gemma3TextConfig", "model": "Gemma3ForCausalLM", "gguf_arch": "gemma3",
               "rope_theta": 1000000.0, "tie": True,
               "rope_parameters": {"full_attention": {"rope_type": "default",
                                                      "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0}},
               "extra": {"sliding_window": 20, "query_pre_attn_scalar": 16,
                         "num_hidden_layers": 6, "hidden_activation": "gelu_pytorch_tanh"}},
    # Phi-3: fused qkv_proj / gate_up_proj, a window (24) on every layer and longrope. The
    # original context (256) is at least every test's max_model_len, so the short factors
    # run on both sides; max_position_embeddings 1024 makes the attention factor
    # sqrt(1 + ln 4 / ln 256), not 1.
    "phi3": {"config": "Phi3Config", "model": "Phi3ForCausalLM", "gguf_arch": "phi3",
             "rope_theta": 10000.0,
             "rope": {"rope_type": "longrope", "short_factor": _SHORT_FACTORS,
                      "long_factor": _LONG_FACTORS},
             "extra": {"sliding_window": 24, "original_max_position_embeddings": 256}},
    # The same over a 64-token original context: an engine with max_model_len > 64 runs the
    # long factors for every position, transformers only once a sequence passes 64 tokens,
    # so it is tested with longer prompts (and with max_model_len <= 64, the short ones),
    # not by the every-path test.
    "phi3-long": {"config": "Phi3Config", "model": "Phi3ForCausalLM", "gguf_arch": "phi3",
                  "rope_theta": 10000.0, "long_prompts_only": True,
                  "rope": {"rope_type": "longrope", "short_factor": _SHORT_FACTORS,
                           "long_factor": _LONG_FACTORS},
                  "extra": {"sliding_window": 24, "original_max_position_embeddings": 64,
                            "max_position_embeddings": 256}},
}  # fmt: skip
"""family -> transformers classes, llama.cpp architecture and its own config values."""


def _config(family: str) -> Any:
    import transformers

    spec = FAMILIES[family]
    rope = {**spec.get("rope", {"rope_type": "default"}), "rope_theta": spec["rope_theta"]}
    kwargs = {
        **_BASE,
        "rope_parameters": spec.get("rope_parameters", rope),
        **spec.get("extra", {}),
    }
    if spec.get("tie"):
        kwargs["tie_word_embeddings"] = True
    if spec["config"] in ("Qwen2Config", "Phi3Config"):
        kwargs.pop("head_dim")  # derived: hidden / heads
        kwargs["hidden_size"] = _BASE["num_attention_heads"] * _BASE["head_dim"]
    config = getattr(transformers, spec["config"])(**kwargs)
    config.architectures = [spec["model"]]
    return config


def make_family_dir(family: str, path: str, seed: int = 0) -> str:
    """A tiny `family` checkpoint saved in `path` (a Hugging Face directory), float32."""
    import transformers

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family]["model"])(_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and family.startswith("gemma"):
                param.copy_(0.1 * torch.randn_like(param))  # Gemma scales by 1 + weight
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif "embed_tokens" in name and family.startswith("gemma"):
                # Gemma multiplies the embeddings by sqrt(hidden): this keeps them as large
                # as the others' (else they drown the layers' normed outputs, and the
                # window would not change a token).
                param.copy_(0.05 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(_tokenizer_json(), f)
    return path


def _permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved rows (its converter's transform)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.1 scaling: per frequency, 1 (short
    wavelengths), `factor` (long ones) or the blend between (its converter's formula)."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert_to_gguf(hf_dir: str, path: str, quant: str | None = None) -> str:
    """The checkpoint of `hf_dir` as a GGUF file at `path` (llama.cpp's names): float32, or
    with its layers' matrices in `quant` ("Q8_0": the `gguf` package's quantiser)."""
    import gguf
    from safetensors.numpy import load_file

    from pagedinfer.tokenizer import _byte_alphabet

    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    arch_name = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                 "Phi3ForCausalLM": "phi3"}[cfg["architectures"][0]]  # fmt: skip
    gemma = arch_name.startswith("gemma")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    n_layers = cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    names = gguf.get_tensor_name_map(arch, n_layers)

    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg["rope_parameters"]
    if arch_name == "gemma3":
        rope = rope["full_attention"]  # the sliding layers' base is llama.cpp's fixed 10k
        assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch_name == "phi3":
        # As llama.cpp's converter (Phi3MiniModel): the original context always, the window
        # always (0: none).
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    elif cfg.get("sliding_window") is not None:
        writer.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(writer, f"add_{key}")(cfg[key])
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, rope))
    elif rope["rope_type"] == "longrope":
        # llama.cpp's converter: cos/sin scaled by transformers' default attention factor of
        # the context's ratio, the factors as two tensors.
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        )
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    elif rope["rope_type"] != "default":
        raise ValueError(f"no GGUF form here for RoPE type {rope['rope_type']!r}")
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([_byte_alphabet()[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(False)

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    for hf_name, tensor in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no llama.cpp name for {hf_name}")
        if arch_name == "llama" and hf_name.endswith("q_proj.weight"):
            tensor = _permute_like_llama_cpp(tensor, heads)
        elif arch_name == "llama" and hf_name.endswith("k_proj.weight"):
            tensor = _permute_like_llama_cpp(tensor, kv_heads)
        elif gemma and hf_name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's converter stores Gemma's 1 + weight
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if quant is not None and name.startswith("blk.") and tensor.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_greedy(hf_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (float32, one at a time)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            out.append(y[0, len(ids) :].tolist())
    return out
