"""Draft-head training (`pagedinfer/training/`) on the tiny random model: features, losses,
the draft vocabulary, the held-out split, the dataset path and the saved file. No real model
runs here."""

from __future__ import annotations

import json

import pytest
import torch

from pagedinfer.entrypoints.cli import build_parser
from pagedinfer.spec_decode import heads
from pagedinfer.spec_decode.heads import load_heads
from pagedinfer.training import draft_heads
from pagedinfer.training.distill import (
    HOLDOUT_START,
    DistillData,
    build_draft_vocab,
    compute_features,
    generate_sequences,
    load_training_prompts,
    split_sequences,
    training_prompt_indices,
)
from pagedinfer.training.draft_heads import train_draft, train_heads
from pagedinfer.training.objectives import TrainSettings, step_attention
from tests.model.tiny import make_tiny_llama_dir

ENGINE = {
    "kv_cache_memory_bytes": 8 * 2**20,
    "max_model_len": 256,
    "attention_backend": "torch_ref",
}
EOS = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny tensors gain nothing from threads; on a busy 2-core machine OpenMP's hand-offs
    # made the EAGLE test take 27 s instead of 0.3 s.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="module")
def llm(tiny_dir: str):
    from pagedinfer import LLM

    return LLM(model=tiny_dir, dtype="float32", **ENGINE)


@pytest.fixture(scope="module")
def pattern_data(llm) -> DistillData:
    """Sequences repeating a short pattern (period 3, 8 patterns): x_{t+2} follows from the
    current tokens. The first 4 tokens count as the prompt."""
    g = torch.Generator().manual_seed(0)
    patterns = [torch.randint(3, 256, (3,), generator=g).tolist() for _ in range(8)]
    seqs = [((patterns[i % 8] * 20)[: 40 + i], 4) for i in range(24)]
    return compute_features(llm, seqs, aux_layers=[0])


def _head_config(llm, method: str, draft_vocab_size: int = 64, aux_layers=()):
    arch = llm.llm_engine.engine_core.executor.worker.arch
    return draft_heads._head_config(method, arch, draft_vocab_size, 2, "tiny", aux_layers)


def _frozen(llm) -> tuple[torch.Tensor, torch.Tensor]:
    model = llm.llm_engine.engine_core.executor.worker.model
    return model.embed_tokens.weight.detach(), model.lm_head_weight.detach()


def test_features_reproduce_the_engines_greedy_tokens(llm) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 33)]
    seqs = generate_sequences(llm, prompts, max_tokens=12)
    data = compute_features(llm, seqs)
    model = llm.llm_engine.engine_core.executor.worker.model
    assert data.features.dtype == torch.float32 and data.num_seqs == 3
    for i, (ids, num_prompt) in enumerate(seqs):
        a, b, gen = data.rows(i)
        assert gen - a == num_prompt and data.token_ids[a:b].tolist() == ids
        assert b - gen >= 1
        # Features at t predict x_{t+1}: the greedy continuation, token for token.
        pred = model.compute_logits(data.features[gen - 1 : b - 1]).argmax(-1)
        assert pred.tolist() == ids[num_prompt:]


@pytest.mark.parametrize("method", ["eagle", "eagle-fused", "medusa"])
def test_training_learns_a_repeating_pattern(method: str, llm, pattern_data) -> None:
    data = pattern_data
    train_seqs, val_seqs = split_sequences(data.num_seqs, 0.2, seed=0)
    vocab = build_draft_vocab(data, train_seqs, 64, [EOS], 256)
    settings = TrainSettings(epochs=10, lr=1e-2, batch_tokens=256, noise=0.0, ce_weight=1.0)
    method, _, fused = method.partition("-")
    config = _head_config(llm, method, aux_layers=[0] if fused else [])
    head, metrics = train_heads(
        method, config, data, _frozen(llm), vocab, train_seqs, val_seqs, settings,
        log=lambda _: None,
    )  # fmt: skip
    if method == "eagle":
        assert (head.fuse is not None) == bool(fused)
    history = metrics["history"]
    assert len(history) == 10
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    first, last = history[0]["val_acc"], history[-1]["val_acc"]
    assert len(last) == (3 if method == "eagle" else 2)  # eagle: draft steps; medusa: heads
    assert min(last) > 0.9 and last[0] >= first[0]


def test_save_load_round_trip(tmp_path, llm, pattern_data) -> None:
    from pagedinfer.spec_decode.heads import save_heads

    data = pattern_data
    vocab = build_draft_vocab(data, range(data.num_seqs), 32, [EOS], 256)
    settings = TrainSettings(epochs=1, lr=1e-3, batch_tokens=512)
    h = data.features[:10]
    e = torch.randn(10, 64)
    pos = torch.arange(10)
    for method in ("eagle", "medusa"):
        config = _head_config(llm, method, draft_vocab_size=32)
        head, _ = train_heads(
            method, config, data, _frozen(llm), vocab, range(20), range(20, 24), settings,
            log=lambda _: None,
        )  # fmt: skip
        path = str(tmp_path / f"{method}.safetensors")
        save_heads(path, head, config, vocab, {"note": method})
        loaded, config2, vocab2, extra = load_heads(path)
        assert config2 == config and torch.equal(vocab2, vocab) and extra == {"note": method}
        if method == "eagle":
            assert torch.equal(loaded(h, e, pos), head(h, e, pos))
        else:
            assert torch.equal(loaded(h, e), head(h, e))


def test_draft_vocab_has_eos_and_the_most_frequent_generated_tokens() -> None:
    # Sequence 0: prompt [9, 9, 9], generated [5, 5, 5, 7, 7, 3]; sequence 1 is not counted.
    tokens = torch.tensor([9, 9, 9, 5, 5, 5, 7, 7, 3] + [6, 6, 6, 6, 6])
    data = DistillData(tokens, torch.zeros(14, 4), [0, 9, 14], [3, 1])
    vocab = build_draft_vocab(data, [0], 4, [EOS], 16)
    assert vocab.tolist() == [EOS, 3, 5, 7]
    # Fewer generated tokens than slots: prompt tokens next, then the lowest ids.
    assert build_draft_vocab(data, [0], 6, [EOS], 16).tolist() == [0, 2, 3, 5, 7, 9]
    with pytest.raises(ValueError):
        build_draft_vocab(data, [0], 17, [EOS], 16)


def test_held_out_rows_are_never_used(tmp_path) -> None:
    assert HOLDOUT_START == 800
    assert training_prompt_indices(800) == list(range(800))
    for bad in (0, 801, 1000):
        with pytest.raises(ValueError):
            training_prompt_indices(bad)
    rows = [{"conversations": [{"from": "human", "value": f"row {i}"}]} for i in range(1000)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    texts = load_training_prompts(800, str(path))
    assert texts == [f"row {i}" for i in range(800)]
    assert load_training_prompts(3, str(path)) == ["row 0", "row 1", "row 2"]
    # Every user turn (not the assistant's) of the training rows only.
    rows = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"},
                           {"from": "human", "value": f"r{i}"}]}
        for i in range(1000)
    ]  # fmt: skip
    path.write_text(json.dumps(rows))
    texts = load_training_prompts(800, str(path), all_turns=True)
    assert texts[:4] == ["q0", "r0", "q1", "r1"] and len(texts) == 1600
    assert "q800" not in texts and "r799" in texts


def test_train_draft_end_to_end_and_cli(tmp_path, tiny_dir: str) -> None:
    out = str(tmp_path / "medusa.safetensors")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(6)]
    cache = str(tmp_path / "data.safetensors")
    common = {"model": tiny_dir, "draft_vocab_size": 48, "epochs": 1, "prompts": prompts,
              "data_cache": cache, "llm_kwargs": ENGINE, "log": lambda _: None}  # fmt: skip
    record = train_draft("medusa", out=out, max_tokens=10, num_medusa_heads=2, **common)
    # The second method reuses the first's sequences and features; other settings refuse them.
    eagle = train_draft("eagle", out=str(tmp_path / "eagle.st"), max_tokens=10, **common)
    assert "generate_s" not in eagle["times_s"] and "generate_s" in record["times_s"]
    assert eagle["num_positions"] == record["num_positions"]
    with pytest.raises(ValueError, match="holds data for"):
        train_draft("eagle", out=str(tmp_path / "e2.st"), max_tokens=11, **common)
    head, config, vocab, extra = load_heads(out)
    assert config.target == "tiny-llama" and config.num_medusa_heads == 2
    assert len(vocab) == config.draft_vocab_size == 48 and EOS in vocab.tolist()
    assert extra["num_sequences"] == 6 and extra["args"]["epochs"] == 1
    assert extra == json.loads(json.dumps(record))
    # A fused EAGLE head: the cache's sequences stay, the features are run again with the
    # aux layer and saved, and a later run reads them.
    assert load_heads(str(tmp_path / "eagle.st"))[1].aux_layers == []  # default: h_t alone
    fused = train_draft("eagle", out=str(tmp_path / "f.st"), max_tokens=10,
                        aux_layers=[0], **common)  # fmt: skip
    assert "generate_s" not in fused["times_s"] and "features_s" in fused["times_s"]
    again = train_draft("eagle", out=str(tmp_path / "f2.st"), max_tokens=10,
                        aux_layers=[0], **common)  # fmt: skip
    assert "features_s" not in again["times_s"]
    assert load_heads(str(tmp_path / "f2.st"))[1].aux_layers == [0]
    with pytest.raises(ValueError, match="aux_layers"):
        train_draft("eagle", out=str(tmp_path / "f3.st"), max_tokens=10,
                    aux_layers=[1], **common)  # fmt: skip
    ns = build_parser().parse_args(["train-draft", "--method", "eagle", "--out", "x.st"])
    assert (ns.method, ns.out, ns.num_prompts, ns.epochs) == ("eagle", "x.st", 800, None)
    assert ns.dataset_path is None


def test_a_missing_dataset_fails_before_the_engine_loads(tmp_path, monkeypatch, capsys) -> None:
    """No dataset and no default file: the library names `dataset_path`, the command names
    --dataset-path (exit status 2); neither loads a model first."""
    from pagedinfer.entrypoints.cli import main

    monkeypatch.setenv("PAGEDINFER_DATA_DIR", str(tmp_path / "no-data"))
    with pytest.raises(ValueError, match="pass `dataset_path`"):
        train_draft("eagle", out=str(tmp_path / "x.st"), model="no-such-model")
    assert main(["train-draft", "--method", "eagle", "--out", str(tmp_path / "x.st")]) == 2
    assert "pass --dataset-path" in capsys.readouterr().err


def test_unrolled_steps_attend_as_a_causal_pass() -> None:
    # Fed the true next inputs instead of their own predictions, EAGLE's training-time draft
    # steps 2 and 3 (row t at position t + s - 1, attending to step 1's prefix of its own
    # sequence and to its own chain) must reproduce step 1's rows t + 1 and t + 2; two
    # sequences side by side, one unrolled from its third row.
    from pagedinfer.model.arch_config import ModelArchConfig

    arch = ModelArchConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    torch.manual_seed(0)
    head = heads.EagleHead(draft_heads._head_config("eagle", arch, 32, 0, "x"))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)  # o/down start at zero: make attention matter
    segments = [(0, 7, 2), (7, 5, 0)]  # (first row, rows, first unrolled row)
    h, e = torch.randn(12, 64), torch.randn(12, 64)
    pos = torch.cat([torch.arange(7), torch.arange(5)])
    sel = torch.cat([torch.arange(2, 7), torch.arange(7, 12)])
    local = pos[sel]
    seg_end = torch.where(sel < 7, 7, 12)
    kv1: list[torch.Tensor] = []
    kv2: list[torch.Tensor] = []
    with torch.no_grad():
        f1 = head(h, e, pos, step_attention(segments, store=kv1))
        nxt1 = torch.minimum(sel + 1, seg_end - 1)
        attend2 = step_attention(segments, kv2, prefix=(kv1[0], kv1[1]))
        f2 = head(h[nxt1], e[nxt1], local + 1, attend2)
        nxt2 = torch.minimum(sel + 2, seg_end - 1)
        attend3 = step_attention(segments, prefix=(kv1[0], kv1[1]), chain=[tuple(kv2)])
        f3 = head(h[nxt2], e[nxt2], local + 2, attend3)
    ok2, ok3 = sel + 1 < seg_end, sel + 2 < seg_end
    assert int(ok3.sum()) == 6
    torch.testing.assert_close(f2[ok2], f1[sel[ok2] + 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f3[ok3], f1[sel[ok3] + 2], rtol=1e-5, atol=1e-5)
    # A wrong chain (step 2's keys left out) changes step 3.
    attend_wrong = step_attention(segments, prefix=(kv1[0], kv1[1]))
    with torch.no_grad():
        wrong = head(h[nxt2], e[nxt2], local + 2, attend_wrong)
    assert not torch.allclose(wrong[ok3], f1[sel[ok3] + 2], atol=1e-3)
