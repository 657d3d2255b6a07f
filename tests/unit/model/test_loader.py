"""Tests for the model loader: GGUF -> HF names (with the Q/K rotary row order undone), HF
directories (single and sharded safetensors, tying), export_hf_dir, and parity with transformers'
own GGUF loading of the default model (the check that proves the permutation undo).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedinfer.gguf_metadata import find_default_model
from pagedinfer.model.arch_config import ModelArchConfig
from pagedinfer.model.loader import (
    _undo_rope_permutation,
    export_hf_dir,
    load_model_config,
    load_model_weights,
)

# No model hub in tests; set before anything imports transformers/huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"

TINY = {"hidden": 8, "heads": 2, "kv_heads": 1, "ffn": 12, "vocab": 16, "layers": 2}


def _permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (the converter's forward transform)."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tiny_hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, ffn, vocab = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    head_dim = h // TINY["heads"]
    kv = TINY["kv_heads"] * head_dim

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": rand(h)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(ffn, h),
            p + "mlp.up_proj.weight": rand(ffn, h),
            p + "mlp.down_proj.weight": rand(h, ffn),
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
        }
    return w


_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _write_tiny_gguf(
    path: Path, hf: dict[str, np.ndarray], arch: str = "llama", extra: dict[str, Any] | None = None
) -> None:
    gguf = pytest.importorskip("gguf", reason="gguf's writer builds the tiny test file")
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra or {}).items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(64)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(3)
    for name, tensor in hf.items():
        if name.startswith("model.layers."):
            parts = name.split(".")  # model.layers.{i}.{module...}.weight
            i, module = parts[2], ".".join(parts[3:-1])
            gname = f"blk.{i}.{_TO_GGUF[module]}.weight"
            if module == "self_attn.q_proj":
                tensor = _permute_like_llama_cpp(tensor, TINY["heads"])
            elif module == "self_attn.k_proj":
                tensor = _permute_like_llama_cpp(tensor, TINY["kv_heads"])
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        writer.add_tensor(gname, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- permutation ------------------------------------------------------------------------------


def test_undo_rope_permutation_known_example() -> None:
    # one head, head_dim 4: HF rows [x0, x1, y0, y1] are stored as [x0, y0, x1, y1]
    gguf_rows = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)  # x0 y0 x1 y1
    np.testing.assert_array_equal(_undo_rope_permutation(gguf_rows, 1).ravel(), [0, 1, 2, 3])


@pytest.mark.parametrize(("num_heads", "head_dim"), [(9, 64), (3, 64), (2, 4)])
def test_undo_rope_permutation_inverts_converter(num_heads: int, head_dim: int) -> None:
    w = np.random.default_rng(1).standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    permuted = _permute_like_llama_cpp(w, num_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(_undo_rope_permutation(permuted, num_heads), w)


# ---- tiny GGUF --------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_names_layout_and_tying(tmp_path: Path, tied: bool) -> None:
    hf = _tiny_hf_weights(tied=tied)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, hf)
    config, weights = load_model_weights(str(path), torch.float32)
    assert config == load_model_config(str(path))
    assert config.tie_word_embeddings is tied
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 4)
    assert (config.rope_theta, config.max_position_embeddings, config.vocab_size) == (
        5000.0,
        64,
        TINY["vocab"],
    )
    assert config.eos_token_ids == (3,) and config.eos_token_id == 3 and config.bos_token_id == 1
    assert set(weights) == set(hf)
    for name, expected in hf.items():
        assert weights[name].dtype == torch.float32
        np.testing.assert_array_equal(weights[name].numpy(), expected, err_msg=name)


def test_tiny_gguf_bfloat16(tmp_path: Path) -> None:
    hf = _tiny_hf_weights()
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    _, weights = load_model_weights(str(tmp_path / "tiny.gguf"), torch.bfloat16)
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16 and q.is_contiguous()
    expected = torch.from_numpy(hf["model.layers.1.self_attn.q_proj.weight"]).bfloat16()
    assert torch.equal(q, expected)


def test_gguf_of_an_unsupported_architecture_rejected(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "x.gguf", _tiny_hf_weights(), arch="falcon")
    with pytest.raises(ValueError, match="'falcon' is not supported"):
        load_model_weights(str(tmp_path / "x.gguf"))


# ---- HF directories ---------------------------------------------------------------------------


def _hf_config_json(tied: bool) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": TINY["vocab"],
        "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["ffn"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": [3, 4],
    }


def _write_hf_dir(root: Path, tensors: dict[str, np.ndarray], tied: bool, sharded: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_hf_config_json(tied)))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    pt = {k: torch.from_numpy(v).bfloat16() for k, v in tensors.items()}  # stored as bf16
    if not sharded:
        save_file(pt, str(root / "model.safetensors"))
        return
    names = sorted(pt)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, keys in shards.items():
        save_file({k: pt[k] for k in keys}, str(root / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_hf_dir_of_another_architecture_rejected(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path, _tiny_hf_weights(tied=True), tied=True, sharded=False)
    config = {**_hf_config_json(tied=True), "architectures": ["FalconForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (load_model_config, load_model_weights):
        with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported"):
            load(str(tmp_path))


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_loads_untied(tmp_path: Path, sharded: bool) -> None:
    hf = _tiny_hf_weights(tied=False)
    _write_hf_dir(tmp_path, hf, tied=False, sharded=sharded)
    config, weights = load_model_weights(str(tmp_path), torch.float32)
    assert config == load_model_config(str(tmp_path))
    assert not config.tie_word_embeddings and "lm_head.weight" in weights
    assert config.eos_token_ids == (3, 4, 5) and config.eos_token_id == 3
    assert (config.head_dim, config.rope_theta) == (4, 500000.0)
    assert set(weights) == set(hf)
    for name, expected in hf.items():
        bf16_rounded = torch.from_numpy(expected).bfloat16().float()
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], bf16_rounded), name


@pytest.mark.parametrize("declared_tied", [True, False])
def test_hf_dir_ties_when_declared_or_lm_head_missing(tmp_path: Path, declared_tied: bool) -> None:
    # declared tied: lm_head is in the file but dropped; undeclared: lm_head is absent
    hf = _tiny_hf_weights(tied=not declared_tied)
    _write_hf_dir(tmp_path, hf, tied=declared_tied, sharded=False)
    config, weights = load_model_weights(str(tmp_path), torch.bfloat16)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_missing_path_and_bad_dtype(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model_weights(str(tmp_path / "nope.gguf"))
    _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights())
    with pytest.raises(ValueError, match="dtype"):
        load_model_weights(str(tmp_path / "tiny.gguf"), torch.int8)


def test_arch_config_is_frozen_and_validated() -> None:
    config = load_model_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="eos"):
        dataclasses.replace(config, eos_token_ids=())
    d = dataclasses.replace(config, eos_token_ids=(2, 7)).to_hf_config_dict()
    assert d["eos_token_id"] == [2, 7] and d["architectures"] == ["LlamaForCausalLM"]
    assert d["rope_parameters"]["rope_theta"] == config.rope_theta


# ---- default model ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_loads(dtype: torch.dtype) -> None:
    # How fast it loads is a benchmark figure (docs/benchmarks.md, "Start-up"), not a test.
    config, weights = load_model_weights(None, dtype)
    assert config == ModelArchConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=float(np.float32(1e-5)), rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    assert len(weights) == 2 + 30 * 9 and "lm_head.weight" not in weights
    assert all(w.dtype == dtype for w in weights.values())
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.fixture(scope="module")
def hf_gguf_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own dequantised, un-permuted load of the default GGUF (float32)."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    path = find_default_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return dict(model.state_dict())


@pytest.mark.integration
def test_default_model_matches_transformers(hf_gguf_state_dict: dict[str, torch.Tensor]) -> None:
    _, ours = load_model_weights(None, torch.float32)
    # transformers lists the tied lm_head too; we leave it out because it is tied.
    assert set(hf_gguf_state_dict) - set(ours) == {"lm_head.weight"}
    for name, tensor in ours.items():
        reference = hf_gguf_state_dict[name]
        assert tensor.shape == reference.shape, name
        # (assert_close is ~20x slower on 135M elements; a max-abs check says the same)
        assert (tensor - reference).abs().max().item() <= 1e-6, name


@pytest.mark.integration
def test_export_hf_dir_round_trip(
    tmp_path: Path, hf_gguf_state_dict: dict[str, torch.Tensor]
) -> None:
    transformers = pytest.importorskip("transformers")
    out = export_hf_dir(None, tmp_path / "smollm2", torch.float32)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):  # fmt: skip
        assert os.path.exists(os.path.join(out, name)), name

    # our loader reads it back to the same config and tensors
    config, reloaded = load_model_weights(out, torch.float32)
    assert config == load_model_config(None)
    _, original = load_model_weights(None, torch.float32)
    assert set(reloaded) == set(original)
    assert all(torch.equal(reloaded[k], original[k]) for k in original)

    # transformers reads it as a tied Llama with the same weights as its GGUF path
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, hf_gguf_state_dict[name]), name

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nVietnamese: Xin chào 12345  x<|im_end|>"
    from pagedinfer.tokenizer import Tokenizer

    assert hf_tok.encode(text) == Tokenizer.from_model_path(None).encode(text)
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_load_plan_reads_exactly_a_ranks_shard(default_gguf_path: str) -> None:
    """A tensor-parallel rank's rows (read alone, `load_tensor_rows`) and a pipeline
    stage's layers equal the same slices of the whole matrices."""
    from pagedinfer.model.loader import load_model_config, load_model_weights
    from pagedinfer.model.sharding import load_plan

    config = load_model_config(default_gguf_path)
    wanted, rows = load_plan(config, 1, 3, 1, 2)  # tp rank 1/3, stage 2/2
    _, full = load_model_weights(default_gguf_path, wanted=wanted)
    _, part = load_model_weights(default_gguf_path, wanted=wanted, rows=rows)
    assert set(part) == set(full)
    assert not any(k.startswith(("model.layers.0.", "model.layers.14.")) for k in part)
    assert "model.layers.15.mlp.down_proj.weight" in part and "model.norm.weight" in part
    hd = config.head_dim
    q = part["model.layers.20.self_attn.q_proj.weight"]  # heads 3..5 of 9
    assert torch.equal(q, full["model.layers.20.self_attn.q_proj.weight"][3 * hd : 6 * hd])
    k = part["model.layers.20.self_attn.k_proj.weight"]  # KV head 1 of 3
    assert torch.equal(k, full["model.layers.20.self_attn.k_proj.weight"][hd : 2 * hd])
    inter = config.intermediate_size // 3
    up = part["model.layers.29.mlp.up_proj.weight"]
    assert torch.equal(up, full["model.layers.29.mlp.up_proj.weight"][inter : 2 * inter])
    embed = part["model.embed_tokens.weight"]  # tied LM head on the last stage
    assert torch.equal(embed, full["model.embed_tokens.weight"][16384:32768])
    down = "model.layers.15.mlp.down_proj.weight"  # row-parallel: cut by columns later
    assert torch.equal(part[down], full[down])


def test_phi3_fused_matrices_split_in_both_formats(tmp_path: Path) -> None:
    """Phi-3's qkv_proj / gate_up_proj (llama.cpp's attn_qkv / ffn_up) come back as Llama's
    q/k/v and gate/up rows, from the HF directory and from GGUF alike; a tensor-parallel
    rank reads its rows of each part; a Q8_0 file's blocks split the same way."""
    from safetensors.torch import load_file

    from pagedinfer.model.loader import load_quant_blocks
    from tests.model.families import convert_to_gguf, make_family_dir

    hf_dir = make_family_dir("phi3", str(tmp_path / "hf"))
    gguf_path = convert_to_gguf(hf_dir, str(tmp_path / "f32.gguf"))
    config, from_hf = load_model_weights(hf_dir)
    gguf_config, from_gguf = load_model_weights(gguf_path)
    assert set(from_hf) == set(from_gguf)
    assert all(torch.equal(from_hf[k], from_gguf[k]) for k in from_hf)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in from_hf)
    fused = load_file(os.path.join(hf_dir, "model.safetensors"))
    p = "model.layers.1."
    qkv, gate_up = fused[p + "self_attn.qkv_proj.weight"], fused[p + "mlp.gate_up_proj.weight"]
    q_rows, kv_rows, inter = 6 * 16, 2 * 16, config.intermediate_size  # [q; k; v], [gate; up]
    expected = {
        "self_attn.q_proj": qkv[:q_rows], "self_attn.k_proj": qkv[q_rows : q_rows + kv_rows],
        "self_attn.v_proj": qkv[q_rows + kv_rows :], "mlp.gate_proj": gate_up[:inter],
        "mlp.up_proj": gate_up[inter:],
    }  # fmt: skip
    for name, rows in expected.items():
        assert torch.equal(from_gguf[f"{p}{name}.weight"], rows), name

    from pagedinfer.model.sharding import load_plan

    wanted, row_plan = load_plan(gguf_config, 1, 2, 0, 1)  # TP rank 1 of 2
    _, shard = load_model_weights(gguf_path, wanted=wanted, rows=row_plan)
    halves = {"self_attn.q_proj": q_rows // 2, "self_attn.k_proj": kv_rows // 2,
              "self_attn.v_proj": kv_rows // 2, "mlp.gate_proj": inter // 2,
              "mlp.up_proj": inter // 2}  # fmt: skip
    for name, half in halves.items():
        assert torch.equal(shard[f"{p}{name}.weight"], expected[name][half:]), name

    q8_path = convert_to_gguf(hf_dir, str(tmp_path / "q8.gguf"), quant="Q8_0")
    q8_config, dense = load_model_weights(q8_path)
    blocks = load_quant_blocks(q8_path, q8_config)
    matrices = (*halves, "self_attn.o_proj", "mlp.down_proj")
    assert {k for k in blocks if k.startswith(p)} == {f"{p}{n}.weight" for n in matrices}
    for name in blocks:
        np.testing.assert_array_equal(blocks[name].dequantize(), dense[name].numpy(), err_msg=name)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({}, 24),
        ({"phi3.attention.sliding_window": 0}, None),  # Phi-4: none
        ({"phi3.attention.sliding_window": 1024}, None),  # spans the context: none in effect
        ({"phi3.attention.sliding_window": None}, "lacks phi3.attention.sliding_window"),
        ({"phi3.expert_count": 4}, "GGUF metadata phi3.expert_count = 4 is not supported"),
        ({"phi3.rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn' beside rope_factors"),
    ],
    ids=["window", "zero", "whole-context", "absent", "unknown-key", "scaling-type"],
)
def test_phi3_gguf_metadata(tmp_path: Path, metadata: dict[str, Any], expected: Any) -> None:
    from tests.model.families import convert_to_gguf, make_family_dir

    path = convert_to_gguf(make_family_dir("phi3", str(tmp_path / "hf")), str(tmp_path / "m.gguf"))
    if metadata:
        path = _with_metadata(tmp_path, path, metadata)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            load_model_config(path)
    else:
        assert load_model_config(path).sliding_window == expected


def _with_metadata(tmp_path: Path, path: str, changes: dict[str, Any]) -> str:
    """A copy of a GGUF file with some metadata values changed (uint32, float32, string),
    added, or (value None) removed."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    out = str(tmp_path / "changed.gguf")
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in changes:
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, kind)
    for key, value in changes.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif value is not None:
            writer.add_float32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
