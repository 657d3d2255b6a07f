"""EAGLE and Medusa proposers on a tiny random target: the EAGLE head run through the paged
KV cache in chunks (the engine's catch-up and draft steps) equals its dense causal forward
over the whole sequence (the training path), and the proposers draft from the right rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedinfer.attention.cpu_sdpa import CpuSdpaBackend
from pagedinfer.config import SpeculativeConfig
from pagedinfer.model.llama import LlamaForCausalLM
from pagedinfer.model.loader import load_model_weights
from pagedinfer.spec_decode.head_proposers import EagleProposer, MedusaProposer
from pagedinfer.spec_decode.heads import EagleHead, HeadConfig, MedusaHeads, save_heads
from pagedinfer.spec_decode.proposer import DraftBatch, StepRun
from pagedinfer.worker.request_state import CachedRequestState
from tests.model.tiny import make_tiny_llama_dir

BLOCK = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[LlamaForCausalLM, CpuSdpaBackend]:
    path = make_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")))
    arch, state_dict = load_model_weights(path, torch.float32)
    backend = CpuSdpaBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )
    model = LlamaForCausalLM(arch, backend)
    model.load_weights(state_dict)
    return model, backend


def head_file(tmp_path, target: LlamaForCausalLM, method: str, aux_layers=()) -> str:
    arch = target.config
    config = HeadConfig(
        method=method, hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
        draft_vocab_size=200, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size, rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta, num_medusa_heads=3, medusa_intermediate_size=24,
        target="tiny", aux_layers=list(aux_layers),
    )  # fmt: skip
    torch.manual_seed(1)
    head = EagleHead(config) if method == "eagle" else MedusaHeads(config)
    for p in head.parameters():  # not the near-identity start: every part must matter
        torch.nn.init.normal_(p, std=0.2)
    path = str(tmp_path / f"{method}.safetensors")
    save_heads(path, head, config, torch.arange(56, 256), {})
    return path


def eagle(tmp_path, target, k: int = 3, aux_layers=()) -> EagleProposer:
    model, backend = target
    arch = model.config
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=k, model="x")
    path = head_file(tmp_path, model, "eagle", aux_layers)
    # quantize=False: exact comparisons with the dense head (Q8_0 only rounds the drafts).
    return EagleProposer(spec, model, path, backend, kv, BLOCK, quantize=False)


def test_paged_eagle_head_equals_its_dense_forward(tmp_path, target) -> None:
    proposer = eagle(tmp_path, target)
    torch.manual_seed(0)
    hidden = proposer.target.config.hidden_size
    features = torch.randn(23, hidden)
    next_tokens = torch.randint(0, 256, (23,))
    head = proposer.head
    dense = head(features, proposer.target.embed_tokens(next_tokens), torch.arange(23))
    table = np.arange(8, dtype=np.int32)[None]  # positions 0..31
    paged = []
    for start, n in [(0, 9), (9, 1), (10, 7), (17, 1), (18, 5)]:  # chunks, then decodes
        out = proposer._run(
            features[start : start + n], next_tokens[start : start + n],
            np.array([n]), np.array([start]), table,
        )  # fmt: skip
        paged.append(out)
    torch.testing.assert_close(torch.cat(paged), dense, rtol=1e-4, atol=1e-4)


def _state(req_id: str, tokens: list[int], block_ids: list[int]) -> CachedRequestState:
    from pagedinfer.sampling_params import SamplingParams

    return CachedRequestState(req_id, tokens[:4], tokens[4:], SamplingParams(), block_ids, 0, None)


@pytest.mark.parametrize("aux_layers", [(), (0,)], ids=["h_t", "fused"])
def test_eagle_drafts_follow_the_dense_head(tmp_path, target, aux_layers) -> None:
    """One step that ran a 10-token prompt for request a (it sampled its first token, the
    11th) and a 5-token chunk of request b (not sampling): the catch-up covers both, and a's
    drafts are the dense head's greedy rollout from the end of its sequence. Fused: the
    step's features are [layer 0's residual stream; h_t], projected by the head."""
    proposer = eagle(tmp_path, target, k=3, aux_layers=aux_layers)
    assert proposer.aux_layers == aux_layers
    model = proposer.target
    torch.manual_seed(2)
    a_tokens = torch.randint(0, 256, (11,)).tolist()  # 10 prompt tokens + the sampled one
    b_tokens = torch.randint(0, 256, (12,)).tolist()  # a 12-token prompt, 5 run this step
    width = (len(aux_layers) + 1) * model.config.hidden_size
    hidden = torch.randn(15, width)  # the step's 10 + 5 features
    a = _state("a", a_tokens, [0, 1, 2, 3])  # room for 16 positions
    b = _state("b", b_tokens, [4, 5, 6])
    batch = DraftBatch(["a"], [a], hidden=hidden,
                       runs=[StepRun(a, 0, 0, 10), StepRun(b, 10, 0, 5)])  # fmt: skip
    (drafts,) = proposer.propose(batch)

    # Dense reference: positions 0..9 of a, then roll the head forward greedily.
    head = proposer.head
    feats, nexts = head.project(hidden[:10]), torch.tensor(a_tokens[1:11])
    expected = []
    for _ in range(3):
        out = head(feats, model.embed_tokens(nexts), torch.arange(len(feats)))
        token = int(proposer.draft_vocab[(out[-1] @ proposer.lm_head.T).argmax()])
        expected.append(token)
        feats = torch.cat([feats, out[-1:]])
        nexts = torch.cat([nexts, torch.tensor([token])])
    assert drafts == expected


def test_eagle_drafts_stop_at_the_request_blocks(tmp_path, target) -> None:
    proposer = eagle(tmp_path, target, k=3)
    a = _state("a", list(range(10, 21)), [0, 1, 2])  # 12 positions; the new token is at 10
    hidden = torch.randn(10, proposer.target.config.hidden_size)
    (drafts,) = proposer.propose(DraftBatch(["a"], [a], hidden=hidden, runs=[StepRun(a, 0, 0, 10)]))
    # Draft i + 1 is computed at position 10 + i - 1: positions 10 and 11 fit, 12 does not.
    assert len(drafts) == 3
    a = _state("a", list(range(10, 22)), [0, 1, 2])  # the new token at 11
    hidden = torch.randn(11, proposer.target.config.hidden_size)
    (drafts,) = proposer.propose(DraftBatch(["a"], [a], hidden=hidden, runs=[StepRun(a, 0, 0, 11)]))
    assert len(drafts) == 2


def test_medusa_heads_read_the_feature_that_produced_the_new_token(tmp_path, target) -> None:
    model, _ = target
    spec = SpeculativeConfig(method="medusa", num_speculative_tokens=3, model="x")
    proposer = MedusaProposer(spec, model, head_file(tmp_path, model, "medusa"), quantize=False)
    hidden = torch.randn(7, model.config.hidden_size)
    a = _state("a", list(range(30, 38)), [0, 1])  # a verified run: 2 of 4 rows real
    (drafts,) = proposer.propose(DraftBatch(["a"], [a], hidden=hidden, runs=[StepRun(a, 3, 5, 2)]))
    # Row 3 + 2 - 1's feature and the request's last token (the one it produced).
    new_token = model.embed_tokens(torch.tensor([a.all_token_ids[-1]]))
    per_head = proposer.head(hidden[4:5], new_token)
    expected = proposer.draft_vocab[(per_head[:, 0] @ proposer.lm_head.T).argmax(-1)].tolist()
    assert drafts == expected and len(drafts) == 3
    # The proposer's matmul form of the heads equals the module's, Q8_0 blocks or not.
    tokens = torch.tensor([5, 77, 130])
    dense = proposer.head(hidden[:3], model.embed_tokens(tokens))
    torch.testing.assert_close(proposer.features(hidden[:3], tokens), dense)
    quantized = MedusaProposer(spec, model, head_file(tmp_path, model, "medusa"))
    torch.testing.assert_close(quantized.features(hidden[:3], tokens), dense, rtol=0.05, atol=0.05)
    spec = SpeculativeConfig(method="medusa", num_speculative_tokens=4, model="x")
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        MedusaProposer(spec, model, head_file(tmp_path, model, "medusa"))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_the_default_model_gets_its_shipped_heads(tmp_path, method: str) -> None:
    import os

    from pagedinfer.config import SHIPPED_HEADS_DIR, EngineConfig, ModelConfig
    from pagedinfer.gguf_metadata import DEFAULT_MODEL_FILE
    from pagedinfer.spec_decode.heads import load_heads

    spec = SpeculativeConfig(method=method, num_speculative_tokens=3)
    path = EngineConfig(speculative_config=spec).speculative_config.model
    assert path == os.path.join(SHIPPED_HEADS_DIR, f"smollm2-135m-instruct-{method}.safetensors")
    _, config, vocab, record = load_heads(path)
    assert config.target == DEFAULT_MODEL_FILE and len(vocab) == config.draft_vocab_size
    assert config.num_medusa_heads == (5 if method == "medusa" else 0)  # k up to 5
    assert record["args"]["method"] == method and record["args"]["all_turns"]
    # The same file under another directory is still the default model; another model
    # has no shipped heads and must name its own.
    elsewhere = EngineConfig(
        model_config=ModelConfig(model=str(tmp_path / DEFAULT_MODEL_FILE)), speculative_config=spec
    )
    assert elsewhere.speculative_config.model == path
    with pytest.raises(ValueError, match="heads ship only for the default model"):
        EngineConfig(
            model_config=ModelConfig(model=str(tmp_path / "other")), speculative_config=spec
        )


def test_aux_layers_are_the_residual_stream_after_each_layer(target) -> None:
    """forward_with_aux's hidden is forward's, and the final norm of layer i's aux part is
    what a forward through the first i + 1 layers returns."""
    from pagedinfer.attention.backend import ForwardContext, set_forward_context
    from pagedinfer.attention.metadata import make_attention_metadata

    model, backend = target
    arch = model.config
    ids = torch.randint(0, 256, (9,))
    h = arch.hidden_size

    def run(fn):
        kv = [torch.zeros(2, 4, BLOCK, arch.num_key_value_heads, arch.head_dim)
              for _ in range(arch.num_hidden_layers)]  # fmt: skip
        common, pos = make_attention_metadata(
            np.array([9]), np.array([0]), np.arange(4, dtype=np.int32)[None], BLOCK
        )
        with set_forward_context(ForwardContext(backend.build(common), kv)):
            return fn(ids, torch.from_numpy(pos))

    hidden, aux = run(lambda i, p: model.forward_with_aux(i, p, [0, 1]))
    assert aux.shape == (9, 2 * h)
    torch.testing.assert_close(hidden, run(model))
    for i in range(2):
        part = aux[:, i * h : (i + 1) * h]
        first = run(lambda x, p, n=i + 1: model(x, p, n))  # the first i + 1 layers
        torch.testing.assert_close(model.norm(part.clone()), first)
