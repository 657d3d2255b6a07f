"""`disable_by_batch_size`: the per-method default ("auto") and what it does in an engine
(a tiny random model: ngram drafts whenever the suffix occurred before)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedinfer.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from tests.model.tiny import make_tiny_llama_dir


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "medusa"])
def test_auto_takes_the_methods_measured_limit(method: str) -> None:
    extra = {"draft_layers": 1} if method == "draft_model" else {}
    config = SpeculativeConfig(method=method, num_speculative_tokens=3, **extra)
    assert config.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE[method] >= 1
    always = SpeculativeConfig(
        method=method, num_speculative_tokens=3, disable_by_batch_size=None, **extra
    )
    assert always.disable_by_batch_size is None
    assert SpeculativeConfig(
        method=method, num_speculative_tokens=3, disable_by_batch_size=7, **extra
    ).disable_by_batch_size == 7  # fmt: skip
    for bad in (0, -1, "sometimes"):
        with pytest.raises(ValidationError):
            SpeculativeConfig(
                method=method, num_speculative_tokens=3, disable_by_batch_size=bad, **extra
            )


def test_steps_with_more_requests_than_the_limit_draft_nothing(tmp_path) -> None:
    from pagedinfer import LLM, SamplingParams

    llm = LLM(
        model=make_tiny_llama_dir(str(tmp_path / "tiny")), dtype="float32", max_model_len=256,
        kv_cache_memory_bytes=16 * 2**20, log_stats_interval_s=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                            "disable_by_batch_size": 1},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    try:
        llm.generate(prompt, params, use_tqdm=False)
        alone = llm.get_stats()["spec_num_drafts"]
        assert alone > 0  # one request: it speculates
        # Two requests that start and end together: every step has 2 > 1, none drafts.
        llm.generate([prompt, {"prompt_token_ids": [9, 8, 9, 8, 9, 8, 9, 8]}], params,
                     use_tqdm=False)  # fmt: skip
        assert llm.get_stats()["spec_num_drafts"] == alone
    finally:
        llm.llm_engine.engine_core.shutdown()
