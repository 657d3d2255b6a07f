"""The HTTP client of `pagedinfer bench serve`: the request bodies, one timed streamed request,
and the load generator that sends a run's requests at their arrival times.

`stream_request` sends one `stream: true` request and times it from its server-sent events
(TTFT, ITL, E2EL, output tokens; see `pagedinfer.bench.serve`); a failed request (HTTP error,
an SSE error event, a dropped connection, a malformed stream) comes back as a `RequestRecord`
with its error, never as an exception. `run_load` sends the warm-up requests, then every
request at its offset from the start, at most `max_concurrency` in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import urllib.request
from typing import Any

from pagedinfer.bench.stats import RequestRecord

__all__ = ["Job", "build_payload", "fetch_model", "is_chat", "run_load", "stream_request"]


# ------------------------------------------------------------------------------------ requests


def is_chat(endpoint: str) -> bool:
    """Whether the endpoint is the chat API (messages in, deltas out)."""
    return endpoint.rstrip("/").endswith("chat/completions")


def _error_text(status: int, body: str) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip()[:500]
    return f"HTTP {status}: {message}"


def fetch_model(base: str, headers: dict[str, str]) -> str:
    """The id of the first model the server lists (`GET /v1/models`)."""
    req = urllib.request.Request(base + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    data = body.get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model")
    return str(data[0]["id"])


def build_payload(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    chat: bool,
    temperature: float = 0.0,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """The JSON body of one streamed request (chat prompts must be text)."""
    body: dict[str, Any] = {"model": model}
    if chat:
        if not isinstance(prompt, str):
            raise TypeError("chat prompts must be text")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    text = ""
    for choice in obj.get("choices") or ():
        if chat:
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def stream_request(
    session: Any,
    url: str,
    headers: dict[str, str],
    payload: dict[str, Any],
    prompt_len: int,
    chat: bool,
) -> RequestRecord:
    """Send one streaming request and time it; never raises for request-level failures."""
    import aiohttp

    rec = RequestRecord(prompt_len=prompt_len)
    text_chunks = 0
    first_choice_at: float | None = None
    usage_tokens: int | None = None
    done = False
    start = last = time.perf_counter()
    rec.start_time = start

    def handle(line: bytes) -> bool:
        """Process one SSE line; True when the stream is over (done or failed)."""
        nonlocal text_chunks, first_choice_at, usage_tokens, done, last
        text = line.decode("utf-8").strip()
        if not text.startswith("data:"):
            return False  # blank separator, comment or other SSE field
        data = text[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            rec.e2el = now - start
            done = True
            return True
        obj = json.loads(data)
        if not isinstance(obj, dict):
            return False
        if obj.get("error"):
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return True
        if obj.get("choices") and first_choice_at is None:
            first_choice_at = now
        if _chunk_text(obj, chat):
            if text_chunks == 0:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
            text_chunks += 1
        usage = obj.get("usage")
        if usage:
            usage_tokens = usage.get("completion_tokens")
            if usage.get("prompt_tokens"):
                rec.prompt_len = int(usage["prompt_tokens"])
        return False

    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                rec.error = _error_text(resp.status, await resp.text())
                return rec
            buf = b""
            finished = False
            async for piece in resp.content.iter_any():
                buf += piece
                while not finished and b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    finished = handle(line)
                if finished:
                    break
            if not finished and buf:
                handle(buf)
    except (
        aiohttp.ClientError,
        asyncio.TimeoutError,
        OSError,
        ValueError,  # also JSON and UTF-8 decoding errors
        TypeError,
        AttributeError,
        KeyError,
    ) as exc:  # a malformed stream fails the request, not the run
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return rec
    if rec.error:
        return rec
    if not done:
        rec.error = "the stream ended before [DONE]"
        return rec
    if text_chunks == 0:  # nothing but empty text (e.g. an immediate EOS)
        rec.ttft = (first_choice_at or time.perf_counter()) - start
    rec.output_tokens = int(usage_tokens) if usage_tokens is not None else text_chunks
    rec.success = True
    return rec


# ------------------------------------------------------------------------------------ the load


@dataclasses.dataclass
class Job:
    """One request of the run: its body and the prompt length the dataset gave it."""

    payload: dict[str, Any]
    prompt_len: int


async def _send_one(
    session: Any, url: str, headers: dict[str, str], job: Job, chat: bool
) -> RequestRecord:
    return await stream_request(session, url, headers, job.payload, job.prompt_len, chat)


async def run_load(
    jobs: list[Job],
    warmup: list[Job],
    url: str,
    headers: dict[str, str],
    chat: bool,
    offsets: list[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> tuple[list[RequestRecord], float]:
    """Send `warmup` (unmeasured), then each job at its offset in seconds from the start;
    the records in `jobs` order and the run's duration."""
    import aiohttp
    from tqdm import tqdm

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(job: Job) -> RequestRecord:
            if sem is None:
                return await _send_one(session, url, headers, job, chat)
            async with sem:
                return await _send_one(session, url, headers, job, chat)

        if warmup:
            print(f"Warming up with {len(warmup)} request(s)...", file=sys.stderr)
            results = await asyncio.gather(*(send(j) for j in warmup))
            bad = [r.error for r in results if not r.success]
            if bad:
                print(f"warning: {len(bad)} warm-up request(s) failed: {bad[0]}", file=sys.stderr)

        bar = tqdm(total=len(jobs), desc="Requests", disable=disable_tqdm, dynamic_ncols=True)
        t0 = time.perf_counter()

        async def one(job: Job, offset: float) -> RequestRecord:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = await send(job)
            rec.start_time -= t0  # when it was really sent (after any concurrency wait)
            bar.update(1)
            return rec

        records = await asyncio.gather(*(one(j, o) for j, o in zip(jobs, offsets)))
        duration = time.perf_counter() - t0
        bar.close()
    return list(records), duration
