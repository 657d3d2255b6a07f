"""Shared plumbing for the peer benchmark scripts (stdlib only; every peer venv imports it).

Each script measures the same four things on the same token ids (see benchmarks/workload.py):
  offline_output_tok_s  sum of requested output lengths / wall time (ignore_eos: every request
                        generates exactly its output_len)
  prefill_512_tok_s     512 / time of (512-token prompt -> 1 output token), best of N after
                        a warm-up
  decode_b1_tok_s       (D - 1) / (time(D tokens) - time(1 token)) on the short decode prompt,
                        each time best of N after a warm-up: the decode phase alone
  peak_rss_mb           resource.getrusage maxrss of this process (+ children, reported apart)
and prints one JSON line to stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from workload import load as load_workload  # noqa: E402,F401  (re-exported)

DEFAULT_WORK = os.environ.get("PEERS_WORK", "/opt/peers/work")
DEFAULT_WORKLOAD = os.path.join(DEFAULT_WORK, "workload.json")


_RESULT_FD: int | None = None


def reserve_stdout() -> None:
    """Keep stdout for the result line only: point fd 1 (this process, its C libraries and any
    child processes, e.g. vLLM's engine core, which logs to stdout) at stderr from now on."""
    global _RESULT_FD
    if _RESULT_FD is None:
        sys.stdout.flush()
        _RESULT_FD = os.dup(1)
        os.dup2(2, 1)


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def base_parser(description: str, num_requests: int | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--workload", default=DEFAULT_WORKLOAD, help="file from benchmarks/workload.py"
    )
    parser.add_argument(
        "--num-requests", type=int, default=num_requests, help="first N requests (default: all)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for prefill/decode")
    parser.add_argument(
        "--long-context",
        default=None,
        metavar="CONTEXTS:PREFILL",
        help="instead of the workload runs: decode at each context length and one long "
        "prefill, e.g. 4096,16384:8192 (long_context())",
    )
    return parser


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Run fn once to warm up, then `repeats` times; the fastest wall time in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def prefill_and_decode(
    generate: Callable[[list[int], int], object], workload: dict, decode_tokens: int, repeats: int
) -> dict:
    """`generate(prompt_ids, n)` must produce exactly n tokens, greedy, from a cold cache."""
    prefill_ids = workload["prefill_prompt_token_ids"]
    decode_ids = workload["decode_prompt_token_ids"]
    t_prefill = best_time(lambda: generate(prefill_ids, 1), repeats)
    t_first = best_time(lambda: generate(decode_ids, 1), repeats)
    t_all = best_time(lambda: generate(decode_ids, decode_tokens), repeats)
    return {
        "prefill_512_tok_s": round(len(prefill_ids) / t_prefill, 1),
        "decode_b1_tok_s": round((decode_tokens - 1) / (t_all - t_first), 1),
        "decode_b1_tokens": decode_tokens,
        "decode_b1_e2e_s": round(t_all, 3),
    }


def long_text_prompt(workload: dict, length: int) -> list[int]:
    """`length` tokens of real text: the workload's prompts end to end (repeated if short)."""
    ids: list[int] = []
    while len(ids) < length:
        for req in workload["requests"]:
            ids += req["prompt_token_ids"]
            if len(ids) >= length:
                break
    return ids[:length]


def parse_long_context(spec: str) -> tuple[list[int], int]:
    """'4096,16384:8192' -> ([4096, 16384], 8192)."""
    contexts, _, prefill = spec.partition(":")
    return [int(c) for c in contexts.split(",") if c], int(prefill or 0)


def long_context(
    timed: Callable[[list[int], int], tuple[float, float]],
    workload: dict,
    spec: str,
    decode_tokens: int,
) -> dict:
    """Decode at long contexts and a long prefill, each from a cold cache, timed once (a
    16k-token prefill of a 1B model takes minutes here: best-of-N would take many).
    `timed(prompt, n)` generates n tokens greedily and returns (seconds to the first token,
    seconds to the last). Decode at context C: a C-token prompt, 1 + decode_tokens tokens:
    decode_tokens / (last - first). Prefill P: a P-token prompt, 1 token: P / seconds."""
    contexts, prefill = parse_long_context(spec)
    timed(long_text_prompt(workload, 64), 2)  # warm-up
    out: dict = {"long_context_decode_tokens": decode_tokens}
    for ctx in contexts:
        first, last = timed(long_text_prompt(workload, ctx), 1 + decode_tokens)
        out[f"decode_ctx{ctx}_tok_s"] = round(decode_tokens / (last - first), 2)
        out[f"ttft_ctx{ctx}_s"] = round(first, 2)
        rate = out[f"decode_ctx{ctx}_tok_s"]
        log(f"context {ctx}: first token {first:.1f} s, decode {rate} tok/s")
    if prefill:
        first, _ = timed(long_text_prompt(workload, prefill), 1)
        out[f"prefill_{prefill}_tok_s"] = round(prefill / first, 1)
        log(f"prefill {prefill}: {first:.1f} s")
    return out


def _descendants_hwm_mb() -> float:
    """Peak RSS (VmHWM) summed over live descendant processes (vLLM's engine core)."""
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            if pid != os.getpid():
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            total += int(line.split()[1]) / 1024
        except (OSError, ValueError):
            pass
    return total


def emit(result: dict) -> None:
    """Add memory figures and print the single JSON result line to stdout, with the fields of
    $BENCH_TAGS (a JSON object: benchmarks/run_all.sh names the model, round and pair)."""
    result.update(json.loads(os.environ.get("BENCH_TAGS") or "{}"))
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    children = max(
        _descendants_hwm_mb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    )
    if children:
        result["peak_rss_children_mb"] = round(children, 1)
    line = json.dumps(result) + "\n"
    if _RESULT_FD is None:
        sys.stdout.write(line)
        sys.stdout.flush()
    else:
        os.write(_RESULT_FD, line.encode())
