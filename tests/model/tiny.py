"""A tiny random-weight Llama written as a Hugging Face directory, built by the tests.

2 layers, hidden 64, 4 heads / 2 KV heads (GQA), vocab 256 with a byte-level tokenizer.
Loads in milliseconds, so engine paths (paging, chunking, batching) can be compared with
transformers' own forward in float32 quickly.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

VOCAB = 256
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


def _tokenizer_json() -> dict:
    # Byte-level BPE whose vocabulary is the 256 byte symbols (ids 0-255), no merges; ids 1
    # and 2 double as BOS/EOS, like many real vocabularies' control tokens.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def make_tiny_llama_dir(path: str, seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rnd(VOCAB, h, scale=0.5), "model.norm.weight": 1 + rnd(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": rnd(q, h),
                p + "self_attn.k_proj.weight": rnd(kv, h),
                p + "self_attn.v_proj.weight": rnd(kv, h),
                p + "self_attn.o_proj.weight": rnd(h, q),
                p + "mlp.gate_proj.weight": rnd(inter, h),
                p + "mlp.up_proj.weight": rnd(inter, h),
                p + "mlp.down_proj.weight": rnd(h, inter),
                p + "input_layernorm.weight": 1 + rnd(h),
                p + "post_attention_layernorm.weight": 1 + rnd(h),
            }
        )
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(_tokenizer_json(), f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": None, "add_bos_token": False}, f)
    return path
