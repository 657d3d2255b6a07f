"""Speculative decoding on the real default model (float32).

Greedy: with every method and k in {1, 3, 5}, the token ids equal Hugging Face's greedy
continuation (which non-speculative decoding equals, test_hf_parity.py) for the parity
prompts, each alone and all batched. Random: seeded runs repeat exactly. Guided requests
validate drafts against their grammar. The acceptance counts reach `LLM.get_stats()`.
"""

from __future__ import annotations

import json

import pytest

from tests.data import heldout_prompts
from tests.integration.conftest import MAX_NEW_TOKENS

pytestmark = pytest.mark.integration

METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    # Self-speculative: the target's first 8 layers (its KV cache shared).
    "draft_layers": {"method": "draft_model", "draft_layers": 8},
    # A separate, smaller model with the same tokenizer and its own KV cache: the default
    # model cut to its first 4 layers (written by the `draft_dirs` fixture).
    "draft_model": {"method": "draft_model", "model": "small"},
    # The trained heads shipped for the default model (pagedinfer/spec_decode/trained/).
    "eagle": {"method": "eagle"},
    "medusa": {"method": "medusa"},
}


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, default_gguf_path) -> dict[str, str]:
    """The default model exported as HF directories: cut to 4 layers, and whole."""
    import torch

    from pagedinfer.model.loader import export_hf_dir

    root = tmp_path_factory.mktemp("drafts")
    return {
        "small": export_hf_dir(default_gguf_path, root / "small", torch.float32, num_layers=4),
        "whole": export_hf_dir(default_gguf_path, root / "whole", torch.float32),
    }


def _llm(spec: dict | None, **kwargs):
    from pagedinfer import LLM

    if spec is not None:  # speculate at every batch size: the batched runs must verify too
        spec = {"disable_by_batch_size": None, **spec}
    options = {"dtype": "float32", "kv_cache_memory_bytes": 256 * 2**20,
               "max_model_len": 2048, "log_stats_interval_s": 0, **kwargs}  # fmt: skip
    return LLM(speculative_config=spec, **options)


def _greedy():
    from pagedinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module", params=[(m, k) for m in METHODS for k in (1, 3, 5)],
                ids=lambda p: f"{p[0]}-k{p[1]}")  # fmt: skip
def spec_llm(request, draft_dirs):
    method, k = request.param
    spec = {**METHODS[method], "num_speculative_tokens": k}
    if "model" in spec:
        spec["model"] = draft_dirs[spec["model"]]
    llm = _llm(spec)
    yield llm
    llm.llm_engine.engine_core.shutdown()


ALONE = (0, 3, 8, 11)
"""The prompts also run one at a time: two short ones and two of the long ones (all twelve
run batched)."""


def test_greedy_equals_plain_decoding_alone_and_batched(spec_llm, prompts, hf_outputs) -> None:
    for i in ALONE:
        out = spec_llm.generate({"prompt_token_ids": prompts[i]}, _greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_outputs[i], f"prompt {i} diverged alone"
    outs = spec_llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts], _greedy(), use_tqdm=False
    )
    for i, (out, expected) in enumerate(zip(outs, hf_outputs)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} diverged batched"
    stats = spec_llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["spec_mean_acceptance_length"] == pytest.approx(
        1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"]
    )


@pytest.mark.parametrize("draft", ["draft_layers", "separate"])
def test_a_draft_as_deep_as_the_target_is_always_accepted(draft, draft_dirs, prompts) -> None:
    """The draft machinery itself (draft KV, positions, slots, catch-up of a separate
    draft's cache over prompts and accepted tokens) is exact when the draft is the target:
    then every draft is the target's own greedy choice and is accepted."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    if draft == "draft_layers":
        spec["draft_layers"] = 30  # all of SmolLM2-135M's layers
    else:
        spec["model"] = draft_dirs["whole"]
    from pagedinfer import SamplingParams

    llm = _llm(spec)
    batch = [{"prompt_token_ids": ids} for ids in prompts[5:10]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] > 150
    assert stats["spec_acceptance_rate"] > 0.97, stats
    llm.llm_engine.engine_core.shutdown()


# Measured mean acceptance lengths of the shipped heads on this test's prompts (k=3, bf16,
# CPU, 24 prompts, about 1,500 drafts): EAGLE 1.46, Medusa 1.36. Without a head the figure
# is 1.0. It is lower than on held-out ShareGPT rows (1.63 and 1.52, docs/benchmarks.md):
# these prompts are one-line requests, 8-50 tokens, whose answers the 135M target phrases
# with less repetition of its context. The floors sit about 5% under the measurements, room
# for bf16 kernels that round differently on other CPUs; they catch regressions.
ACCEPTANCE_FLOOR = {"eagle": 1.38, "medusa": 1.28}


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_trained_heads_keep_their_acceptance_length(method) -> None:
    """The shipped EAGLE and Medusa heads on 24 held-out chat prompts of tests/data (written
    for the project, so never trained on), 96 tokens, temperature 0, k=3: the mean
    acceptance length (1 + accepted / drafts) stays at its measured level."""
    from pagedinfer import SamplingParams
    from pagedinfer.training.distill import chat_prompts

    llm = _llm({"method": method, "num_speculative_tokens": 3}, dtype="bfloat16")
    texts = heldout_prompts(24)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(llm.get_tokenizer(), texts)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 300
    assert stats["spec_mean_acceptance_length"] >= ACCEPTANCE_FLOOR[method], stats
    llm.llm_engine.engine_core.shutdown()


def test_seeded_sampling_repeats(prompts) -> None:
    from pagedinfer import SamplingParams

    llm = _llm({**METHODS["ngram"], "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=11)
    batch = [{"prompt_token_ids": ids} for ids in prompts[:6]]
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert first == again
    alone = llm.generate(batch[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == first[2]  # a seeded request does not depend on its batch
    llm.llm_engine.engine_core.shutdown()


def test_logprobs_come_per_verified_token(prompts) -> None:
    from pagedinfer import SamplingParams

    plain, spec = _llm(None), _llm({**METHODS["ngram"], "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    ids = {"prompt_token_ids": prompts[8]}  # the long code review: n-gram drafts hit
    a = plain.generate(ids, params, use_tqdm=False)[0].outputs[0]
    b = spec.generate(ids, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == 32
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        for token in x:
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
    assert spec.get_stats()["spec_num_accepted_tokens"] > 0
    for llm in (plain, spec):
        llm.llm_engine.engine_core.shutdown()


def test_guided_requests_verify_drafts_against_their_grammar() -> None:
    """The n-gram drafts copy the prompt's JSON, so they are often valid; whatever the
    drafts, the output follows the schema (drafts the grammar refuses are trimmed and the
    verification rows are masked)."""
    from pagedinfer import SamplingParams, StructuredOutputsParams

    llm = _llm({**METHODS["ngram"], "num_speculative_tokens": 3})
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99}}}  # fmt: skip
    tokenizer = llm.get_tokenizer()
    text = 'Copy this JSON: {"name":"Ada","age":36} and {"name":"Alan","age":41}.'
    ids = tokenizer.encode(text)
    params = [
        SamplingParams(
            temperature=t, seed=5, max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for t in (0.0, 1.0)
    ]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, params, use_tqdm=False)
    for out in outs:
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99
    assert llm.get_stats()["spec_num_drafts"] > 0  # drafts were verified under the grammar
    llm.llm_engine.engine_core.shutdown()


def test_the_server_speculates_and_exports_the_counts() -> None:
    """`serve --speculative-config`: completions equal the plain engine's, and /metrics
    carries vLLM's spec_decode counters."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pagedinfer import SamplingParams
    from tests.integration.server_proc import ServerProcess, small_engine_flags

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    server = ServerProcess(*small_engine_flags(), "--speculative-config", spec)
    try:
        prompt = "a b c d e a b c d e a b c d e a b"
        body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
        request = urllib.request.Request(
            server.base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
            families = list(text_string_to_metric_families(r.read().decode()))
    finally:
        server.stop()
    values = {s.name: s.value for f in families for s in f.samples if not s.labels.get("position")}
    per_pos = {
        s.labels["position"]: s.value
        for f in families
        for s in f.samples
        if s.name == "pagedinfer:spec_decode_num_accepted_tokens_per_pos_total"
    }
    drafts = values["pagedinfer:spec_decode_num_drafts_total"]
    accepted = values["pagedinfer:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= values["pagedinfer:spec_decode_num_draft_tokens_total"]
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos.get("1", 0)
    plain = _llm(None, max_model_len=512)
    expected = plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert text == expected[0].outputs[0].text
    plain.llm_engine.engine_core.shutdown()
