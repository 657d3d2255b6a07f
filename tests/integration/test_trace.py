"""The engine trace of the seed's example, rendered to HTML by `pagedinfer trace`."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_trace_of_chunked_prefill_and_a_prefix_hit(tmp_path, prompts) -> None:
    from pagedinfer import LLM, SamplingParams
    from pagedinfer.entrypoints.cli import main

    trace = tmp_path / "run.jsonl"
    llm = LLM(trace_path=str(trace), max_num_batched_tokens=64, max_model_len=2048)
    long_prompt = prompts[8]  # > 300 tokens: several 64-token-budget chunks
    short = [prompts[0], prompts[1]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # Short requests decode while the long prompt is prefilled chunk by chunk...
    llm.generate([{"prompt_token_ids": p} for p in [*short, long_prompt]], params, use_tqdm=False)
    # ...then a request sharing the long prompt's prefix hits its cached blocks.
    hit_prompt = long_prompt[:200] + [42, 43, 44]
    (hit_out,) = llm.generate({"prompt_token_ids": hit_prompt}, params, use_tqdm=False)
    assert hit_out.num_cached_tokens == 192

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    header, steps = lines[0], lines[1:]
    assert header["trace"] == "pagedinfer" and header["block_size"] == 16
    long_id, hit_id = "2", "3"  # LLM numbers its requests in order (warm-up: none)
    long_chunks = [e for s in steps for e in s["scheduled"] if e["req"] == long_id]
    prefill = [e for e in long_chunks if e["start"] < len(long_prompt)]
    assert len(prefill) >= 5
    assert sum(e["tokens"] for e in prefill) == len(long_prompt)
    assert all(s["scheduled"] and sum(e["tokens"] for e in s["scheduled"]) <= 64 for s in steps)
    # While the long prompt was being chunked, the short requests were decoding.
    mixed = [
        s
        for s in steps
        if any(e["req"] == long_id and e["start"] < len(long_prompt) for e in s["scheduled"])
        and any(e["req"] == "0" and e["start"] >= len(short[0]) for e in s["scheduled"])
    ]
    assert mixed, "no step mixed decodes with a prefill chunk"
    (first_hit,) = [e for s in steps for e in s["scheduled"] if e["req"] == hit_id][:1]
    assert first_hit["cached"] == 192 and first_hit["start"] == 192
    assert sum(len(s["stored_blocks"]) for s in steps) >= len(long_prompt) // 16
    assert any(s["freed_blocks"] for s in steps)

    html_path = tmp_path / "trace.html"
    assert main(["trace", str(trace), "-o", str(html_path)]) == 0
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    for req in ("0", "1", long_id, hit_id):
        assert f"<tr data-req='{req}'>" in page
    assert page.count("class='chunk'") + page.count("class='chunk done'") >= 4
    assert ">192+11<" in page  # the hit cell: 192 cached + 11 computed
    assert "class='decode" in page
    assert f"{len(steps)} steps, 4 requests" in page
