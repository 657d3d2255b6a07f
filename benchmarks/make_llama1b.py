"""A checkpoint with Llama-3.2-1B's shapes and random weights, for benchmarks at ~1B scale.

No such weights can be downloaded here, and an engine's speed depends only on the shapes, so
this writes the model every engine reads, in the forms users download:

    <out>/llama1b-shaped.F16.gguf      the weights (llama.cpp names), float16
    <out>/llama1b-shaped.Q4_0.gguf     llama.cpp's own quantiser (llama_model_quantize)
    <out>/llama1b-shaped.Q4_K_M.gguf   likewise (Q4_K with Q6_K for half of the FFN down
                                       and V matrices, as llama-quantize picks)
    <out>/llama1b-shaped-bf16/         a Hugging Face directory (pagedinfer's export_hf_dir)

Shapes as Llama-3.2-1B's config: hidden 2048, FFN 8192, 16 layers, 32 query heads over 8 KV
heads of 64, vocabulary 128,256, tied embeddings. The vocabulary is SmolLM2's BPE (49,152
tokens: the shared workload's ids stay valid) followed by reserved special tokens up to
128,256, so the LM head has Llama 3's size. RoPE is plain (theta 500,000) without Llama 3.1's
frequency scaling: no compute difference, and every peer reads it. Weights are N(0, 0.02),
norms 1.

Runs with the repo venv; the quantisation step runs llama.cpp through the llama-cpp-python
venv of benchmarks/peers/install.sh (`--llamacpp-python`):

    .venv/bin/python benchmarks/make_llama1b.py --out /opt/peers/models   (~3 minutes, 5 GB)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = {
    "hidden": 2048,
    "ffn": 8192,
    "layers": 16,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 64,
    "vocab": 128256,
    "context": 131072,
    "rope_theta": 500000.0,
    "rms_eps": 1e-5,
}
NAME = "llama1b-shaped"
_QUANTISE = """
import sys, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(rc)
"""
_FTYPES = {"Q4_0": 2, "Q4_K_M": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def _tokenizer_fields(default_gguf: str) -> dict:
    """SmolLM2's BPE from the default model's file, padded with reserved tokens."""
    import gguf

    reader = gguf.GGUFReader(default_gguf)

    def value(key: str):  # type: ignore[no-untyped-def]
        return reader.fields[key].contents()

    tokens = list(value("tokenizer.ggml.tokens"))
    types = list(value("tokenizer.ggml.token_type"))
    extra = SHAPES["vocab"] - len(tokens)
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(extra)]
    types += [gguf.TokenType.CONTROL] * extra
    return {
        "tokens": tokens,
        "types": types,
        "merges": list(value("tokenizer.ggml.merges")),
        "pre": value("tokenizer.ggml.pre"),
        "bos": value("tokenizer.ggml.bos_token_id"),
        "eos": value("tokenizer.ggml.eos_token_id"),
        "template": value("tokenizer.chat_template"),
    }


def write_f16_gguf(path: str, seed: int) -> None:
    import gguf

    from pagedinfer.gguf_metadata import find_default_model

    s = SHAPES
    tok = _tokenizer_fields(find_default_model())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(NAME)
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["rms_eps"])
    writer.add_vocab_size(s["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["template"])

    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (0.02 * rng.standard_normal((rows, cols), dtype=np.float32)).astype(np.float16)

    hidden, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(s["vocab"], hidden))
    writer.add_tensor("output_norm.weight", ones)
    for i in range(s["layers"]):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones)
        writer.add_tensor(f"{blk}.attn_q.weight", matrix(s["heads"] * s["head_dim"], hidden))
        writer.add_tensor(f"{blk}.attn_k.weight", matrix(kv, hidden))
        writer.add_tensor(f"{blk}.attn_v.weight", matrix(kv, hidden))
        writer.add_tensor(f"{blk}.attn_output.weight", matrix(hidden, s["heads"] * s["head_dim"]))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones)
        writer.add_tensor(f"{blk}.ffn_gate.weight", matrix(s["ffn"], hidden))
        writer.add_tensor(f"{blk}.ffn_up.weight", matrix(s["ffn"], hidden))
        writer.add_tensor(f"{blk}.ffn_down.weight", matrix(hidden, s["ffn"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers = os.environ.get("PEERS_DIR", "/opt/peers")
    parser.add_argument("--out", default=os.path.join(peers, "models"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--llamacpp-python",
        default="/opt/peers/llamacpp/bin/python",
        help="a python with llama-cpp-python, for the quantised files ('' skips them)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the bf16 HF directory")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    f16 = os.path.join(args.out, f"{NAME}.F16.gguf")
    if not os.path.exists(f16):
        start = time.perf_counter()
        write_f16_gguf(f16 + ".part", args.seed)
        os.replace(f16 + ".part", f16)
        print(f"wrote {f16} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.llamacpp_python:
        for kind, ftype in _FTYPES.items():
            out = os.path.join(args.out, f"{NAME}.{kind}.gguf")
            if os.path.exists(out):
                continue
            start = time.perf_counter()
            cmd = [args.llamacpp_python, "-c", _QUANTISE, f16, out + ".part", str(ftype)]
            subprocess.run([*cmd, str(args.threads)], check=True)
            os.replace(out + ".part", out)
            print(f"wrote {out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    hf_dir = os.path.join(args.out, f"{NAME}-bf16")
    if not args.no_hf and not os.path.exists(os.path.join(hf_dir, "config.json")):
        import torch

        from pagedinfer.model.loader import export_hf_dir

        start = time.perf_counter()
        export_hf_dir(f16, hf_dir, dtype=torch.bfloat16)
        print(f"wrote {hf_dir} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
