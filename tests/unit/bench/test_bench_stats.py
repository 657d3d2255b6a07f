"""`pagedinfer bench`: metric math, arrival times, dataset sampling rules, option parsing, and
the streaming client against a scripted local SSE server (no model needed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import numpy as np
import pytest

from pagedinfer.bench.datasets import (
    MAX_PROMPT_LEN,
    MAX_TOTAL_LEN,
    is_valid_pair,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)
from pagedinfer.bench.stats import (
    RequestRecord,
    aggregate,
    arrival_offsets,
    latency_summary,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    percentile_label,
)

# ------------------------------------------------------------------------------ records / tpot


def _ok(ttft: float, e2el: float, tokens: int, itl=(), prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(
        success=True,
        prompt_len=prompt_len,
        output_tokens=tokens,
        ttft=ttft,
        itl=list(itl),
        e2el=e2el,
    )


def test_tpot_excludes_first_token_and_needs_two_tokens() -> None:
    assert _ok(0.2, 1.0, 5).tpot == pytest.approx(0.2)  # (1.0 - 0.2) / 4
    assert _ok(0.2, 1.0, 2).tpot == pytest.approx(0.8)
    assert _ok(0.2, 0.2, 1).tpot is None
    assert _ok(0.2, 0.2, 0).tpot is None


def test_aggregate_counts_tokens_and_throughput_of_successes_only() -> None:
    records = [
        _ok(0.1, 1.0, 10, itl=[0.1] * 9, prompt_len=100),
        _ok(0.3, 2.0, 5, itl=[0.2, 0.5, 0.5, 0.5], prompt_len=50),
        RequestRecord(success=False, prompt_len=999, output_tokens=0, ttft=50.0, error="HTTP 500"),
    ]
    m = aggregate(records, duration=4.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 150  # the failed request's 999 tokens are not counted
    assert m.total_output_tokens == 15
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(15 / 4)
    assert m.total_token_throughput == pytest.approx(165 / 4)
    assert m.request_goodput is None
    # Latencies in ms, over successful requests only (the failed one's 50 s TTFT is ignored).
    assert m.latency["ttft"]["mean"] == pytest.approx(200.0)
    assert m.latency["ttft"]["median"] == pytest.approx(200.0)
    assert m.latency["ttft"]["p99"] == pytest.approx(298.0)  # linear: 100 + 0.99 * 200
    assert m.latency["e2el"]["mean"] == pytest.approx(1500.0)
    # TPOT: one value per request; ITL: every gap of every request, pooled.
    assert m.latency["tpot"]["mean"] == pytest.approx((0.1 + 0.425) / 2 * 1000)
    assert m.latency["itl"]["mean"] == pytest.approx((0.9 + 1.7) / 13 * 1000)
    assert m.latency["itl"]["median"] == pytest.approx(100.0)
    assert m.latency["itl"]["std"] > 0


def test_aggregate_percentiles_and_flat_keys() -> None:
    records = [_ok(t, t + 1, 3) for t in (0.1, 0.2, 0.3, 0.4)]
    m = aggregate(records, 1.0, percentiles=[50, 90, 99.9], metrics=["ttft", "e2el"])
    assert set(m.latency) == {"ttft", "e2el"}
    assert m.latency["ttft"]["p50"] == pytest.approx(250.0)
    assert m.latency["ttft"]["p90"] == pytest.approx(370.0)
    assert m.latency["ttft"]["p99.9"] == pytest.approx(399.7)
    flat = m.to_dict()
    assert flat["completed"] == 4 and flat["duration"] == 1.0
    assert flat["mean_ttft_ms"] == pytest.approx(250.0)
    assert flat["p99.9_e2el_ms"] == pytest.approx(1399.7)
    assert "mean_itl_ms" not in flat and "latency" not in flat
    json.dumps(flat)  # serializable


def test_aggregate_with_no_success_reports_zeros() -> None:
    m = aggregate([RequestRecord(error="boom")] * 3, 2.0, slos={"ttft": 1.0})
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 3, 0)
    assert m.request_throughput == 0.0 and m.request_goodput == 0.0
    assert m.latency["ttft"] == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_aggregate_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="duration"):
        aggregate([], 0.0)
    with pytest.raises(ValueError, match="unknown metric"):
        aggregate([_ok(0.1, 0.2, 2)], 1.0, metrics=["ttft", "latency"])


# ------------------------------------------------------------------------------------ goodput


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        _ok(0.1, 1.0, 10),  # ttft 100 ms, tpot 100 ms, e2el 1000 ms: meets all
        _ok(0.6, 1.0, 10),  # ttft too slow
        _ok(0.1, 3.0, 10),  # tpot 322 ms and e2el too slow
        _ok(0.1, 0.1, 1),  # single token: no TPOT, passes the TPOT SLO
        RequestRecord(success=False, error="x"),  # failed: never counts
    ]
    slos = parse_goodput(["ttft:500 tpot:150", "e2el:2000"])
    assert slos == {"ttft": 500.0, "tpot": 150.0, "e2el": 2000.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    m = aggregate(records, duration=2.0, slos=slos)
    assert m.request_goodput == pytest.approx(1.0)  # 2 good requests / 2 s
    # A generous SLO makes goodput equal the request throughput.
    m = aggregate(records, duration=2.0, slos={"ttft": 1e9})
    assert m.request_goodput == pytest.approx(m.request_throughput)


def test_goodput_slo_boundary_is_inclusive() -> None:
    assert meets_slos(_ok(0.5, 0.5, 1), {"ttft": 500.0})
    assert not meets_slos(_ok(0.5001, 0.6, 1), {"ttft": 500.0})


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "latency:100", "ttft:-1", "ttft:abc", "tpot=5"])
def test_parse_goodput_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_parse_percentiles_and_labels() -> None:
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_percentiles("0,100") == [0.0, 100.0]
    for bad in ("101", "-1", "", "x", "nan"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    assert percentile_label(99) == "p99"
    assert percentile_label(99.0) == "p99"
    assert percentile_label(99.9) == "p99.9"
    assert percentile_label(50.25) == "p50.25"


def test_latency_summary() -> None:
    s = latency_summary([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["avg_latency"] == pytest.approx(3.0)
    assert s["latencies"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert list(s["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert s["percentiles"]["50"] == pytest.approx(3.0)
    assert s["percentiles"]["10"] == pytest.approx(1.4)
    assert s["percentiles"]["99"] == pytest.approx(4.96)
    with pytest.raises(ValueError):
        latency_summary([])


# ------------------------------------------------------------------------------ arrival times


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


def _gaps(n: int, rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    offsets = arrival_offsets(n, rate, burstiness, seed)
    assert offsets[0] == 0.0
    gaps = np.diff(offsets)
    assert (gaps >= 0).all()
    return gaps


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_and_burstiness_sets_the_variance(burstiness: float) -> None:
    gaps = _gaps(40_001, rate=8.0, burstiness=burstiness)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.04)
    # Gamma(shape=k, mean=m): variance m^2 / k, i.e. squared coefficient of variation 1 / k.
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_burstier_traffic_has_larger_gap_variance() -> None:
    bursty = _gaps(20_001, 5.0, 0.3).var()
    poisson = _gaps(20_001, 5.0, 1.0).var()
    regular = _gaps(20_001, 5.0, 3.0).var()
    assert bursty > 2 * poisson > 4 * regular


def test_arrivals_are_deterministic_per_seed() -> None:
    assert arrival_offsets(50, 2.0, 1.0, seed=7) == arrival_offsets(50, 2.0, 1.0, seed=7)
    assert arrival_offsets(50, 2.0, 1.0, seed=7) != arrival_offsets(50, 2.0, 1.0, seed=8)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0)])
def test_arrivals_reject_bad_rates(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


# ------------------------------------------------------------------------------------ datasets


class FakeTokenizer:
    """Whitespace "tokenizer" with a small vocabulary; ids 0-2 are special."""

    all_special_ids = {0, 1, 2}
    vocab_size = 50

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + (hash(w) % 47) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


def _words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_sharegpt_length_rules() -> None:
    assert is_valid_pair(4, 4)
    assert not is_valid_pair(3, 100)  # prompt too short
    assert not is_valid_pair(100, 3)  # output too short
    assert is_valid_pair(100, 3, fixed_output_len=True)  # a fixed output length skips that check
    assert not is_valid_pair(3, 100, fixed_output_len=True)
    assert is_valid_pair(MAX_PROMPT_LEN, MAX_TOTAL_LEN - MAX_PROMPT_LEN)
    assert not is_valid_pair(MAX_PROMPT_LEN + 1, 10)  # prompt over 1,024
    assert not is_valid_pair(MAX_PROMPT_LEN, MAX_TOTAL_LEN - MAX_PROMPT_LEN + 1)  # total > 2,048


@pytest.fixture
def sharegpt_file(tmp_path):
    rows = []
    for i in range(30):
        # Row i: prompt of 5 + i words, reply of 6 + i words; every third row is unusable.
        conv = [
            {"from": "human", "value": f"p{i} " + _words(4 + i)},
            {"from": "gpt", "value": _words(6 + i, "r")},
        ]
        if i % 3 == 1:
            conv[0]["value"] = "too short"  # 2 tokens
        if i % 3 == 2:
            conv = conv[:1]  # a single turn
        rows.append({"id": f"c{i}", "conversations": conv})
    rows.append({"id": "short-reply", "conversations": [
        {"from": "human", "value": "short reply " + _words(5)},
        {"from": "gpt", "value": "ok"},
    ]})  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_sharegpt_sampling_filters_and_is_deterministic(sharegpt_file) -> None:
    tok = FakeTokenizer()
    a = sample_sharegpt(tok, 6, sharegpt_file, seed=3)
    assert len(a) == 6
    for s in a:
        i = int(s.prompt.split()[0][1:])
        assert i % 3 == 0  # only usable rows
        assert s.prompt_len == 5 + i
        assert s.expected_output_len == 6 + i  # turn 1's token count
    assert a == sample_sharegpt(tok, 6, sharegpt_file, seed=3)
    b = sample_sharegpt(tok, 6, sharegpt_file, seed=4)
    assert [s.prompt for s in a] != [s.prompt for s in b]
    # A fixed output length replaces turn 1's and lets the 1-token reply row in.
    fixed = sample_sharegpt(tok, 11, sharegpt_file, seed=3, output_len=2)
    assert {s.expected_output_len for s in fixed} == {2}
    assert any(s.prompt.startswith("short reply") for s in fixed)


def test_sharegpt_repeats_rows_when_too_few_are_valid(sharegpt_file, capsys) -> None:
    out = sample_sharegpt(FakeTokenizer(), 25, sharegpt_file, seed=0)
    assert len(out) == 25
    assert len({s.prompt for s in out}) == 10  # the 10 usable rows, some repeated
    assert "only 10 usable" in capsys.readouterr().err


def test_random_dataset_lengths_tokens_and_prefix() -> None:
    tok = FakeTokenizer()
    out = sample_random(tok, 200, input_len=20, output_len=10, range_ratio=0.5, prefix_len=7)
    assert len(out) == 200
    prefix = out[0].prompt[:7]
    for s in out:
        assert isinstance(s.prompt, list) and s.prompt_len == len(s.prompt)
        assert s.prompt[:7] == prefix
        assert 7 + 10 <= s.prompt_len <= 7 + 30
        assert 5 <= s.expected_output_len <= 15
        assert not set(s.prompt) & tok.all_special_ids
        assert all(0 <= t < tok.vocab_size for t in s.prompt)
    assert len({s.prompt_len for s in out}) > 5  # lengths really vary
    exact = sample_random(tok, 20, input_len=16, output_len=4)
    assert {s.prompt_len for s in exact} == {16} and {s.expected_output_len for s in exact} == {4}
    assert exact == sample_random(tok, 20, input_len=16, output_len=4)
    assert exact != sample_random(tok, 20, input_len=16, output_len=4, seed=1)
    with pytest.raises(ValueError):
        sample_random(tok, 4, range_ratio=1.0)
    # The model's vocabulary, when smaller than the tokenizer's, bounds the ids.
    small = sample_random(tok, 30, input_len=10, output_len=2, vocab_size=6)
    assert {t for s in small for t in s.prompt} == {3, 4, 5}


def test_prefix_repetition_dataset() -> None:
    tok = FakeTokenizer()
    out = sample_prefix_repetition(
        tok, 12, prefix_len=8, suffix_len=5, num_prefixes=3, output_len=6, seed=1
    )
    assert len(out) == 12
    assert {s.prompt_len for s in out} == {13} and {s.expected_output_len for s in out} == {6}
    prefixes = [tuple(s.prompt[:8]) for s in out]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    first_prefix_positions = [i for i, p in enumerate(prefixes) if p == prefixes[0]]
    assert first_prefix_positions != [0, 3, 6, 9]  # shuffled (for this seed)
    assert len({tuple(s.prompt[8:]) for s in out}) == 12  # every suffix its own


# --------------------------------------------------------------------------- parser wiring


def test_bench_parser_options() -> None:
    from pagedinfer.entrypoints.cli import build_parser

    parser = build_parser()
    ns = parser.parse_args(
        ["bench", "serve", "--dataset-name", "random", "--goodput", "ttft:5", "tpot:1"]
    )
    assert ns.command == "bench" and ns.bench_command == "serve"
    assert ns.goodput == ["ttft:5", "tpot:1"] and math.isinf(ns.request_rate)
    assert ns.num_prompts == 1000 and ns.seed == 0 and ns.percentile_metrics == "ttft,tpot,itl"
    ns = parser.parse_args(["bench", "throughput", "m.gguf", "--seed", "3", "--dtype", "float32"])
    assert (ns.model, ns.seed, ns.dtype, ns.dataset_name) == ("m.gguf", 3, "float32", "sharegpt")
    ns = parser.parse_args(["bench", "latency"])
    assert (ns.input_len, ns.output_len, ns.batch_size) == (32, 128, 8)
    assert (ns.num_iters_warmup, ns.num_iters, ns.model) == (10, 30, None)


def test_serve_rejects_bad_options_before_sending(capsys) -> None:
    from pagedinfer.bench.serve import run_serve
    from pagedinfer.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "serve", "--percentile-metrics", "ttft,foo"])
    assert run_serve(ns) == 2
    assert "percentile-metrics" in capsys.readouterr().err


def test_report_lists_requested_metrics_and_goodput() -> None:
    from pagedinfer.bench.serve import format_report

    m = aggregate([_ok(0.1, 1.0, 10, itl=[0.1] * 9)], 2.0, [50, 99], ["ttft", "e2el"], {"ttft": 1})
    text = format_report(m, request_rate=math.inf, max_concurrency=4, percentiles=[50, 99])
    assert "Request goodput (req/s):" in text
    assert "P50 TTFT (ms):" in text and "P99 E2EL (ms):" in text and "Mean E2EL (ms):" in text
    assert "ITL" not in text
    m = aggregate([_ok(0.1, 1.0, 10)], 2.0)
    assert "goodput" not in format_report(m, request_rate=2, max_concurrency=None, percentiles=[99])


# ------------------------------------------------------------------- streaming client (SSE)


def _chunk(text: str | None = None, usage: dict | None = None) -> bytes:
    body: dict = {"object": "text_completion", "choices": []}
    if text is not None:
        body["choices"] = [{"index": 0, "text": text, "finish_reason": None}]
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


async def _scripted_server_records() -> dict[str, object]:
    from aiohttp import ClientSession, web

    from pagedinfer.bench.serve_client import stream_request

    async def stream(request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        if mode == "missing":
            body = {"error": {"message": "The model 'x' does not exist", "code": 404}}
            return web.json_response(body, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("Hel"))
        await asyncio.sleep(0.05)
        await resp.write(_chunk(""))  # no text: not a token boundary
        await asyncio.sleep(0.05)
        if mode == "error":
            await resp.write(b'data: {"error": {"message": "engine died", "code": 503}}\n\n')
            return resp
        if mode == "truncated":
            return resp
        # A chunk split across writes must still parse.
        second = _chunk("lo")
        await resp.write(second[:10])
        await resp.write(second[10:])
        await asyncio.sleep(0.02)
        await resp.write(_chunk(" world"))
        if mode == "usage":
            await resp.write(_chunk(usage={"prompt_tokens": 11, "completion_tokens": 7}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/{mode}", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    out: dict[str, object] = {}
    try:
        async with ClientSession() as session:
            for mode in ("usage", "nousage", "missing", "error", "truncated"):
                url = f"http://127.0.0.1:{port}/{mode}"
                out[mode] = await stream_request(session, url, {}, {"prompt": "x"}, 5, False)
            out["refused"] = await stream_request(
                session, "http://127.0.0.1:9/none", {}, {"prompt": "x"}, 5, False
            )
    finally:
        await runner.cleanup()
    return out


def test_stream_request_measures_and_records_failures() -> None:
    records = asyncio.run(_scripted_server_records())
    rec = records["usage"]
    assert isinstance(rec, RequestRecord) and rec.success and rec.error == ""
    assert rec.output_tokens == 7 and rec.prompt_len == 11  # from the usage chunk
    assert 0 < rec.ttft < 0.05  # the first text chunk, before the first sleep
    assert len(rec.itl) == 2  # "lo" and " world"; the empty chunk is not a boundary
    assert rec.itl[0] >= 0.09  # two sleeps between "Hel" and "lo"
    assert rec.e2el >= rec.ttft + sum(rec.itl) - 1e-6
    assert rec.tpot == pytest.approx((rec.e2el - rec.ttft) / 6)
    rec = records["nousage"]
    assert rec.success and rec.output_tokens == 3 and rec.prompt_len == 5  # counted chunks
    for mode, needle in [
        ("missing", "HTTP 404: The model 'x' does not exist"),
        ("error", "engine died"),
        ("truncated", "before [DONE]"),
        ("refused", "Error"),
    ]:
        rec = records[mode]
        assert not rec.success and needle in rec.error, (mode, rec.error)


def test_chat_payload_and_chunk_text() -> None:
    from pagedinfer.bench.serve_client import _chunk_text, build_payload

    body = build_payload("m", "hi", 8, chat=True, ignore_eos=True)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["ignore_eos"] is True and "prompt" not in body
    body = build_payload("m", [1, 2, 3], 4, chat=False)
    assert body["prompt"] == [1, 2, 3] and "ignore_eos" not in body
    with pytest.raises(TypeError):
        build_payload("m", [1, 2], 4, chat=True)
    chat_chunk = {"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]}
    assert _chunk_text(chat_chunk, chat=True) == "Hi"
    assert _chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""


def test_namespace_defaults_match_dataset_sampler(sharegpt_file) -> None:
    from pagedinfer.bench.datasets import sample_from_args

    ns = argparse.Namespace(
        dataset_name="sharegpt",
        num_prompts=3,
        seed=3,
        dataset_path=sharegpt_file,
        sharegpt_output_len=None,
    )
    assert sample_from_args(ns, FakeTokenizer()) == sample_sharegpt(
        FakeTokenizer(), 3, sharegpt_file, seed=3
    )


def test_a_missing_dataset_names_the_option(tmp_path, monkeypatch, sharegpt_file) -> None:
    """No path and no default file: the library names its parameter, the CLI its flag; the
    default file is used where it exists, and a given path always wins."""
    from pagedinfer.bench.datasets import dataset_config, resolve_dataset_path, sample_from_args

    monkeypatch.setenv("PAGEDINFER_DATA_DIR", str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="pass `path`"):
        sample_sharegpt(FakeTokenizer(), 3)
    ns = argparse.Namespace(dataset_name="sharegpt", num_prompts=3, seed=0, dataset_path=None,
                            sharegpt_output_len=None)  # fmt: skip
    with pytest.raises(ValueError, match="pass --dataset-path"):
        sample_from_args(ns, FakeTokenizer())
    assert resolve_dataset_path(sharegpt_file, "--dataset-path") == sharegpt_file

    monkeypatch.setenv("PAGEDINFER_DATA_DIR", str(tmp_path))
    default = tmp_path / "sharegpt_v3_sample.json"
    default.write_text(open(sharegpt_file, encoding="utf-8").read(), encoding="utf-8")
    assert sample_from_args(ns, FakeTokenizer()) == sample_sharegpt(FakeTokenizer(), 3, seed=0)
    assert dataset_config(ns)["dataset_path"] == str(default)
