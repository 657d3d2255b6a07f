"""`logprobs_mode` (what returned logprobs hold) and `bad_words` (banned token sequences),
on the sampler directly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedinfer.sample.sampler import Sampler, apply_bad_words
from tests.unit.sample.test_sampler import make_metadata


def test_bad_words_ban_a_token_alone_or_after_its_prefix() -> None:
    logits = torch.zeros(3, 10)
    outputs = [[1, 2], [1, 3], []]
    banned = {0: [[7], [2, 5], [1, 2, 6]], 1: [[2, 5], [1, 2, 6]], 2: [[2, 5]]}
    apply_bad_words(logits, outputs, banned)
    inf = float("-inf")
    # row 0: 7 always; 5 after ...2; 6 after ...1, 2. Row 1 ends with 3: nothing applies.
    assert [i for i in range(10) if logits[0, i] == inf] == [5, 6, 7]
    assert not (logits[1] == inf).any() and not (logits[2] == inf).any()


def test_sampler_never_picks_a_banned_word() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    metadata = dataclasses.replace(
        make_metadata(2, output_token_ids=[[3], [0]]), bad_words={0: [[3, 1]], 1: [[3, 1]]}
    )
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [2, 1]  # row 0 follows 3: 1 is banned there


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_modes_see_the_model_before_processing(mode) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 32)
    metadata = make_metadata(2, temperature=[0.7, 0.0], top_k=[3, 0], max_num_logprobs=4,
                             logit_bias=[{0: 50.0}, None])  # fmt: skip
    out = Sampler(logprobs_mode=mode)(logits, metadata)
    expected = logits.log_softmax(-1) if mode == "raw_logprobs" else logits
    lp = out.logprobs_tensors
    assert torch.allclose(lp.logprobs, expected.gather(-1, lp.logprob_token_ids), atol=1e-6)
    assert out.sampled_token_ids[0] == 0  # the bias decided the token, not the logprobs


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_modes_are_what_the_token_was_drawn_from(mode) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 32)
    metadata = make_metadata(3, temperature=[0.5, 0.0, 1.0], top_k=[4, 0, 0],
                             max_num_logprobs=6, logit_bias=[None, {5: 3.0}, None],
                             repetition=[1.0, 1.0, 1.0], presence=[0.0, 0.0, 1.5],
                             frequency=[0.0, 0.0, 0.0], output_token_ids=[[], [], [9]])  # fmt: skip
    out = Sampler(logprobs_mode=mode)(logits, metadata)
    drawn = logits.clone()
    drawn[1, 5] += 3.0  # logit bias (greedy row: no temperature)
    drawn[2, 9] -= 1.5  # presence penalty
    drawn[0] /= 0.5
    drawn[0][drawn[0] < drawn[0].topk(4).values[-1]] = float("-inf")  # top-k 4
    expected = drawn if mode == "processed_logits" else drawn.log_softmax(-1)
    lp = out.logprobs_tensors
    assert torch.allclose(lp.logprobs, expected.gather(-1, lp.logprob_token_ids), atol=1e-5)
    if mode == "processed_logprobs":  # row 0's distribution is its 4 survivors
        assert torch.isclose(lp.logprobs[0, 1:5].exp().sum(), torch.tensor(1.0), atol=1e-5)
        assert lp.logprobs[0, 5] == float("-inf")


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs_mode 'logits'"):
        Sampler(logprobs_mode="logits")  # type: ignore[arg-type]
