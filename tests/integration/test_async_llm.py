"""AsyncLLM on the real model, with the engine core in its own process (ZMQ + msgspec) and
in-process: same outputs as LLM.generate, streaming, n > 1, aborts that free blocks, and a
killed engine that fails requests fast instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytestmark = pytest.mark.integration

OPTIONS = {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 512}
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def expected() -> list[str]:
    from pagedinfer import LLM, SamplingParams

    llm = LLM(**OPTIONS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def engine(loop):
    from pagedinfer.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_options(**OPTIONS)
    yield engine
    engine.shutdown()


async def _final(engine, prompt, params, request_id):
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    assert last is not None and last.finished
    return last


def test_concurrent_greedy_equals_llm_generate(loop, engine, expected) -> None:
    from pagedinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24)

    async def run():
        return await asyncio.gather(
            *[_final(engine, p, params, f"greedy-{i}") for i, p in enumerate(PROMPTS)]
        )

    outs = loop.run_until_complete(run())
    assert [o.outputs[0].text for o in outs] == expected
    assert engine.engine_core.process.poll() is None  # a separate, live process


def test_delta_stream_adds_up_and_n2(loop, engine, expected) -> None:
    from pagedinfer import SamplingParams
    from pagedinfer.sampling_params import RequestOutputKind

    async def run():
        text, chunks = "", 0
        delta = SamplingParams(temperature=0.0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(PROMPTS[0], delta, "delta"):
            text += out.outputs[0].text
            chunks += 1
        both = await _final(
            engine, PROMPTS[1], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8), "n2"
        )
        return text, chunks, both

    text, chunks, both = loop.run_until_complete(run())
    assert text == expected[0] and chunks > 1
    assert [c.index for c in both.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 for c in both.outputs)


def test_consumer_going_away_aborts_and_frees_blocks(loop, engine) -> None:
    from pagedinfer import SamplingParams
    from pagedinfer.sampling_params import RequestOutputKind

    async def run():
        params = SamplingParams(
            temperature=0.0, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )

        async def consume_some(i):
            seen = 0
            async for _ in engine.generate(PROMPTS[i % 3], params, f"leave-{i}"):
                seen += 1
                if seen == 3:
                    break  # closes the generator: the request is aborted
            return seen

        counts = await asyncio.gather(*[consume_some(i) for i in range(4)])
        # A cancelled consumer (a client that disconnected) aborts too.
        task = asyncio.ensure_future(consume_some(9))
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)
        return counts, await engine.get_kv_cache_usage()

    counts, usage = loop.run_until_complete(run())
    assert counts == [3, 3, 3, 3]
    assert usage == 0.0
    assert not engine.output_processor.request_states


def test_bad_input_fails_alone(loop, engine, expected) -> None:
    from pagedinfer import SamplingParams

    async def run():
        with pytest.raises(ValueError, match="max_model_len|longer"):
            async for _ in engine.generate(
                {"prompt_token_ids": [1] * 600}, SamplingParams(max_tokens=4), "too-long"
            ):
                pass
        return await _final(
            engine, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24), "ok"
        )

    assert loop.run_until_complete(run()).outputs[0].text == expected[2]


def test_inproc_client_gives_the_same_outputs(expected) -> None:
    from pagedinfer import SamplingParams
    from pagedinfer.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_options(multiprocess=False, **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=24)

    async def run():
        return await asyncio.gather(
            *[_final(engine, p, params, f"inproc-{i}") for i, p in enumerate(PROMPTS)]
        )

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [o.outputs[0].text for o in outs] == expected


def test_killed_engine_fails_requests_fast() -> None:
    from pagedinfer import SamplingParams
    from pagedinfer.engine.async_llm import AsyncLLM, EngineDeadError

    engine = AsyncLLM.from_options(**OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run():
        gens = [engine.generate(PROMPTS[i], params, f"victim-{i}") for i in range(3)]
        for gen in gens:
            await gen.__anext__()  # all three are running
        os.kill(engine.engine_core.process.pid, signal.SIGKILL)
        start = time.monotonic()
        for gen in gens:
            with pytest.raises(EngineDeadError, match="died"):
                async for _ in gen:
                    pass
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("again", params, "after"):
                pass
        return elapsed

    try:
        assert asyncio.run(run()) < 5.0
        assert engine.errored
    finally:
        engine.shutdown()
