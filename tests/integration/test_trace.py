"""The engine trace of the seed's example, rendered to HTML by `pagedinfer trace`."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_trace_of_chunked_prefill_and_a_prefix_hit(tmp_path, prompts) -> None:
    from pagedinfer import LLM, SamplingParams
    from pagedinfer.entrypoints.cli import main

    trace = tmp_path / "run.jsonl"
    llm = LLM(trace_path=str(trace), max_num_batched_tokens=64, max_model_len=2048, block_size=16)
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


def _traced_run(
    model: str, tmp_path, pp: int
) -> tuple[list[dict], list[dict[str, int]], list[list[int]]]:
    """(step records, the scheduled tokens of each batch the engine launched, token ids)
    of a greedy run."""
    from pagedinfer import LLM, SamplingParams

    trace = tmp_path / f"pp{pp}.jsonl"
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(
        model,
        pipeline_parallel_size=pp,
        trace_path=str(trace),
        dtype="float32",
        kv_cache_memory_bytes=8 * 2**20,
        max_model_len=256,
        max_num_batched_tokens=64,
    ) as llm:
        executor = llm.llm_engine.engine_core.executor
        launch = "execute_model" if pp == 1 else "execute_model_async"
        batches: list[dict[str, int]] = []
        real = getattr(executor, launch)

        def recorded(scheduler_output, *args, **kwargs):
            if scheduler_output.total_num_scheduled_tokens > 0:
                batches.append(dict(scheduler_output.num_scheduled_tokens))
            return real(scheduler_output, *args, **kwargs)

        setattr(executor, launch, recorded)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["trace"] == "pagedinfer"
    return lines[1:], batches, [list(o.outputs[0].token_ids) for o in outs]


def test_trace_under_pipeline_parallelism_has_a_record_per_batch(tmp_path) -> None:
    from tests.model.tiny import make_tiny_llama_dir

    model = make_tiny_llama_dir(str(tmp_path / "tiny"))
    steps1, batches1, tokens1 = _traced_run(model, tmp_path, 1)
    steps2, batches2, tokens2 = _traced_run(model, tmp_path, 2)
    assert tokens2 == tokens1
    assert len(batches2) > 1
    # One record per batch, in launch order, each holding exactly that batch's chunks
    # (not the notes of the batches scheduled while it was in the pipeline).
    for steps, batches in ((steps1, batches1), (steps2, batches2)):
        assert [s["step"] for s in steps] == list(range(len(batches)))
        assert [{e["req"]: e["tokens"] for e in s["scheduled"]} for s in steps] == batches
    assert {frozenset(s) for s in steps2} == {frozenset(s) for s in steps1}
    assert all(e.keys() == steps1[0]["scheduled"][0].keys() for s in steps2 for e in s["scheduled"])

    def tokens_per_request(steps: list[dict]) -> dict[str, int]:
        total: dict[str, int] = {}
        for s in steps:
            for e in s["scheduled"]:
                total[e["req"]] = total.get(e["req"], 0) + e["tokens"]
        return total

    # The same work in both runs, each request's chunks and decodes recorded once.
    assert tokens_per_request(steps2) == tokens_per_request(steps1)
    assert sorted(r for s in steps2 for r in s["finished"]) == [str(i) for i in range(6)]
