"""Property tests for `pagedinfer.sample.sampler`: filters against their definitions on
random logits, penalties against a naive per-token loop, logprob ranks, and seeded
reproducibility for random batch compositions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedinfer.sample.metadata import SamplingMetadata
from pagedinfer.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    gather_logprobs,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def logits_batches(draw: st.DrawFn, max_rows: int = 4, max_vocab: int = 40) -> torch.Tensor:
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale  # [rows, vocab]
    if draw(st.booleans()):
        # Coarse values create ties.
        logits = logits.round()
    return logits


@SETTINGS
@given(logits=logits_batches(), data=st.data())
def test_top_k_keeps_exactly_values_ge_kth(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, vocab = logits.shape
    ks = data.draw(st.lists(st.integers(0, vocab + 3), min_size=rows, max_size=rows))
    use_p = data.draw(st.booleans())  # exercise the sort path with p = 1 (off)
    p = torch.ones(rows) if use_p else None
    out = apply_top_k_top_p(logits.clone(), torch.tensor(ks), p)
    for row, k in enumerate(ks):
        if k == 0 or k >= vocab:
            expected = torch.ones(vocab, dtype=torch.bool)
        else:
            expected = logits[row] >= logits[row].topk(k).values[-1]
        kept = torch.isfinite(out[row])
        assert torch.equal(kept, expected), (row, k)
        assert torch.equal(out[row][kept], logits[row][kept])


@SETTINGS
@given(logits=logits_batches(), data=st.data())
def test_top_p_keeps_minimal_top_set(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, _ = logits.shape
    ps = data.draw(st.lists(st.floats(0.05, 1.0), min_size=rows, max_size=rows), label="top_p")
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor(ps))
    probs = torch.softmax(logits.double(), -1)
    for row, p in enumerate(ps):
        kept = torch.isfinite(out[row])
        assert bool(kept.any())
        # A top set: every kept token is at least as likely as every dropped one.
        if bool((~kept).any()):
            assert logits[row][kept].min() >= logits[row][~kept].max()
        mass = float(probs[row][kept].sum())
        assert mass >= p - 1e-5
        # Minimal: without its least likely token the set no longer reaches p.
        assert mass - float(probs[row][kept].min()) < p + 1e-5


@SETTINGS
@given(logits=logits_batches(), data=st.data())
def test_min_p_support(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, _ = logits.shape
    mps = data.draw(st.lists(st.floats(0.0, 1.0), min_size=rows, max_size=rows))
    out = apply_min_p(logits.clone(), torch.tensor(mps))
    probs = torch.softmax(logits.double(), -1)
    for row, mp in enumerate(mps):
        kept = torch.isfinite(out[row])
        ratio = probs[row] / probs[row].max()
        assert bool(kept[ratio >= mp * (1 + 1e-5)].all())
        assert not bool(kept[ratio < mp * (1 - 1e-5)].any())
        assert bool(kept[probs[row].argmax()])


@SETTINGS
@given(logits=logits_batches(), data=st.data())
def test_samples_never_leave_support(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, vocab = logits.shape
    k = data.draw(st.integers(0, vocab))
    p = data.draw(st.floats(0.1, 1.0))
    mp = data.draw(st.floats(0.0, 0.5))
    temp = data.draw(st.sampled_from([0.3, 1.0, 2.0]))
    draws = 64
    big = logits.repeat_interleave(draws, dim=0)  # [rows * draws, vocab]
    n = big.shape[0]
    meta = SamplingMetadata(
        temperature=torch.full((n,), temp),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((n,), p),
        top_k=torch.full((n,), k, dtype=torch.int64),
        min_p=torch.full((n,), mp),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(n)],
        frequency_penalties=None,
        presence_penalties=None,
        repetition_penalties=None,
        logit_bias=[None] * n,
    )
    out = Sampler()(big, meta).sampled_token_ids.reshape(rows, draws)
    scaled = logits / temp
    support = apply_top_k_top_p(scaled.clone(), torch.full((rows,), k), torch.full((rows,), p))
    support = torch.isfinite(apply_min_p(support, torch.full((rows,), mp)))
    for row in range(rows):
        assert bool(support[row][out[row]].all())


def _naive_penalties(
    logits: list[list[float]],
    prompts: list[list[int]],
    outputs: list[list[int]],
    pres: list[float],
    freq: list[float],
    rep: list[float],
) -> list[list[float]]:
    result = []
    for row, values in enumerate(logits):
        new = []
        for tok, value in enumerate(values):
            if tok in prompts[row] or tok in outputs[row]:
                value = value / rep[row] if value > 0 else value * rep[row]
            count = outputs[row].count(tok)
            value -= freq[row] * count
            if count:
                value -= pres[row]
            new.append(value)
        result.append(new)
    return result


@SETTINGS
@given(logits=logits_batches(max_vocab=12), data=st.data())
def test_penalties_match_naive(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, vocab = logits.shape
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    prompts = data.draw(st.lists(tokens, min_size=rows, max_size=rows))
    outputs = data.draw(st.lists(tokens, min_size=rows, max_size=rows))
    pres = data.draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows))
    freq = data.draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows))
    rep = data.draw(st.lists(st.floats(0.1, 3.0), min_size=rows, max_size=rows))
    width = max(1, max(len(p) for p in prompts))
    prompt_t = torch.tensor([p + [vocab] * (width - len(p)) for p in prompts])
    out = apply_penalties(
        logits.clone(),
        prompt_t,
        outputs,
        torch.tensor(pres),
        torch.tensor(freq),
        torch.tensor(rep),
    )
    expected = _naive_penalties(logits.tolist(), prompts, outputs, pres, freq, rep)
    assert torch.allclose(out, torch.tensor(expected), atol=1e-5)


@SETTINGS
@given(logits=logits_batches(), data=st.data())
def test_logprob_ranks_and_topk(logits: torch.Tensor, data: st.DataObject) -> None:
    rows, vocab = logits.shape
    k = data.draw(st.integers(0, vocab))
    targets = data.draw(st.lists(st.integers(0, vocab - 1), min_size=rows, max_size=rows))
    raw = compute_logprobs(logits)
    lp = gather_logprobs(raw, k, torch.tensor(targets))
    assert lp.logprob_token_ids.shape == (rows, k + 1)
    for row, tok in enumerate(targets):
        assert int(lp.logprob_token_ids[row, 0]) == tok
        assert float(lp.logprobs[row, 0]) == float(raw[row, tok])
        assert int(lp.selected_token_ranks[row]) == 1 + int((raw[row] > raw[row, tok]).sum())
        top = lp.logprobs[row, 1:]
        assert torch.equal(top, raw[row].topk(k).values)
        assert torch.equal(raw[row][lp.logprob_token_ids[row, 1:]], top)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    layout=st.lists(st.sampled_from(["seeded", "unseeded", "greedy"]), max_size=10),
    pos_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_seeded_row_batch_invariant(layout: list[str], pos_frac: float, seed: int) -> None:
    vocab, num_steps = 97, 4
    step_gen = torch.Generator().manual_seed(seed)
    steps = [torch.randn(vocab, generator=step_gen) * 2 for _ in range(num_steps)]

    def run(kinds: list[str], pos: int) -> list[int]:
        target = torch.Generator().manual_seed(seed)
        others = [torch.Generator().manual_seed(seed + 1 + i) for i in range(len(kinds))]
        tokens = []
        for step in steps:
            rows = len(kinds) + 1
            logits = torch.randn(rows, vocab) * 3  # [rows, vocab]
            logits[pos] = step
            row_kinds = kinds[:pos] + ["target"] + kinds[pos:]
            temps = [0.0 if kind == "greedy" else 0.8 for kind in row_kinds]
            gens = {
                row: (target if kind == "target" else others[min(row, len(kinds) - 1)])
                for row, kind in enumerate(row_kinds)
                if kind in ("target", "seeded")
            }
            meta = SamplingMetadata(
                temperature=torch.tensor(temps),
                all_greedy=False,
                all_random=all(t > 0 for t in temps),
                top_p=torch.tensor([0.95 if k == "target" else 1.0 for k in row_kinds]),
                top_k=torch.tensor([30 if k == "target" else 5 for k in row_kinds]),
                min_p=None,
                generators=gens,
                max_num_logprobs=None,
                no_penalties=True,
                prompt_token_ids=None,
                output_token_ids=[[] for _ in range(rows)],
                frequency_penalties=None,
                presence_penalties=None,
                repetition_penalties=None,
                logit_bias=[None] * rows,
            )
            tokens.append(int(Sampler()(logits, meta).sampled_token_ids[pos]))
        return tokens

    alone = run([], 0)
    pos = round(pos_frac * len(layout))
    assert run(layout, pos) == alone
