"""Unit tests for `pagedinfer.sample.sampler`: each stage against hand-computed tensors, plus
seeded reproducibility across batch compositions and a distribution check."""

from __future__ import annotations

import math

import pytest
import torch

from pagedinfer.sample.metadata import SamplingMetadata
from pagedinfer.sample.sampler import (
    Sampler,
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
    compute_prompt_logprobs,
    gather_logprobs,
    random_sample,
)

NEG_INF = float("-inf")


def make_metadata(
    num_reqs: int,
    *,
    temperature: list[float] | None = None,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
    output_token_ids: list[list[int]] | None = None,
    prompt_token_ids: torch.Tensor | None = None,
    presence: list[float] | None = None,
    frequency: list[float] | None = None,
    repetition: list[float] | None = None,
    logit_bias: list[dict[int, float] | None] | None = None,
    min_tokens: dict[int, tuple[int, set[int]]] | None = None,
    allowed_mask: torch.Tensor | None = None,
) -> SamplingMetadata:
    """Build metadata the way the runner does: unused fields None, flags derived."""
    if temperature is None:
        all_greedy, all_random, temp = True, False, None
    else:
        all_greedy = all(t < 1e-5 for t in temperature)
        all_random = all(t >= 1e-5 for t in temperature)
        temp = None if all_greedy else torch.tensor(temperature, dtype=torch.float32)
    no_penalties = presence is None and frequency is None and repetition is None
    return SamplingMetadata(
        temperature=temp,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        no_penalties=no_penalties,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids or [[] for _ in range(num_reqs)],
        frequency_penalties=None if frequency is None else torch.tensor(frequency),
        presence_penalties=None if presence is None else torch.tensor(presence),
        repetition_penalties=None if repetition is None else torch.tensor(repetition),
        logit_bias=logit_bias or [None] * num_reqs,
        min_tokens=min_tokens or {},
        allowed_token_ids_mask=allowed_mask,
    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = torch.randn(7, 50)
    before = logits.clone()
    out = Sampler()(logits, make_metadata(7))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs_tensors is None
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = torch.randn(6, 40)
    temps = [0.0, 1.0, 0.0, 0.7, 1e-6, 2.0]
    for _ in range(20):
        out = Sampler()(logits, make_metadata(6, temperature=temps)).sampled_token_ids
        for row in (0, 2, 4):
            assert out[row] == logits[row].argmax()


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(16, 100)
    meta = make_metadata(16, temperature=[1.5] * 16, top_k=[1] * 16)
    for _ in range(5):
        assert torch.equal(Sampler()(logits, meta).sampled_token_ids, logits.argmax(-1))
    # Also through the sort path (top-p set on some rows).
    meta = make_metadata(16, temperature=[1.5] * 16, top_k=[1] * 16, top_p=[0.9] * 16)
    assert torch.equal(Sampler()(logits, meta).sampled_token_ids, logits.argmax(-1))


def test_forward_does_not_modify_input_with_processors() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    meta = make_metadata(
        3,
        temperature=[1.0, 0.0, 0.5],
        top_k=[3, 0, 5],
        top_p=[0.8, 1.0, 0.9],
        min_p=[0.1, 0.0, 0.2],
        output_token_ids=[[1, 2], [], [3]],
        presence=[0.5, 0.0, 1.0],
        frequency=[0.1, 0.0, 0.2],
        repetition=[1.2, 1.0, 1.5],
        logit_bias=[{0: 1.0}, None, {4: -2.0}],
        min_tokens={0: (5, {7})},
        allowed_mask=torch.zeros(3, 20, dtype=torch.bool),
        max_num_logprobs=2,
    )
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- processors


def test_allowed_token_ids_mask() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    apply_allowed_token_ids(logits, mask)
    expected = torch.tensor([[1.0, NEG_INF, NEG_INF, NEG_INF], [NEG_INF, NEG_INF, 2.0, 1.0]])
    assert torch.equal(logits, expected)
    # Through the sampler: greedy can only pick allowed tokens.
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    out = Sampler()(logits, make_metadata(2, allowed_mask=mask)).sampled_token_ids
    assert out.tolist() == [0, 2]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 5)
    outputs = [[1, 2], [1, 2, 3], []]
    min_tokens = {0: (3, {1, 4}), 1: (3, {0}), 2: (1, {2})}
    apply_min_tokens(logits, outputs, min_tokens)
    expected = torch.zeros(3, 5)
    expected[0, 1] = expected[0, 4] = NEG_INF  # 2 < 3: masked
    expected[2, 2] = NEG_INF  # 0 < 1: masked; row 1 has 3 >= 3: untouched
    assert torch.equal(logits, expected)


def test_logit_bias_is_additive() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    apply_logit_bias(logits, [{0: 5.0, 2: -1.5}, None])
    assert torch.equal(logits, torch.tensor([[6.0, 2.0, 1.5], [0.0, 0.0, 0.0]]))
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler()(logits, make_metadata(1, logit_bias=[{0: 10.0}])).sampled_token_ids
    assert out.tolist() == [0]


def test_repetition_penalty() -> None:
    vocab = 6
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0, 0.5]])
    prompt = torch.tensor([[0, 1, vocab]])  # padded with vocab_size
    apply_penalties(logits, prompt, [[2, 3]], None, None, torch.tensor([2.0]))
    expected = torch.tensor([[1.0, -4.0, 0.5, -2.0, 3.0, 0.5]])
    assert torch.equal(logits, expected)


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    outputs = [[0, 0, 0, 2], [3]]
    apply_penalties(
        logits, None, outputs, torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0]), None
    )
    expected = torch.tensor(
        [
            [1.0 - 3 * 0.25 - 0.5, 1.0, 1.0 - 0.25 - 0.5, 1.0],
            [1.0, 1.0, 1.0, 0.0],
        ]
    )
    assert torch.allclose(logits, expected)


def test_repetition_applies_before_frequency_presence() -> None:
    logits = torch.tensor([[4.0, -4.0, 2.0]])
    apply_penalties(
        logits,
        torch.tensor([[1]]),
        [[0, 0]],
        torch.tensor([1.0]),
        torch.tensor([0.5]),
        torch.tensor([2.0]),
    )
    # token 0: 4 / 2 - 2 * 0.5 - 1 = 0; token 1 (prompt only): -4 * 2 = -8; token 2 untouched.
    assert torch.equal(logits, torch.tensor([[0.0, -8.0, 2.0]]))


def test_sampler_applies_penalties_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    meta = make_metadata(
        1, output_token_ids=[[0]], presence=[1.0], frequency=[0.0], max_num_logprobs=1
    )
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [1]  # 3 - 1 < 2.9
    raw = torch.log_softmax(logits, -1)
    lp = out.logprobs_tensors
    assert lp is not None
    assert lp.logprob_token_ids.tolist() == [[1, 0]]
    assert torch.allclose(lp.logprobs, torch.stack([raw[0, 1], raw[0, 0]]).unsqueeze(0))
    assert lp.selected_token_ranks.tolist() == [2]


# --------------------------------------------------------------------------- filtering


def test_temperature_division_and_clamp() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 0.0, 0.001]))
    assert torch.allclose(out, torch.tensor([[2.0, 4.0], [1.0, 2.0], [100.0, 200.0]]))
    assert torch.equal(logits, torch.tensor([[1.0, 2.0]] * 3))


def test_top_k_keeps_ties_and_disabled_rows() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [1.0, 3.0, 2.0, 3.0, 0.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, 0]), None)
    assert torch.equal(out[0], torch.tensor([NEG_INF, 3.0, NEG_INF, 3.0, NEG_INF]))
    assert torch.equal(out[1], logits[1])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3, 99]), None)
    assert torch.equal(out[0], torch.tensor([NEG_INF, 3.0, 2.0, 3.0, NEG_INF]))
    assert torch.equal(out[1], logits[1])


def test_top_p_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    p = torch.tensor([0.5, 0.6, 0.9, 1.0])
    out = apply_top_k_top_p(logits.clone(), None, p)
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, False, False, False]
    assert kept[1] == [True, True, False, False]
    assert kept[2] == [True, True, True, False]
    assert kept[3] == [True, True, True, True]
    # top-k and top-p together: the tighter one wins.
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, 3, 2, 0]), p)
    assert torch.isfinite(out).sum(-1).tolist() == [1, 2, 2, 4]


def test_min_p_relative_to_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True] * 4]


def _support_draws(meta_kwargs: dict, logits: torch.Tensor, draws: int) -> torch.Tensor:
    """Sample each row of `logits` `draws` times in one batch; returns [rows, draws]."""
    rows = logits.shape[0]
    big = logits.repeat_interleave(draws, dim=0)  # [rows * draws, vocab]
    kwargs = {key: [v for v in value for _ in range(draws)] for key, value in meta_kwargs.items()}
    out = Sampler()(big, make_metadata(rows * draws, **kwargs)).sampled_token_ids
    return out.reshape(rows, draws)


def test_samples_stay_in_top_k_support() -> None:
    logits = torch.randn(4, 300) * 3
    ks = [1, 5, 20, 0]
    draws = _support_draws({"temperature": [2.0] * 4, "top_k": ks}, logits, 500)
    for row, k in enumerate(ks):
        if k:
            kth = logits[row].topk(k).values[-1]
            assert bool((logits[row][draws[row]] >= kth).all())
    assert len(set(draws[1].tolist())) > 1


def test_samples_stay_in_top_p_support() -> None:
    logits = torch.randn(3, 300) * 2
    ps = [0.3, 0.7, 0.95]
    draws = _support_draws({"temperature": [1.3] * 3, "top_p": ps}, logits, 500)
    for row, p in enumerate(ps):
        probs = torch.softmax(logits[row] / 1.3, -1)
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        support = set(order[mass_before < p + 1e-5].tolist())
        assert set(draws[row].tolist()) <= support


def test_samples_stay_in_min_p_support() -> None:
    logits = torch.randn(3, 300) * 2
    mps = [0.05, 0.3, 0.9]
    draws = _support_draws({"temperature": [0.8] * 3, "min_p": mps}, logits, 500)
    for row, mp in enumerate(mps):
        probs = torch.softmax(logits[row] / 0.8, -1)
        chosen = probs[draws[row]]
        assert bool((chosen >= mp * probs.max() * (1 - 1e-5)).all())


# --------------------------------------------------------------------------- randomness


def test_random_sample_row_uses_own_generator_only() -> None:
    probs = torch.softmax(torch.randn(3, 64), -1)
    gen = torch.Generator().manual_seed(7)
    out = random_sample(probs, {1: gen})
    ref_gen = torch.Generator().manual_seed(7)
    q = torch.empty(64).exponential_(generator=ref_gen)
    assert out[1] == (probs[1] / q).argmax()
    assert torch.equal(gen.get_state(), ref_gen.get_state())


def _run_seeded(
    pos: int, num_others: int, steps: list[torch.Tensor], vocab: int
) -> tuple[list[int], torch.Tensor]:
    """Run the target row (seed 42, T=0.9, top_k=20, top_p=0.9) at `pos` among `num_others`
    random rows (some seeded, some unseeded, some greedy) for each step's logits."""
    target_gen = torch.Generator().manual_seed(42)
    other_gens = [torch.Generator().manual_seed(1000 + i) for i in range(num_others)]
    tokens: list[int] = []
    for step_logits in steps:
        rows = num_others + 1
        logits = torch.randn(rows, vocab) * 2
        logits[pos] = step_logits
        temps, ks, ps, gens = [], [], [], {}
        other = 0
        for row in range(rows):
            if row == pos:
                temps.append(0.9), ks.append(20), ps.append(0.9)
                gens[row] = target_gen
                continue
            kind = other % 3
            temps.append(0.0 if kind == 2 else 1.0 + 0.1 * other)
            ks.append(other % 7)
            ps.append(1.0 if other % 2 else 0.8)
            if kind == 0:
                gens[row] = other_gens[other]
            other += 1
        meta = make_metadata(rows, temperature=temps, top_k=ks, top_p=ps, generators=gens)
        tokens.append(int(Sampler()(logits, meta).sampled_token_ids[pos]))
    return tokens, target_gen.get_state()


def test_seeded_row_independent_of_batch() -> None:
    vocab = 500
    steps = [torch.randn(vocab) for _ in range(6)]
    ref_tokens, ref_state = _run_seeded(0, 0, steps, vocab)
    for pos, others in [(0, 3), (3, 3), (2, 10), (10, 10), (5, 10)]:
        tokens, state = _run_seeded(pos, others, steps, vocab)
        assert tokens == ref_tokens, (pos, others)
        assert torch.equal(state, ref_state)


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(1, 1000)
    meta = make_metadata(1, temperature=[1.0])
    seen = {int(Sampler()(logits, meta).sampled_token_ids[0]) for _ in range(20)}
    assert len(seen) > 10


def test_sampling_matches_softmax_with_temperature() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    temp = 0.7
    n = 20000
    meta = make_metadata(n, temperature=[temp] * n)
    out = Sampler()(logits.expand(n, -1), meta).sampled_token_ids
    observed = torch.bincount(out, minlength=5).double()
    expected = torch.softmax(logits.double() / temp, -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_top_p_sampling_distribution_renormalized() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20000
    meta = make_metadata(n, temperature=[1.0] * n, top_p=[0.65] * n)
    out = Sampler()(probs.log().expand(n, -1), meta).sampled_token_ids
    observed = torch.bincount(out, minlength=4).double()
    assert observed[2:].sum() == 0
    expected = torch.tensor([0.4, 0.3], dtype=torch.float64) / 0.7 * n
    chi2 = float(((observed[:2] - expected) ** 2 / expected).sum())
    assert chi2 < 10.83  # 1 degree of freedom, p = 0.001


# --------------------------------------------------------------------------- logprobs


def test_logprobs_columns_and_ranks() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    lp = gather_logprobs(compute_logprobs(logits), 2, torch.tensor([2, 2]))
    raw = torch.log_softmax(logits, -1)
    assert lp.logprob_token_ids[0].tolist() == [2, 1, 3]
    assert lp.logprob_token_ids[1, :2].tolist() == [2, 0]
    assert lp.logprob_token_ids[1, 2] in (1, 2)  # tie between tokens 1 and 2
    assert torch.allclose(lp.logprobs[0], raw[0, [2, 1, 3]])
    assert torch.allclose(lp.logprobs[1, :2], raw[1, [2, 0]])
    assert lp.selected_token_ranks.tolist() == [3, 2]  # ties do not push the rank down
    assert lp.logprob_token_ids.dtype == torch.int64
    assert lp.logprobs.dtype == torch.float32

    only = gather_logprobs(compute_logprobs(logits), 0, torch.tensor([1, 0]))
    assert only.logprob_token_ids.tolist() == [[1], [0]]
    assert only.selected_token_ranks.tolist() == [1, 1]
    full = gather_logprobs(compute_logprobs(logits), -1, torch.tensor([1, 0]))
    assert full.logprobs.shape == (2, 5)


def test_sampler_logprobs_zero_means_sampled_only() -> None:
    logits = torch.randn(4, 30)
    out = Sampler()(logits, make_metadata(4, max_num_logprobs=0))
    lp = out.logprobs_tensors
    assert lp is not None
    assert lp.logprob_token_ids.shape == (4, 1)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert lp.selected_token_ranks.tolist() == [1, 1, 1, 1]
    ids, values, ranks = lp.tolists()
    assert len(ids) == len(values) == len(ranks) == 4


def test_logprobs_are_raw_not_temperature_scaled() -> None:
    logits = torch.randn(2, 30)
    meta = make_metadata(2, temperature=[0.5, 2.0], max_num_logprobs=3)
    out = Sampler()(logits, meta)
    lp = out.logprobs_tensors
    assert lp is not None
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(3, -1).values)


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, 12, dtype=torch.float16)
    targets = torch.tensor([3, 0, 11, 5, 5])
    lp = compute_prompt_logprobs(logits, targets, 4)
    raw = torch.log_softmax(logits.float(), -1)
    assert lp.logprob_token_ids.shape == (5, 5)
    assert lp.logprob_token_ids[:, 0].tolist() == targets.tolist()
    assert torch.allclose(lp.logprobs[:, 0], raw[torch.arange(5), targets])
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(4, -1).values)
    expected_ranks = [
        1 + int((raw[i] > raw[i, int(t)]).sum()) for i, t in enumerate(targets.tolist())
    ]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    assert math.isclose(float(lp.logprobs[0, 1]), float(raw[0].max()), rel_tol=1e-6)


# ---- the C++ row-wise argmax (used when the paged backend's kernels are built) ----------


def _argmax_kernel():
    from pagedinfer.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("C++ kernels not buildable here")
    return kernels.argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 49152 + 7])
def test_argmax_kernel_matches_torch(dtype: torch.dtype, width: int) -> None:
    argmax = _argmax_kernel()
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g).to(dtype)
    x[1] = 0.5  # all ties: the first index
    if width > 20:
        x[2, 3] = x[2, 19] = 100.0  # tie across vector lanes/chunks
        x[3, width - 1] = 100.0  # maximum in the scalar tail
        x[4, 7], x[4, 18] = float("nan"), float("nan")  # NaN wins, the first one
    x[5] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    view = torch.randn(3, width + 5, generator=g).to(dtype)[:, 2 : 2 + width]  # row stride
    assert torch.equal(argmax(view), view.argmax(dim=-1))


def test_sampler_with_the_argmax_kernel_samples_the_same_tokens() -> None:
    argmax = _argmax_kernel()
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    temps = [0.0, 0.7, 1.0, 0.0, 1.3]
    outs = []
    for sampler in (Sampler(), Sampler(argmax=argmax)):
        gens = {i: torch.Generator().manual_seed(10 + i) for i in range(5)}
        meta = make_metadata(5, temperature=temps, top_k=[0, 50, 0, 0, 20], generators=gens)
        outs.append(sampler(logits, meta).sampled_token_ids)
    assert torch.equal(outs[0], outs[1])
    greedy = make_metadata(5)
    assert torch.equal(Sampler(argmax=argmax)(logits, greedy).sampled_token_ids, logits.argmax(-1))
