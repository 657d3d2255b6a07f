"""The offline API on the real default model: sampling, outputs, bad input, aborts."""

from __future__ import annotations

import pytest

from pagedinfer import LLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "In 1969, astronauts",
    "The best way to learn Python is",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory_bytes=192 * 2**20, max_model_len=1024)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=30),
        SamplingParams(temperature=0.7, seed=7, max_tokens=10),
        _greedy(max_tokens=5),
        SamplingParams(temperature=1.2, min_p=0.05, max_tokens=40),
    ]
    # Same request in the middle of a batch, then last.
    batch = llm.generate(
        PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:5],
        others[:2] + [params] + others[2:],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    batch = llm.generate(PROMPTS[1:5] + [PROMPTS[0]], others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    # A different seed gives a different sample (sanity: the seed matters).
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=24)
    assert llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_greater_than_one(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (again,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_strings(llm: LLM) -> None:
    base = llm.generate(PROMPTS[0], _greedy(max_tokens=32), use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[10:14]
    assert stop and stop in text
    cut = llm.generate(PROMPTS[0], _greedy(max_tokens=32, stop=[stop]), use_tqdm=False)[0]
    c = cut.outputs[0]
    assert c.text == text[: text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    kept = llm.generate(
        PROMPTS[0],
        _greedy(max_tokens=32, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    base = llm.generate(PROMPTS[1], _greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        PROMPTS[1], _greedy(max_tokens=16, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]  # the stop token is kept
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_and_min_tokens(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    out = llm.chat(msgs, _greedy(max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    n = len(out.token_ids)
    longer = llm.chat(msgs, _greedy(max_tokens=64, min_tokens=n + 5), use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) >= n + 5
    assert eos not in longer.outputs[0].token_ids[: n + 4]
    ignored = llm.chat(msgs, _greedy(max_tokens=n + 3, ignore_eos=True), use_tqdm=False)[0]
    assert len(ignored.outputs[0].token_ids) == n + 3


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    (out,) = llm.generate(
        PROMPTS[3], _greedy(max_tokens=6, logprobs=3, prompt_logprobs=2), use_tqdm=False
    )
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    total = 0.0
    for token_id, entry in zip(c.token_ids, c.logprobs):
        assert token_id in entry
        assert entry[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4 and all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token_id].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(out.prompt_token_ids) and plp[0] is None
    for token_id, entry in zip(out.prompt_token_ids[1:], plp[1:]):
        assert entry is not None and token_id in entry


def test_prompt_logprobs_equal_with_chunked_prefill() -> None:
    small = LLM(
        dtype="float32",
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=512,
        max_num_batched_tokens=8,
    )
    prompt = "The quick brown fox jumps over the lazy dog because it was late for dinner."
    params = _greedy(max_tokens=2, prompt_logprobs=1)
    chunked = small.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    del small
    whole = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    expected = whole.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    assert chunked is not None and expected is not None and len(chunked) == len(expected)
    for a, b in zip(chunked[1:], expected[1:]):
        assert a is not None and b is not None and a.keys() == b.keys()
        for k in a:
            assert a[k].logprob == pytest.approx(b[k].logprob, abs=1e-4)


def test_logit_bias_and_allowed_token_ids(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    target = tok.encode(" banana")[0]
    out = llm.generate(
        PROMPTS[0], _greedy(max_tokens=4, logit_bias={target: 100.0}), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == [target] * 4
    allowed = tok.encode(" yes no maybe")
    out = llm.generate(
        PROMPTS[4],
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_repetition_penalty_reduces_repeats(llm: LLM) -> None:
    plain = llm.generate("one one one one one one", _greedy(max_tokens=12), use_tqdm=False)
    penal = llm.generate(
        "one one one one one one", _greedy(max_tokens=12, repetition_penalty=2.0), use_tqdm=False
    )
    plain_ids, penal_ids = plain[0].outputs[0].token_ids, penal[0].outputs[0].token_ids
    # Unpenalised greedy decoding loops on a few tokens; the penalty breaks the loop.
    assert len(set(penal_ids)) > len(set(plain_ids))


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([5, 10**7], SamplingParams(), "out of vocabulary"),
        ("hi " * 2000, SamplingParams(), "maximum model length"),
        ("hi", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        ("hi", SamplingParams(logprobs=50), "max_logprobs"),
        (12, SamplingParams(), "Unsupported prompt type"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm: LLM, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], [_greedy(max_tokens=4), params], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate(PROMPTS[0], _greedy(max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -5},
        {"max_tokens": 0},
        {"min_p": 2.0},
        {"presence_penalty": 3.0},
        {"stop": [""]},
        {"n": 0},
        {"top_k": 2**63},  # past int64: would fail in the engine's step, not here
        {"seed": 2**64},
        {"max_tokens": 2**70},
    ],
)
def test_invalid_sampling_params(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_abort_frees_blocks_and_others_finish(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv_cache_manager
    free_before = kv.get_num_free_blocks()
    for i, p in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[3]]):
        engine.add_request(f"abort-{i}", p, _greedy(max_tokens=20, ignore_eos=True))
    done = {}
    for _ in range(2):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert kv.get_num_free_blocks() < free_before
    held = len(kv.get_block_ids("abort-1"))
    free_mid = kv.get_num_free_blocks()
    engine.abort_request("abort-1")
    assert kv.get_num_free_blocks() == free_mid + held
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"abort-0", "abort-2"}
    assert all(len(o.outputs[0].token_ids) == 20 for o in done.values())
    assert kv.get_num_free_blocks() == free_before


def test_streaming_deltas_add_up(llm: LLM) -> None:
    engine = llm.llm_engine
    params = _greedy(max_tokens=20, output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream", PROMPTS[0], params)
    pieces, token_ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            token_ids.extend(out.outputs[0].token_ids)
    assert len(pieces) > 5  # one output per step, not one at the end
    full = llm.generate(PROMPTS[0], _greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert "".join(pieces) == full.text and token_ids == full.token_ids


def test_stats(llm: LLM) -> None:
    llm.generate(PROMPTS[:2], _greedy(max_tokens=3), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_generation_tokens"] >= 6 and stats["num_prompt_tokens"] > 0
    assert stats["num_running_reqs"] == 0 and stats["kv_cache_usage"] == 0.0


def test_chat_template_for_a_model_without_one(tmp_path) -> None:
    """The tiny model's tokenizer has no chat template, like a base model: `LLM.chat` names
    `chat_template=`, and with one it renders the conversation with it."""
    from tests.model.tiny import make_tiny_llama_dir

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(make_tiny_llama_dir(str(tmp_path / "tiny")), dtype="float32") as tiny:
        conversation = [{"role": "user", "content": "hi"}]
        with pytest.raises(ValueError, match="chat_template= for LLM.chat"):
            tiny.chat(conversation, params, use_tqdm=False)
        template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        (out,) = tiny.chat(conversation, params, use_tqdm=False, chat_template=template)
        (plain,) = tiny.generate("<user>hi", params, use_tqdm=False)
    assert out.prompt_token_ids == plain.prompt_token_ids
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
