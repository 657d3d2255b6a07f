"""Unit tests for `pagedinfer.spec_decode.rejection_sampler`.

Greedy requests are checked token for token against non-speculative decoding with the normal
`Sampler` (including penalties that must see the drafts as history). Random requests are
checked statistically: many independent requests in one batch, and a chi-square
goodness-of-fit test of the emitted tokens against the target distribution, with a
threshold whose false-failure rate is below 1e-6 (seeds are fixed anyway). Each statistical
test also shows the check would catch a wrong sampler.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pagedinfer.sample.metadata import SamplingMetadata
from pagedinfer.sample.sampler import Sampler
from pagedinfer.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionOutput,
    RejectionSampler,
)

VOCAB = 12
NUM_TRIALS = 30_000


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(20240601)


@pytest.fixture
def rs() -> RejectionSampler:
    return RejectionSampler(Sampler())


def make_metadata(reqs: list[dict[str, Any]], vocab: int = VOCAB) -> SamplingMetadata:
    """Per-request metadata as the model runner builds it. Each request is a dict with
    optional keys: temperature (0 = greedy), top_k, generator, output, prompt, presence,
    frequency, repetition, bias, min_tokens ((n, stop_ids)), allowed (list of ids)."""
    n = len(reqs)
    temps = [r.get("temperature", 0.0) for r in reqs]
    all_greedy = all(t < 1e-5 for t in temps)
    all_random = all(t >= 1e-5 for t in temps)
    use_pen = any(k in r for r in reqs for k in ("presence", "frequency", "repetition"))
    prompt = None
    if any("repetition" in r for r in reqs):
        width = max(1, max(len(r.get("prompt", [])) for r in reqs))
        rows = [r.get("prompt", []) + [vocab] * (width - len(r.get("prompt", []))) for r in reqs]
        prompt = torch.tensor(rows, dtype=torch.int64)  # [n, width]
    allowed = None
    if any("allowed" in r for r in reqs):
        allowed = torch.zeros(n, vocab, dtype=torch.bool)  # [n, vocab]; True = disallowed
        for i, r in enumerate(reqs):
            if "allowed" in r:
                allowed[i] = True
                allowed[i, r["allowed"]] = False

    def floats(key: str, default: float) -> torch.Tensor:
        return torch.tensor([float(r.get(key, default)) for r in reqs])  # [n]

    return SamplingMetadata(
        temperature=None if all_greedy else torch.tensor(temps, dtype=torch.float32),
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None,
        top_k=(
            torch.tensor([r.get("top_k", 0) for r in reqs])
            if any("top_k" in r for r in reqs)
            else None
        ),
        min_p=None,
        generators={i: r["generator"] for i, r in enumerate(reqs) if "generator" in r},
        max_num_logprobs=None,
        no_penalties=not use_pen,
        prompt_token_ids=prompt,
        output_token_ids=[list(r.get("output", [])) for r in reqs],
        frequency_penalties=floats("frequency", 0.0) if use_pen else None,
        presence_penalties=floats("presence", 0.0) if use_pen else None,
        repetition_penalties=floats("repetition", 1.0) if use_pen else None,
        logit_bias=[r.get("bias") for r in reqs],
        min_tokens={i: r["min_tokens"] for i, r in enumerate(reqs) if "min_tokens" in r},
        allowed_token_ids_mask=allowed,
    )


def peaked_logits(argmax_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Random logits whose row r has its maximum at argmax_ids[r]: [len(argmax_ids), vocab]."""
    logits = torch.randn(len(argmax_ids), vocab)  # [rows, vocab]
    logits[torch.arange(len(argmax_ids)), argmax_ids] = 10.0
    return logits


def chi2_threshold(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at the normal quantile z (z = 5:
    tail probability ~3e-7)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of integer `samples` against `probs` `[num_cells]`, and its degrees
    of freedom; a sample in a zero-probability cell gives infinity."""
    probs = probs.to(torch.float64)
    counts = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)
    expected = probs * samples.numel()
    support = expected > 0
    if bool((counts[~support] > 0).any()):
        return math.inf, int(support.sum()) - 1
    diff = counts[support] - expected[support]
    return float((diff**2 / expected[support]).sum()), int(support.sum()) - 1


def assert_fits(samples: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi2_stat(samples, probs)
    assert stat < chi2_threshold(df), f"chi2 = {stat:.1f} with df = {df}"


def assert_misfits(samples: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi2_stat(samples, probs)
    assert stat > 10 * chi2_threshold(df), f"chi2 = {stat:.1f} with df = {df}"


def first_tokens(out: RejectionOutput) -> torch.Tensor:
    return torch.tensor([s[0] for s in out.sampled_token_ids])  # [num_reqs]


def check_shape(out: RejectionOutput, drafts: list[list[int]]) -> None:
    for sampled, n, d in zip(out.sampled_token_ids, out.num_accepted, drafts):
        assert len(sampled) == n + 1 and 0 <= n <= len(d) and sampled[:n] == d[:n]


# --------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_gets_bonus(rs: RejectionSampler) -> None:
    targets = [3, 7, 1, 1, 9]
    out = rs([targets[:4]], None, peaked_logits(targets), make_metadata([{}]))
    assert out.sampled_token_ids == [targets] and out.num_accepted == [4]


@pytest.mark.parametrize("reject_at", [0, 2, 3])
def test_greedy_rejection_position(rs: RejectionSampler, reject_at: int) -> None:
    targets = [3, 7, 1, 1, 9]
    drafts = list(targets[:4])
    drafts[reject_at] = (drafts[reject_at] + 1) % VOCAB
    out = rs([drafts], None, peaked_logits(targets), make_metadata([{}]))
    # Accepted prefix, then the target's correction; nothing after the rejection.
    assert out.sampled_token_ids == [targets[: reject_at + 1]]
    assert out.num_accepted == [reject_at]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k0_greedy_equals_sampler(rs: RejectionSampler, dtype: torch.dtype) -> None:
    reqs: list[dict[str, Any]] = [
        {},
        {"presence": 2.0, "output": [4, 5]},
        {"bias": {3: 3.0}},
        {"allowed": [0, 1, 2]},
        {"min_tokens": (1, {0, 1})},
    ]
    logits = (torch.randn(len(reqs), VOCAB) * 2).to(dtype)  # [num_reqs, vocab]
    original = logits.clone()
    meta = make_metadata(reqs)
    expected = Sampler()(logits, meta).sampled_token_ids.tolist()
    out = rs([[] for _ in reqs], None, logits, meta)
    assert out.sampled_token_ids == [[t] for t in expected] and out.num_accepted == [0] * 5
    assert torch.equal(logits, original)


def test_greedy_mixed_batch(rs: RejectionSampler) -> None:
    """Greedy requests with different k (some 0) next to random ones whose target is so
    peaked that their tokens are certain."""
    drafts = [[2, 5, 5], [], [1, 4], [6], [], [8, 8]]
    targets = [[2, 5, 0, 3], [7], [1, 4, 11], [6, 6], [9], [8, 8, 10]]
    temps = [0.0, 0.0, 1.0, 0.0, 0.8, 0.0]
    logits = torch.cat([peaked_logits(t) for t in targets]) * 5  # [sum(k + 1), vocab]
    reqs = [{"temperature": t} for t in temps]
    out = rs(drafts, None, logits, make_metadata(reqs))
    assert out.sampled_token_ids == [[2, 5, 0], [7], [1, 4, 11], [6, 6], [9], [8, 8, 10]]
    assert out.num_accepted == [2, 0, 2, 1, 0, 2]


def test_penalty_sees_earlier_drafts(rs: RejectionSampler) -> None:
    row = torch.zeros(VOCAB)
    row[2], row[5] = 5.0, 4.5
    logits = row.repeat(3, 1)  # [3, vocab]: raw argmax is 2 at every position
    meta = make_metadata([{"presence": 1.0}])
    # Draft 0 = 2 is accepted; at row 1 it is history, so 2 drops to 4.0 < 4.5.
    out = rs([[2, 2]], None, logits, meta)
    assert out.sampled_token_ids == [[2, 5]] and out.num_accepted == [1]
    out = rs([[2, 5]], None, logits, meta)
    # Row 2 has both 2 and 5 in its history: back to 2 (4.0 vs 3.5).
    assert out.sampled_token_ids == [[2, 5, 2]] and out.num_accepted == [2]


def greedy_step(row: torch.Tensor, req: dict[str, Any], history: list[int]) -> int:
    """The normal Sampler's greedy token for one row `[1, vocab]`, with `history` appended to
    the request's output."""
    row_req = dict(req, output=req.get("output", []) + history)
    return int(Sampler()(row, make_metadata([row_req], row.shape[1])).sampled_token_ids.item())


def sequential_greedy(logits: torch.Tensor, req: dict[str, Any], drafts: list[int]) -> list[int]:
    """Non-speculative reference: the normal Sampler on row j with history
    output + drafts[:j], stopping at the first token that differs from the draft."""
    tokens: list[int] = []
    for j in range(len(drafts) + 1):
        tokens.append(greedy_step(logits[j : j + 1], req, drafts[:j]))
        if j == len(drafts) or tokens[-1] != drafts[j]:
            break
    return tokens


def test_processors_match_sequential_decoding(rs: RejectionSampler) -> None:
    """Penalties, min_tokens, logit bias and allowed ids over a batch with ragged k equal
    non-speculative greedy decoding step by step, for accepted and rejected drafts."""
    vocab = 32
    reqs: list[dict[str, Any]] = [
        {"repetition": 1.8, "prompt": [1, 2, 3], "output": [4]},
        {"frequency": 0.7, "presence": 0.5, "output": [5, 5, 6]},
        {"min_tokens": (3, {7, 8}), "output": [9]},
        {"bias": {10: 2.0, 11: -1.0}, "presence": 1.0},
        {"allowed": list(range(0, 32, 2)), "repetition": 1.3},
        {},
    ]
    num_drafts = [4, 3, 4, 2, 3, 0]
    logits_per_req = []
    for k, req in zip(num_drafts, reqs):
        base = torch.randn(vocab)
        rows = base + 0.3 * torch.randn(k + 1, vocab)  # [k + 1, vocab]: similar rows repeat
        if "min_tokens" in req:
            rows[:, 7] = 9.0  # the stop token wins as soon as min_tokens allows it
        logits_per_req.append(rows)
    # Drafts = what sequential decoding emits (all accepted), then break some of them.
    drafts: list[list[int]] = []
    for rows, req, k in zip(logits_per_req, reqs, num_drafts):
        tokens: list[int] = []
        for j in range(k):
            tokens.append(greedy_step(rows[j : j + 1], req, tokens))
        drafts.append(tokens)
    drafts[1][1] = (drafts[1][1] + 1) % vocab
    drafts[4][0] = (drafts[4][0] + 1) % vocab
    logits = torch.cat(logits_per_req)  # [sum(k + 1), vocab]
    out = rs(drafts, None, logits, make_metadata(reqs, vocab))
    expected = [sequential_greedy(r, q, d) for r, q, d in zip(logits_per_req, reqs, drafts)]
    assert out.sampled_token_ids == expected
    assert out.num_accepted == [4, 1, 4, 2, 0, 0]
    # The min_tokens request really crossed its boundary: stop token only at position 2.
    assert 7 not in expected[2][:2] and expected[2][2] == 7
    # ...and the processors matter: raw argmax disagrees somewhere.
    raw = [logits_per_req[i].argmax(-1).tolist()[: len(expected[i])] for i in range(6)]
    assert raw != expected


# --------------------------------------------------------------------------- random


def target_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return (logits.to(torch.float32) / temperature).softmax(dim=-1)  # [..., vocab]


def skewed(scale: float) -> torch.Tensor:
    """A fixed, not-too-peaked logits vector [VOCAB]."""
    return torch.linspace(-1.0, 1.0, VOCAB)[torch.randperm(VOCAB)] * scale


def run_random(
    rs: RejectionSampler,
    p_logits: torch.Tensor,
    q: torch.Tensor | None,
    num_drafts: list[int],
    drafts: torch.Tensor,
) -> tuple[RejectionOutput, list[list[int]]]:
    """Every request has target logits `p_logits` [VOCAB] at every position and draft
    distribution `q` [VOCAB] (or None) at every draft; `drafts` [num_reqs, max_k]."""
    draft_lists = [drafts[i, :k].tolist() for i, k in enumerate(num_drafts)]
    total_drafts = sum(num_drafts)
    logits = p_logits.repeat(total_drafts + len(num_drafts), 1)  # [sum(k + 1), vocab]
    draft_probs = None if q is None else q.repeat(total_drafts, 1)  # [sum(k), vocab]
    meta = make_metadata([{"temperature": 1.0}] * len(num_drafts))
    out = rs(draft_lists, draft_probs, logits, meta)
    check_shape(out, draft_lists)
    return out, draft_lists


@pytest.mark.parametrize("case", ["close", "far", "none_fixed", "none_random"])
def test_first_token_matches_target(rs: RejectionSampler, case: str) -> None:
    p_logits = skewed(2.0)
    p = target_probs(p_logits)
    num_drafts = [i % 4 for i in range(NUM_TRIALS)]  # k = 0..3, the marginal must not care
    if case == "close":
        q = target_probs(p_logits + 0.3 * torch.randn(VOCAB))
    elif case == "far":
        q = target_probs(-3.0 * p_logits)  # mass on the tokens p dislikes
    else:
        q = None
    if case == "none_fixed":
        drafts = torch.full((NUM_TRIALS, 3), int(p.argmax()))
    elif case == "none_random":
        drafts = torch.randint(0, VOCAB, (NUM_TRIALS, 3))
    else:
        assert q is not None
        drafts = torch.multinomial(q, NUM_TRIALS * 3, replacement=True).view(NUM_TRIALS, 3)
    out, draft_lists = run_random(rs, p_logits, q, num_drafts, drafts)
    first = first_tokens(out)
    assert_fits(first, p)

    # Sensitivity: two wrong samplers fail the same check. (1) Always accept: the first
    # token would be the draft itself.
    has_draft = torch.tensor(num_drafts) > 0
    if case != "close":  # q close to p is, by design, nearly indistinguishable
        assert_misfits(drafts[has_draft, 0], p)
    # (2) On rejection, resample from p instead of the residual.
    accepted = torch.tensor(out.num_accepted) > 0
    naive = torch.where(accepted, drafts[:, 0], torch.multinomial(p, NUM_TRIALS, True))
    naive = torch.where(has_draft, naive, first)
    if case in ("far", "none_fixed"):
        assert_misfits(naive, p)
    if q is None:
        # A rejected point-mass draft is never emitted as the correction.
        rejected = has_draft & ~accepted
        assert bool((first[rejected] != drafts[rejected, 0]).all())


def test_second_token_joint_distribution(rs: RejectionSampler) -> None:
    """k = 2 with a target whose row 1 depends on draft 0 (as a real model's does): the
    first two tokens, completed by plain sampling when the step emitted only one, follow
    p0(t0) * p1(t1 | t0)."""
    vocab, n = 6, 40_000
    p0_logits = torch.randn(vocab)
    table = torch.randn(vocab, vocab)  # [prev token, vocab]: row-1 logits given token 0
    q0, q1 = torch.rand(vocab).softmax(0), (2 * torch.randn(vocab)).softmax(0)  # [vocab]
    d0 = torch.multinomial(q0, n, replacement=True)  # [n]
    d1 = torch.multinomial(q1, n, replacement=True)  # [n]
    logits = torch.stack(
        [p0_logits.expand(n, vocab), table[d0], torch.randn(n, vocab)], dim=1
    ).view(3 * n, vocab)  # [n * 3, vocab]
    draft_probs = torch.stack([q0.expand(n, vocab), q1.expand(n, vocab)], dim=1).view(2 * n, -1)
    drafts = torch.stack([d0, d1], dim=1).tolist()
    out = rs(drafts, draft_probs, logits, make_metadata([{"temperature": 1.0}] * n, vocab))
    check_shape(out, drafts)
    t0 = first_tokens(out)
    completion = torch.multinomial(target_probs(table[t0]), 1).squeeze(1)  # [n]
    second = torch.tensor([s[1] if len(s) > 1 else -1 for s in out.sampled_token_ids])
    t1 = torch.where(second >= 0, second, completion)
    joint = target_probs(p0_logits).unsqueeze(1) * target_probs(table)  # [vocab, vocab]
    assert_fits(t0 * vocab + t1, joint.flatten())
    assert 0.2 < sum(out.num_accepted) / (2 * n) < 0.8  # both branches well exercised
    # Sensitivity: ignoring the conditioning (pairs from p0 x the wrong row) misfits.
    assert_misfits(t0 * vocab + (t1 + 1) % vocab, joint.flatten())


def test_temperature_and_top_k(rs: RejectionSampler) -> None:
    p_logits = skewed(3.0)
    temperature, top_k = 0.7, 4
    kth = p_logits.topk(top_k).values[-1]
    expected = target_probs(p_logits.masked_fill(p_logits < kth, float("-inf")), temperature)
    q = torch.full((VOCAB,), 1.0 / VOCAB)  # drafts often outside the top-k
    drafts = torch.randint(0, VOCAB, (NUM_TRIALS, 2))
    draft_lists = drafts.tolist()
    logits = p_logits.repeat(3 * NUM_TRIALS, 1)  # [n * 3, vocab]
    reqs = [{"temperature": temperature, "top_k": top_k}] * NUM_TRIALS
    out = rs(draft_lists, q.repeat(2 * NUM_TRIALS, 1), logits, make_metadata(reqs))
    check_shape(out, draft_lists)
    assert_fits(first_tokens(out), expected)  # also: nothing outside the top-k
    outside = expected[drafts[:, 0]] == 0
    assert bool((torch.tensor(out.num_accepted)[outside] == 0).all())
    # Sensitivity: the untempered top-k target, or the unfiltered tempered one, misfit.
    assert_misfits(first_tokens(out), target_probs(p_logits.masked_fill(p_logits < kth, -1e9)))
    assert_misfits(first_tokens(out), target_probs(p_logits, temperature))


def test_q_equal_p_accepts_everything(rs: RejectionSampler) -> None:
    p_logits = skewed(2.0)
    n, k = 20_000, 3
    q = target_probs(p_logits)  # what the target computes, bit for bit
    drafts = torch.multinomial(q, n * k, replacement=True).view(n, k)
    out, _ = run_random(rs, p_logits, q, [k] * n, drafts)
    assert out.num_accepted == [k] * n


@pytest.mark.parametrize("token_rank", [0, 5])
def test_point_mass_acceptance_rate_is_p_of_draft(rs: RejectionSampler, token_rank: int) -> None:
    p_logits = torch.zeros(VOCAB)
    p_logits[0] = 4.0  # peaked: p(0) ~ 0.83
    p = target_probs(p_logits)
    token = int(p.argsort(descending=True)[token_rank])
    drafts = torch.full((NUM_TRIALS, 1), token)
    out, _ = run_random(rs, p_logits, None, [1] * NUM_TRIALS, drafts)
    rate = sum(out.num_accepted) / NUM_TRIALS
    sigma = math.sqrt(float(p[token] * (1 - p[token])) / NUM_TRIALS)
    assert abs(rate - float(p[token])) < 5 * sigma + 1e-9


# --------------------------------------------------------------------------- determinism


def seeded_batch(rs: RejectionSampler, order: list[int], seeds: dict[int, int]) -> dict:
    """Run the requests in `order` (ids 0..7; ids in `seeds` get a fresh generator) as one
    batch; request r's inputs are fixed by r. Returns {request id: sampled ids}."""
    gen = torch.Generator().manual_seed(99)
    vocab = 16
    num_drafts = [2, 0, 3, 1, 2, 4, 0, 1]
    temps = [1.0, 0.9, 1.3, 0.0, 1.0, 0.7, 1.0, 2.0]
    per_logits = [torch.randn(k + 1, vocab, generator=gen) for k in num_drafts]
    per_q = [torch.rand(k, vocab, generator=gen).softmax(-1) for k in num_drafts]
    per_drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in num_drafts]
    reqs = []
    for r in order:
        req: dict[str, Any] = {"temperature": temps[r]}
        if r in seeds:
            req["generator"] = torch.Generator().manual_seed(seeds[r])
        reqs.append(req)
    out = rs(
        [per_drafts[r] for r in order],
        torch.cat([per_q[r] for r in order]),
        torch.cat([per_logits[r] for r in order]),
        make_metadata(reqs, vocab),
    )
    return dict(zip(order, out.sampled_token_ids))


def test_seeded_requests_reproducible_across_batches(rs: RejectionSampler) -> None:
    seeds = {0: 11, 2: 22, 5: 33, 7: 44}
    runs = [
        seeded_batch(rs, [0, 2, 5, 7], seeds),
        seeded_batch(rs, [7, 1, 5, 3, 0, 6, 2, 4], seeds),
        seeded_batch(rs, [4, 2, 6, 0, 7, 1, 5, 3], seeds),
    ]
    for r in seeds:
        assert runs[0][r] == runs[1][r] == runs[2][r]
    # Different seeds change something (so the equality above is not vacuous).
    other = [
        seeded_batch(rs, [0, 2, 5, 7], {r: s + i for r, s in seeds.items()}) for i in range(1, 4)
    ]
    assert any(o[r] != runs[0][r] for o in other for r in seeds)


def test_seeded_k0_equals_sampler(rs: RejectionSampler) -> None:
    logits = torch.randn(5, VOCAB)  # [5, vocab]
    temps = [1.0, 0.5, 0.0, 1.5, 1.0]

    def meta() -> SamplingMetadata:
        reqs = [
            {"temperature": t, "generator": torch.Generator().manual_seed(7 + i)}
            for i, t in enumerate(temps)
        ]
        return make_metadata(reqs)

    for _ in range(3):
        expected = Sampler()(logits, meta()).sampled_token_ids.tolist()
        out = rs([[]] * 5, None, logits, meta())
        assert out.sampled_token_ids == [[t] for t in expected]


# --------------------------------------------------------------------------- contract


def test_inputs_untouched_and_bf16(rs: RejectionSampler) -> None:
    logits = torch.randn(5, VOCAB).to(torch.bfloat16)  # [5, vocab]
    draft_probs = torch.rand(3, VOCAB).softmax(-1)  # [3, vocab]
    saved = (logits.clone(), draft_probs.clone())
    meta = make_metadata([{"temperature": 1.0, "presence": 0.5}, {"temperature": 0.0}])
    out = rs([[1, 2], [3]], draft_probs, logits, meta)
    check_shape(out, [[1, 2], [3]])
    assert torch.equal(logits, saved[0]) and torch.equal(draft_probs, saved[1])
    assert PLACEHOLDER_TOKEN_ID < 0
    assert rs([], None, torch.empty(0, VOCAB), make_metadata([])).sampled_token_ids == []


def test_shape_errors(rs: RejectionSampler) -> None:
    meta = make_metadata([{}, {}])
    with pytest.raises(ValueError, match="logits"):
        rs([[1], [2]], None, torch.randn(3, VOCAB), meta)
    with pytest.raises(ValueError, match="draft_probs"):
        rs([[1], [2]], torch.rand(3, VOCAB), torch.randn(4, VOCAB), meta)
    with pytest.raises(ValueError, match="requests"):
        rs([[1]], None, torch.randn(2, VOCAB), meta)
