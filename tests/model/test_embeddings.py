"""Pooling (embedding) requests vs transformers' `output_hidden_states` on a tiny random
Llama (float32, 1e-5): last-token and mean pooling, normalized or not, whole prompts and
chunked prefills, cached prefixes; and pooling requests batched in the same steps as
generation requests, whose tokens stay what they are alone."""

from __future__ import annotations

import pytest
import torch

from pagedinfer import LLM, PoolingParams, SamplingParams
from pagedinfer.engine.input_processor import pooling_sampling_params

from .tiny import VOCAB

transformers = pytest.importorskip("transformers")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    lengths = [1, 5, 37, 64, 100, 129]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return prompts + [prompts[-1][:80] + prompts[2]]  # shares a cached 80-token prefix


def _hf_pooled(hf_model, ids: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # [len, hidden]: after the final norm
    vector = hidden[-1] if pooling.pooling_type == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}],
                         ids=["whole", "chunked"])  # fmt: skip
def test_pooled_hidden_states_match_transformers(tiny_dir, hf_model, engine_kwargs) -> None:
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=8 * 2**20, **engine_kwargs)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    for pooling in (PoolingParams(pooling_type="last"), PoolingParams(pooling_type="mean"),
                    PoolingParams(pooling_type="mean", normalize=False),
                    PoolingParams(pooling_type="last", normalize=False)):  # fmt: skip
        outs = llm.embed(prompts, pooling, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            expected = _hf_pooled(hf_model, prompt["prompt_token_ids"], pooling)
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert out.prompt_token_ids == prompt["prompt_token_ids"]


def test_pooling_requests_share_steps_with_generation(tiny_dir, hf_model) -> None:
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=8 * 2**20,
              max_num_batched_tokens=48)  # fmt: skip
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    engine = llm.llm_engine
    mean = PoolingParams(pooling_type="mean")
    for i, p in enumerate(prompts):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": p}, params)
        engine.add_request(f"emb-{i}", {"prompt_token_ids": p}, pooling_sampling_params(),
                           pooling_params=mean)  # fmt: skip
    done = {}
    mixed_steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds = {o.request_id.split("-")[0] for o in outs}
        mixed_steps += kinds == {"gen", "emb"}
        done.update({o.request_id: o for o in outs if o.finished})
    assert mixed_steps > 0, "no step finished both kinds"
    for i, p in enumerate(prompts):
        assert done[f"gen-{i}"].outputs[0].token_ids == alone[i]
        emb = done[f"emb-{i}"]
        assert emb.outputs[0].token_ids == [] and emb.outputs[0].finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(emb.pooled), _hf_pooled(hf_model, p, mean),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_sampling_options_are_refused_on_a_pooling_request(tiny_dir) -> None:
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=8 * 2**20)
    with pytest.raises(ValueError, match="a pooling request takes no sampling options"):
        llm.llm_engine.add_request("x", [5, 6, 7], SamplingParams(logprobs=2),
                                   pooling_params=PoolingParams())  # fmt: skip
