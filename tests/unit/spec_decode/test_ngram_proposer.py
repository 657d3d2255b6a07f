"""Unit tests for `pagedinfer.spec_decode.ngram_proposer`: hand-built cases for each clause of
the prompt-lookup rule, a randomized comparison against a brute-force reference, and
constructor validation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedinfer.spec_decode.ngram_proposer import NgramProposer


def make_proposer(k: int = 3, lo: int = 2, hi: int = 4, max_model_len: int = 1000) -> NgramProposer:
    return NgramProposer(
        num_speculative_tokens=k,
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        max_model_len=max_model_len,
    )


def reference_propose(
    token_ids: list[int], k: int, lo: int, hi: int, max_model_len: int
) -> list[int]:
    """Brute force straight from the rule: longest n first, then earliest start i."""
    num_tokens = len(token_ids)
    num_draft = min(k, max_model_len - num_tokens)
    if num_draft <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if n > num_tokens:
            continue
        suffix = token_ids[num_tokens - n :]
        for i in range(num_tokens):
            if i + n > num_tokens - 1:
                break
            if token_ids[i : i + n] == suffix:
                return token_ids[i + n : i + n + num_draft]
    return []


def test_basic_match_and_continuation() -> None:
    proposer = make_proposer(k=3, lo=2, hi=4)
    # Suffix [1, 2] occurs at i=0, followed by 3, 4, 5.
    assert proposer.propose_one([1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5]


def test_longest_match_preferred_over_shorter_more_recent_one() -> None:
    proposer = make_proposer(k=2, lo=2, hi=4)
    # [7, 1, 2] occurs early (-> 30, 31); [1, 2] alone occurs later (-> 40, 41).
    tokens = [7, 1, 2, 30, 31, 8, 1, 2, 40, 41, 7, 1, 2]
    assert proposer.propose_one(tokens) == [30, 31]


def test_earliest_occurrence_among_equal_length_matches() -> None:
    proposer = make_proposer(k=2, lo=2, hi=4)
    # [1, 2] occurs at i=0 (-> 10, 11) and i=4 (-> 20, 21); no longer suffix matches.
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 9, 1, 2]
    assert proposer.propose_one(tokens) == [10, 11]


def test_continuation_truncated_by_end_of_sequence() -> None:
    proposer = make_proposer(k=5, lo=2, hi=2)
    # [3, 4] at i=0 is followed by only 3 tokens, running into the suffix itself.
    assert proposer.propose_one([3, 4, 3, 4]) == [3, 4]
    assert proposer.propose_one([3, 4, 9, 3, 4]) == [9, 3, 4]


def test_max_model_len_caps_draft_length() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]  # 8 tokens; full continuation is [3, 4, 5, 6, 1, 2]
    assert make_proposer(k=4, max_model_len=100).propose_one(tokens) == [3, 4, 5, 6]
    assert make_proposer(k=4, max_model_len=10).propose_one(tokens) == [3, 4]
    assert make_proposer(k=4, max_model_len=9).propose_one(tokens) == [3]
    assert make_proposer(k=4, max_model_len=8).propose_one(tokens) == []
    assert make_proposer(k=4, max_model_len=5).propose_one(tokens) == []


def test_sequence_shorter_than_min_returns_empty() -> None:
    proposer = make_proposer(lo=3, hi=4)
    assert proposer.propose_one([]) == []
    assert proposer.propose_one([5]) == []
    assert proposer.propose_one([5, 5]) == []
    # Length == min: the only occurrence is the suffix itself.
    assert proposer.propose_one([5, 5, 5]) == []
    assert proposer.propose_one([5, 5, 5, 5]) == [5]


def test_no_match_returns_empty() -> None:
    proposer = make_proposer(lo=2, hi=4)
    assert proposer.propose_one([1, 2, 3, 4, 5, 6]) == []
    # The last token repeats, but no 2-token suffix does.
    assert proposer.propose_one([1, 6, 2, 3, 4, 6]) == []


def test_suffix_itself_is_not_a_match() -> None:
    proposer = make_proposer(k=3, lo=1, hi=3)
    assert proposer.propose_one([1, 2, 3]) == []
    # The suffix [2, 3] at i=2 is skipped; the match at i=0 proposes [2, 3] (into the suffix).
    assert proposer.propose_one([2, 3, 2, 3]) == [2, 3]
    # With n=1 the last token must occur before the final position: [4, 4] -> i=0 -> [4].
    assert proposer.propose_one([7, 4]) == []
    assert proposer.propose_one([4, 4]) == [4]


def test_repeated_token_sequence() -> None:
    proposer = make_proposer(k=3, lo=2, hi=3)
    # n=3: the suffix [5,5,5] occurs at i=0 and i=1 (i + 3 <= 4); earliest i=0 -> t[3:6].
    assert proposer.propose_one([5, 5, 5, 5, 5]) == [5, 5]
    # n=3 with i=0 only for length 4 -> t[3:6] = [5].
    assert proposer.propose_one([5, 5, 5, 5]) == [5]
    # Length 3: n=3 impossible, n=2 at i=0 -> t[2:5] = [5].
    assert proposer.propose_one([5, 5, 5]) == [5]
    # A longer run is proposed from its very start, capped at k.
    assert proposer.propose_one([5] * 20) == [5, 5, 5]


def test_earliest_start_when_prefix_cannot_extend() -> None:
    # Candidate matches of the final length that sit too close to the start to extend further
    # must still count: [9, 9] matches at i=0; a longer suffix [1, 9, 9] never occurs.
    proposer = make_proposer(k=2, lo=2, hi=3)
    assert proposer.propose_one([9, 9, 4, 7, 1, 9, 9]) == [4, 7]


def test_numpy_input_and_batch() -> None:
    proposer = make_proposer(k=3, lo=2, hi=4)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2]
    for dtype in (np.int32, np.int64):
        out = proposer.propose_one(np.array(tokens, dtype=dtype))
        assert out == [3, 4, 5]
        assert all(type(t) is int for t in out)
    assert proposer.propose([tokens, [1, 2, 3], np.array(tokens, dtype=np.int32)]) == [
        [3, 4, 5],
        [],
        [3, 4, 5],
    ]
    assert proposer.propose([]) == []


def test_matches_brute_force_reference() -> None:
    rng = random.Random(1234)
    num_nonempty = 0
    for trial in range(4000):
        alphabet = rng.randint(1, 4)
        num_tokens = rng.randint(0, 40)
        tokens = [rng.randrange(alphabet) for _ in range(num_tokens)]
        lo = rng.randint(1, 5)
        hi = rng.randint(lo, 7)
        k = rng.randint(1, 6)
        max_model_len = num_tokens + rng.randint(-3, 8)
        if max_model_len < 1:
            max_model_len = 1
        proposer = NgramProposer(k, lo, hi, max_model_len)
        expected = reference_propose(tokens, k, lo, hi, max_model_len)
        num_nonempty += bool(expected)
        context = tokens if trial % 2 == 0 else np.array(tokens, dtype=np.int32)
        assert proposer.propose_one(context) == expected, (tokens, k, lo, hi, max_model_len)
    # Make sure the random cases actually exercise the matching path.
    assert num_nonempty > 1000


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 1, 2, 10), "num_speculative_tokens"),
        ((3, 0, 2, 10), "prompt_lookup_min"),
        ((3, 1, 0, 10), "prompt_lookup_max"),
        ((3, 1, 2, 0), "max_model_len"),
        ((3, -1, 2, 10), "prompt_lookup_min"),
        ((3, 3, 2, 10), "prompt_lookup_min"),
    ],
)
def test_constructor_validation(args: tuple[int, int, int, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)


def test_constructor_accepts_min_equal_max() -> None:
    proposer = NgramProposer(1, 3, 3, 1)
    assert proposer.prompt_lookup_min == proposer.prompt_lookup_max == 3
