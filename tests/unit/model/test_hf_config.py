"""What a checkpoint's config may hold: every key is read, checked or known inert; the rest,
and the architectures the engine does not run, are refused with the key named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedinfer.model.hf_config import hf_arch_config
from pagedinfer.model.loader import load_model_config, load_model_weights
from tests.unit.model.test_loader import TINY, _write_tiny_gguf

transformers = pytest.importorskip("transformers", reason="the configs are transformers' own")


def _save(config: Any, root: Path) -> str:
    config.save_pretrained(str(root))
    return str(root)


def _tiny(cls: type, **overrides: Any) -> Any:
    kwargs = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    config = cls(**{**kwargs, **overrides})
    config.architectures = [
        cls.__name__.replace("TextConfig", "Config")[: -len("Config")] + "ForCausalLM"
    ]
    return config


def test_transformers_llama_config_is_read_whole(tmp_path: Path) -> None:
    path = _save(_tiny(transformers.LlamaConfig, rope_theta=5000.0, head_dim=32), tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {"attention_bias", "mlp_bias", "pretraining_tp", "initializer_range"} <= set(saved)
    config = hf_arch_config(path, has_lm_head=True)
    assert (config.num_hidden_layers, config.head_dim, config.rope_theta) == (2, 32, 5000.0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"sliding_window": 24}, "field 'sliding_window'"),
        ({"attn_logit_softcapping": 50.0}, "field 'attn_logit_softcapping'"),
        ({"quantization_config": {"quant_method": "awq"}}, "field 'quantization_config'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e4}},
            "rope_type 'dynamic'",
        ),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 8}},
            "rope_parameters.beta_fast=8",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5",
        ),
    ],
)
def test_llama_fields_the_model_lacks_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    _save(_tiny(transformers.LlamaConfig), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        hf_arch_config(str(tmp_path), has_lm_head=True)


def test_mistral_sliding_window_is_read_for_every_layer(tmp_path: Path) -> None:
    # It used to load as Llama and generate wrong tokens: the window was ignored. Now it is
    # the layers' window (tests/integration/test_model_families.py: token parity).
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(_tiny(transformers.MistralConfig, sliding_window=24))
    model.save_pretrained(str(tmp_path))
    for load in (load_model_config, lambda p: load_model_weights(p, torch.float32)[0]):
        config = load(str(tmp_path))
        assert config.sliding_window == 24 and config.layer_types is None
        assert [config.attention_options(i).sliding_window for i in range(2)] == [24, 24]


def test_qwen2_slides_only_with_use_sliding_window_from_max_window_layers(tmp_path: Path) -> None:
    off = _tiny(transformers.Qwen2Config, sliding_window=16, num_hidden_layers=3)
    assert hf_arch_config(_save(off, tmp_path / "off"), True).sliding_window is None
    on = _tiny(
        transformers.Qwen2Config, use_sliding_window=True, sliding_window=16,
        max_window_layers=1, num_hidden_layers=3,
    )  # fmt: skip
    config = hf_arch_config(_save(on, tmp_path / "on"), True)
    assert [config.attention_options(i).sliding_window for i in range(3)] == [None, 16, 16]


def test_gemma_configs_are_read(tmp_path: Path) -> None:
    g2 = _tiny(
        transformers.Gemma2Config, head_dim=16, num_hidden_layers=4, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )  # fmt: skip
    config = hf_arch_config(_save(g2, tmp_path / "g2"), False)
    assert config.architecture == "Gemma2ForCausalLM" and config.gemma_norms
    assert [config.is_sliding(i) for i in range(4)] == [True, False, True, False]
    assert config.attention_options(1).logits_soft_cap == 50.0
    assert (config.final_logit_softcapping, config.attention_scale) == (30.0, 24**-0.5)
    g3 = _tiny(transformers.Gemma3TextConfig, head_dim=16, num_hidden_layers=7, sliding_window=8)
    config = hf_arch_config(_save(g3, tmp_path / "g3"), False)
    assert [config.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    assert (config.rope_theta, config.sliding_rope_theta, config.qk_norm) == (1e6, 1e4, True)
    assert config.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize(
    ("cls", "change", "named"),
    [
        ("Gemma2Config", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ("Gemma3TextConfig", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "Gemma3TextConfig",
            {"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            }},
            "sliding layers' RoPE must be plain",
        ),
        ("MistralConfig", {"layer_types": ["sliding_attention"] * 2}, "field 'layer_types'"),
    ],
)  # fmt: skip
def test_family_fields_the_model_lacks_are_refused_by_name(
    tmp_path: Path, cls: str, change: dict[str, Any], named: str
) -> None:
    _save(_tiny(getattr(transformers, cls), head_dim=16), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=named):
        hf_arch_config(str(tmp_path), has_lm_head=False)


_FACTORS = {"short_factor": [1.0 + 0.01 * i for i in range(8)], "long_factor": [2.0] * 8}


def test_phi3_config_is_read(tmp_path: Path) -> None:
    phi3 = _tiny(
        transformers.Phi3Config, sliding_window=24, max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, **_FACTORS},
    )  # fmt: skip
    path = _save(phi3, tmp_path)
    config = hf_arch_config(path, has_lm_head=True)
    assert config.architecture == "Phi3ForCausalLM" and config.head_dim == 16
    assert [config.attention_options(i).sliding_window for i in range(2)] == [24, 24]
    scaling = config.rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert (scaling.original_max_position_embeddings, scaling.factor) == (64, 4.0)
    assert scaling.short_factor == tuple(_FACTORS["short_factor"])
    assert scaling.long_factor == (2.0,) * 8 and scaling.attention_factor is None
    # A released config's form: `su` in rope_scaling, the original context at the top level
    # (it wins over the dict's, as in Phi3Config), remote-code pointers, attention_bias
    # false, a window spanning the context (Phi-3-mini-128k: none in effect).
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg |= {
        "rope_theta": 1e4, "rope_scaling": {"type": "su", **_FACTORS,
                                            "original_max_position_embeddings": 32},
        "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}, "attention_bias": False,
        "sliding_window": 262144,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = hf_arch_config(path, has_lm_head=True)
    assert config.rope_scaling == scaling and config.sliding_window is None
    plain = _tiny(transformers.Phi3Config)  # Phi-3-mini-4k: plain RoPE, no window
    config = hf_arch_config(_save(plain, tmp_path / "plain"), has_lm_head=True)
    assert config.rope_scaling is None and config.sliding_window is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # Phi-4-mini rotates 3/4 of each head.
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.75}},
            "rope_parameters.partial_rotary_factor=0.75",
        ),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                 "short_factor": [1.0] * 4, "long_factor": [2.0] * 8}},
            "longrope short_factor",
        ),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"layer_types": ["sliding_attention"] * 2}, "field 'layer_types'"),
    ],
)  # fmt: skip
def test_phi3_fields_the_model_lacks_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    _save(_tiny(transformers.Phi3Config), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=named):
        hf_arch_config(str(tmp_path), has_lm_head=True)


@pytest.mark.parametrize(
    "cls", [transformers.MixtralConfig, transformers.Qwen2MoeConfig, transformers.Qwen3MoeConfig]
)
def test_mixture_of_experts_is_refused_as_such(tmp_path: Path, cls: type) -> None:
    path = _save(_tiny(cls), tmp_path)
    with pytest.raises(
        ValueError,
        match="mixture-of-experts model.*supported: 'Gemma2ForCausalLM'.*'LlamaForCausalLM'",
    ):
        hf_arch_config(path, has_lm_head=True)


def _tiny_gguf_weights() -> dict[str, np.ndarray]:
    from tests.unit.model.test_loader import _tiny_hf_weights

    return _tiny_hf_weights(tied=True)


@pytest.mark.parametrize(
    ("key", "value"),
    [("expert_count", 8), ("attention.sliding_window_pattern", 2), ("rope.scaling.factor", 8.0)],
)
def test_gguf_metadata_the_model_lacks_is_refused_by_name(
    tmp_path: Path, key: str, value: Any
) -> None:
    path = tmp_path / "m.gguf"
    _write_tiny_gguf(path, _tiny_gguf_weights(), extra={f"llama.{key}": value})
    with pytest.raises(ValueError, match=f"GGUF metadata llama.{key} = "):
        load_model_config(str(path))


def test_tiny_gguf_without_extras_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_tiny_gguf(path, _tiny_gguf_weights())
    assert load_model_config(str(path)).num_hidden_layers == TINY["layers"]


@pytest.mark.parametrize(
    ("arch", "pattern", "sliding"),
    [
        ("gemma3", None, [True] * 5 + [False, True]),  # llama.cpp's fixed 5:1
        ("gemma2", None, [True, False] * 3 + [True]),
        ("gemma3", 3, [True, True, False] * 2 + [True]),
        ("gemma3", [True, False, False, True, True, True, False], None),
    ],
)
def test_gguf_gemma_layer_pattern(arch: str, pattern: Any, sliding: list[bool] | None) -> None:
    """The file's `attention.sliding_window_pattern` (a period or per-layer booleans)
    decides which layers slide; without it, llama.cpp's fixed pattern."""
    from pagedinfer.model.loader import _gguf_family_fields

    meta: dict[str, Any] = {f"{arch}.block_count": 7, f"{arch}.attention.sliding_window": 8}
    if pattern is not None:
        meta[f"{arch}.attention.sliding_window_pattern"] = pattern
    fields = _gguf_family_fields(meta, arch, "", 64, 4, 16)
    expected = sliding if sliding is not None else pattern
    assert [t == "sliding_attention" for t in fields["layer_types"]] == expected
    meta[f"{arch}.attention.sliding_window_pattern"] = [True, False]
    with pytest.raises(ValueError, match="has 2 entries for 7 layers"):
        _gguf_family_fields(meta, arch, "", 64, 4, 16)
