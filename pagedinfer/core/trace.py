"""A step-by-step record of what the scheduler and the KV cache did, and its HTML picture.

`LLM(..., trace_path="run.jsonl")` makes the engine core write one JSON line per batch
(per step without pipeline parallelism):

    {"step": 3, "time": 0.41, "kv_usage": 0.12,
     "scheduled": [{"req": "0", "start": 32, "tokens": 16, "prompt_len": 300,
                    "known": 300, "cached": 0, "new_blocks": [7]} ...],
     "preempted": ["5"], "finished": ["2"],
     "stored_blocks": [7], "evicted_blocks": [3], "freed_blocks": [4, 5]}

(`start`: tokens already computed before this step; `known`: prompt + generated tokens at
that time; `cached`: the prefix-cache hit, on the
request's first schedule and after each resumption; `grammar`, for a guided request only:
its structured-output backend; blocks: physical block ids), after a
header line `{"trace": "pagedinfer", "version": 1, "block_size": .., "num_blocks": ..}`.

`pagedinfer trace run.jsonl -o trace.html` renders it (`render_html`) as a self-contained
timeline: one row per request, one column per step, each cell the tokens the request
computed in that step (prefill chunk, decode, or resumed recompute), with prefix hits,
preemptions and finishes marked, and per-step block counts underneath -- the pictures the
seed document describes in words.
"""

from __future__ import annotations

import html
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from typing_extensions import NotRequired, TypedDict

__all__ = ["ScheduledChunk", "StepRecord", "StepTracer", "TraceHeader", "load_trace", "render_html"]

TRACE_VERSION = 1


class TraceHeader(TypedDict):
    """The first line of a trace file."""

    trace: str
    version: int
    block_size: int
    num_blocks: int


class ScheduledChunk(TypedDict):
    """One request's tokens in one step (see the module docstring for the fields)."""

    req: str
    start: int
    tokens: int
    prompt_len: int
    known: int
    cached: int
    new_blocks: list[int]
    grammar: NotRequired[str]
    """A guided request's structured-output backend ("xgrammar" or "guidance")."""


class StepRecord(TypedDict):
    """One line per engine step, after the header."""

    step: int
    time: float
    kv_usage: float
    scheduled: list[ScheduledChunk]
    preempted: list[str]
    finished: list[str]
    stored_blocks: list[int]
    evicted_blocks: list[int]
    freed_blocks: list[int]


@dataclass
class _Step:
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    stored_blocks: list[int] = field(default_factory=list)
    evicted_blocks: list[int] = field(default_factory=list)
    freed_blocks: list[int] = field(default_factory=list)


class StepTracer:
    """Collects one record per batch and appends it to a JSON-lines file.

    The scheduler and block pool report into the current record (`note_*`). The engine
    core calls `batch_launched()` when it launches a batch: the notes since the previous
    launch (its scheduling) become that batch's. Once the batch is back, it calls
    `batch_finishing()` before handing the output to the scheduler (the blocks freed then
    are the batch's too) and `end_step(finished, kv_usage)` to write the record. Batches
    finish in launch order, so under pipeline parallelism, with several in flight, each
    record still holds exactly its own batch's notes.
    """

    def __init__(self, path: str, block_size: int, num_blocks: int) -> None:
        self.path = path
        self._file: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._start = time.monotonic()
        self._step_index = 0
        self._open = _Step()
        """Notes of the batch being scheduled (and of schedules that launched nothing)."""
        self._launched: deque[_Step] = deque()
        """Notes of the batches in flight, oldest first."""
        self._step = self._open
        """Where notes go now."""
        self._write(
            {
                "trace": "pagedinfer",
                "version": TRACE_VERSION,
                "block_size": block_size,
                "num_blocks": num_blocks,
            }
        )

    def _write(self, record: TraceHeader | StepRecord) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def batch_launched(self) -> None:
        """The notes since the previous launch belong to the batch just launched."""
        self._launched.append(self._open)
        self._open = self._step = _Step()

    def batch_finishing(self) -> None:
        """Notes go to the oldest batch in flight until its `end_step`."""
        self._step = self._launched[0]

    def note_scheduled(
        self,
        req_id: str,
        start: int,
        num_tokens: int,
        prompt_len: int,
        known: int,
        cached: int,
        new_blocks: list[int],
        grammar: str | None = None,
    ) -> None:
        chunk: ScheduledChunk = {
            "req": req_id,
            "start": start,
            "tokens": num_tokens,
            "prompt_len": prompt_len,
            "known": known,
            "cached": cached,
            "new_blocks": new_blocks,
        }
        if grammar is not None:
            chunk["grammar"] = grammar
        self._step.scheduled.append(chunk)

    def note_preempted(self, req_id: str) -> None:
        self._step.preempted.append(req_id)

    def note_block_stored(self, block_id: int) -> None:
        self._step.stored_blocks.append(block_id)

    def note_block_evicted(self, block_id: int) -> None:
        self._step.evicted_blocks.append(block_id)

    def note_block_freed(self, block_id: int) -> None:
        self._step.freed_blocks.append(block_id)

    def end_step(self, finished: list[str], kv_usage: float) -> None:
        """Write the oldest launched batch's record (`finished`: the requests it ended)."""
        step = self._launched.popleft()
        self._write(
            {
                "step": self._step_index,
                "time": round(time.monotonic() - self._start, 6),
                "kv_usage": round(kv_usage, 6),
                "scheduled": step.scheduled,
                "preempted": step.preempted,
                "finished": finished,
                "stored_blocks": step.stored_blocks,
                "evicted_blocks": step.evicted_blocks,
                "freed_blocks": step.freed_blocks,
            }
        )
        self._file.flush()
        self._step_index += 1
        self._step = self._open

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def load_trace(path: str) -> tuple[TraceHeader, list[StepRecord]]:
    """(header, steps) of a trace file; ValueError if it is not one."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("trace") != "pagedinfer":
        raise ValueError(f"{path} is not a pagedinfer trace")
    if lines[0].get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: unsupported trace version {lines[0].get('version')}")
    # Trusted to hold the records StepTracer writes once the header matches.
    header: TraceHeader = lines[0]
    steps: list[StepRecord] = lines[1:]
    return header, steps


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 2px 4px; text-align: center; min-width: 2.2em; }
th.req { text-align: left; position: sticky; left: 0; background: #fafafa; }
td.prefill { background: #9ecae1; }
td.chunk { background: #c6dbef; }
td.decode { background: #a1d99b; }
td.recompute { background: #fdae6b; }
td.preempted { background: #de2d26; color: white; font-weight: bold; }
td.hit { box-shadow: inset 4px 0 0 #6a51a3; }
td.done { border-right: 3px solid #222; }
tr.summary td { background: #f0f0f0; color: #555; }
.legend span { display: inline-block; padding: 2px 8px; margin-right: 6px; }
"""


def render_html(header: TraceHeader, steps: list[StepRecord], title: str = "") -> str:
    """A self-contained HTML timeline of a trace (no scripts, no external files)."""
    order: list[str] = []
    cells: dict[tuple[str, int], tuple[str, str, str]] = {}  # (req, step) -> class, text, tip
    preempted_before: set[str] = set()
    for s in steps:
        i = s["step"]
        for e in s["scheduled"]:
            req = e["req"]
            if req not in order:
                order.append(req)
            start, end = e["start"], e["start"] + e["tokens"]
            if req in preempted_before and start < e["known"] - 1:
                kind = "recompute"
            elif start >= e["prompt_len"]:
                kind = "decode"
            elif end < e["prompt_len"] or start > e["cached"]:
                kind = "chunk"
            else:
                kind = "prefill"
            classes = kind
            tip = f"tokens {e['start']}..{end - 1}"
            if e["cached"] and e["start"] == e["cached"]:
                classes += " hit"
                tip += f"; prefix-cache hit: {e['cached']} tokens"
            if e["new_blocks"]:
                tip += f"; new blocks {e['new_blocks']}"
            text = str(e["tokens"])
            if "hit" in classes:
                text = f"{e['cached']}+{e['tokens']}"
            cells[(req, i)] = (classes, text, tip)
        for req in s["preempted"]:
            if req not in order:
                order.append(req)
            cells[(req, i)] = ("preempted", "P", "preempted: blocks freed, will recompute")
            preempted_before.add(req)
        for req in s["finished"]:
            cls, text, tip = cells.get((req, i), ("", "", ""))
            cells[(req, i)] = (cls + " done", text, tip + "; finished")

    out = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title or 'pagedinfer trace')}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title or 'pagedinfer engine trace')}</h1>",
        f"<p>{len(steps)} steps, {len(order)} requests, block size {header['block_size']}, "
        f"{header['num_blocks']} KV blocks. Each cell: tokens computed for the request in "
        "that step (hover for positions and blocks).</p>",
        "<p class='legend'><span class='prefill' style='background:#9ecae1'>prefill</span>"
        "<span style='background:#c6dbef'>prefill chunk</span>"
        "<span style='background:#a1d99b'>decode</span>"
        "<span style='background:#fdae6b'>recompute after preemption</span>"
        "<span style='background:#de2d26;color:white'>P preempted</span>"
        "<span style='box-shadow: inset 4px 0 0 #6a51a3'>hit+new: prefix-cache hit</span>"
        "<span style='border-right:3px solid #222'>finished</span></p>",
        "<table><thead><tr><th class='req'>request \\ step</th>",
    ]
    out += [f"<th>{s['step']}</th>" for s in steps]
    out.append("</tr></thead><tbody>")
    for req in order:
        row = [f"<tr data-req='{html.escape(req)}'><th class='req'>{html.escape(req)}</th>"]
        for s in steps:
            cls, text, tip = cells.get((req, s["step"]), ("", "", ""))
            row.append(
                f"<td class='{cls.strip()}' title='{html.escape(tip)}'>{html.escape(text)}</td>"
                if cls
                else "<td></td>"
            )
        row.append("</tr>")
        out.append("".join(row))
    summaries: tuple[tuple[str, Callable[[StepRecord], str]], ...] = (
        ("tokens", lambda s: str(sum(e["tokens"] for e in s["scheduled"]))),
        ("blocks stored", lambda s: str(len(s["stored_blocks"]))),
        ("blocks freed", lambda s: str(len(s["freed_blocks"]))),
        ("blocks evicted", lambda s: str(len(s["evicted_blocks"]))),
        ("KV usage %", lambda s: f"{s['kv_usage'] * 100:.0f}"),
    )
    for label, summary in summaries:
        row = [f"<tr class='summary'><th class='req'>{label}</th>"]
        for s in steps:
            row.append(f"<td>{summary(s)}</td>")
        row.append("</tr>")
        out.append("".join(row))
    out.append("</tbody></table></body></html>")
    return "\n".join(out)
