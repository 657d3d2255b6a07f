"""`pagedinfer bench serve`: load-test a running OpenAI-compatible server (`pagedinfer serve`).

Every request streams (`stream: true`, `stream_options.include_usage`) and the client measures,
per request: TTFT (send -> first chunk carrying text), ITL (gaps between later text chunks),
E2EL (send -> `[DONE]`), the output tokens (the usage chunk's `completion_tokens`; the number of
text chunks if the server sends no usage) and from them TPOT = (E2EL - TTFT) / (tokens - 1).
Requests arrive as a Poisson process (`--request-rate`, `--burstiness`), optionally capped by
`--max-concurrency`. A failed request (HTTP error, an SSE error event, a dropped connection) is
recorded with its error and counted in `failed`, never in the latency statistics.

Exit status: 0 when at least one request succeeded (partial failures are reported, not fatal);
1 when every request failed (the report and result file are still written); 2 when the run
could not start (bad options, server unreachable for the model lookup, unusable dataset).

This module is the command: its options, the run and the report (printed, and saved with
`--save-result`); the requests and the load generator are `pagedinfer.bench.serve_client`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import urllib.error
from datetime import datetime
from typing import Any

from pagedinfer import envs
from pagedinfer.bench.datasets import (
    SampleRequest,
    add_dataset_args,
    dataset_config,
    load_tokenizer,
    sample_from_args,
)
from pagedinfer.bench.serve_client import Job, build_payload, fetch_model, is_chat, run_load
from pagedinfer.bench.stats import (
    LATENCY_METRICS,
    RequestRecord,
    ServingMetrics,
    aggregate,
    arrival_offsets,
    parse_goodput,
    parse_percentiles,
    percentile_label,
)

__all__ = ["add_serve_args", "run_serve", "format_report"]

_WIDTH = 50


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument(
        "--base-url",
        default=None,
        help="Server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT).",
    )
    group.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    group.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions (default) or /v1/chat/completions (token-id prompts are "
        "decoded to text for chat).",
    )
    group.add_argument(
        "--model", default=None, help="Model name to send (default: the first of GET /v1/models)."
    )
    group.add_argument(
        "--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY, if set)."
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF directory whose tokenizer builds the dataset (default: the "
        "default model's).",
    )
    add_dataset_args(parser, with_seed=True)
    load = parser.add_argument_group("load options")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Requests per second, Poisson arrivals (default: inf, all at once).",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Shape of the gamma-distributed gaps (mean 1/rate): 1 is Poisson, below 1 "
        "burstier, above 1 more regular (default: 1.0).",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="At most this many requests in flight (default: no limit).",
    )
    load.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="Unmeasured requests sent before the run (default: 0).",
    )
    req = parser.add_argument_group("request options")
    req.add_argument(
        "--ignore-eos", action="store_true", help="Send ignore_eos: generate max_tokens tokens."
    )
    req.add_argument("--temperature", type=float, default=0.0, help="(default: 0.0, greedy)")
    out = parser.add_argument_group("report options")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="Comma-separated metrics to report: ttft, tpot, itl, e2el (default: ttft,tpot,itl).",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        help="Comma-separated percentiles to report, e.g. 50,90,99 (default: 99).",
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:2000; goodput counts the requests per "
        "second that meet all of them.",
    )
    out.add_argument("--save-result", action="store_true", help="Write the results as JSON.")
    out.add_argument(
        "--result-dir", default=None, help="Folder of the result file (default: current)."
    )
    out.add_argument(
        "--result-filename",
        default=None,
        help="Result file name (default: bench-serve-MODEL-DATASET-RATEqps-CONC-TIME.json).",
    )
    out.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


# ----------------------------------------------------------------------------------- the run


def _normalize_base_url(ns: argparse.Namespace) -> str:
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    if base.endswith("/v1") and ns.endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]  # accept http://host:port/v1 as well
    return base


def format_report(
    metrics: ServingMetrics,
    *,
    request_rate: float,
    max_concurrency: int | None,
    percentiles: list[float],
) -> str:
    def row(label: str, value: Any, fmt: str = "") -> str:
        text = format(value, fmt) if fmt else str(value)
        return f"{label:<40}{text:<10}"

    lines = [
        f"{' Serving Benchmark Result ':=^{_WIDTH}}",
        row("Successful requests:", metrics.completed),
        row("Failed requests:", metrics.failed),
        row("Maximum request concurrency:", max_concurrency or "none"),
        row("Traffic request rate (req/s):", f"{request_rate:g}"),
        row("Benchmark duration (s):", metrics.duration, ".2f"),
        row("Total input tokens:", metrics.total_input_tokens),
        row("Total generated tokens:", metrics.total_output_tokens),
        row("Request throughput (req/s):", metrics.request_throughput, ".2f"),
    ]
    if metrics.request_goodput is not None:
        lines.append(row("Request goodput (req/s):", metrics.request_goodput, ".2f"))
    lines += [
        row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"),
        row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"),
    ]
    for metric, values in metrics.latency.items():
        name = metric.upper()
        lines.append(f"{' ' + LATENCY_METRICS[metric] + ' ':-^{_WIDTH}}")
        lines.append(row(f"Mean {name} (ms):", values["mean"], ".2f"))
        lines.append(row(f"Median {name} (ms):", values["median"], ".2f"))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(row(f"P{label[1:]} {name} (ms):", values[label], ".2f"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _result_path(ns: argparse.Namespace, model: str) -> str:
    name = ns.result_filename
    if not name:
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
        conc = f"-c{ns.max_concurrency}" if ns.max_concurrency else ""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        safe_model = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
        name = f"bench-serve-{safe_model}-{ns.dataset_name}-{rate}qps{conc}-{stamp}.json"
    return os.path.join(ns.result_dir or ".", name)


def _validate(ns: argparse.Namespace) -> tuple[list[str], list[float], dict[str, float]]:
    metrics = [m.strip().lower() for m in ns.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in LATENCY_METRICS]
    if unknown or not metrics:
        raise ValueError(
            f"--percentile-metrics: unknown {unknown or 'empty'}; choose from "
            + ", ".join(LATENCY_METRICS)
        )
    percentiles = parse_percentiles(ns.metric_percentiles)
    slos = parse_goodput(ns.goodput)
    if ns.num_prompts <= 0:
        raise ValueError("--num-prompts must be > 0")
    if not ns.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    if not ns.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if ns.max_concurrency is not None and ns.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    if ns.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    return metrics, percentiles, slos


def _save_result(
    ns: argparse.Namespace,
    started_at: str,
    base: str,
    endpoint: str,
    model: str,
    selection: tuple[list[str], list[float], dict[str, float]],
    metrics: ServingMetrics,
    records: list[RequestRecord],
) -> None:
    """`--save-result`: the run's config, every aggregate and the per-request lists as JSON."""
    metrics_names, percentiles, slos = selection
    result: dict[str, Any] = {
        "date": started_at,
        "base_url": base,
        "endpoint": endpoint,
        "model": model,
        "tokenizer": ns.tokenizer,
        **dataset_config(ns),
        "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "warmup_requests": ns.warmup_requests,
        "ignore_eos": ns.ignore_eos,
        "temperature": ns.temperature,
        "percentile_metrics": metrics_names,
        "metric_percentiles": percentiles,
        "goodput_slos_ms": slos,
        **metrics.to_dict(),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "tpots": [r.tpot or 0.0 for r in records],
        "itls": [r.itl for r in records],
        "e2els": [r.e2el for r in records],
        "start_times": [r.start_time for r in records],
        "errors": [r.error for r in records],
    }
    path = _result_path(ns, model)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"Results saved to {path}", file=sys.stderr)


def run_serve(ns: argparse.Namespace) -> int:
    try:
        metrics_names, percentiles, slos = _validate(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = _normalize_base_url(ns)
    endpoint = ns.endpoint if ns.endpoint.startswith("/") else "/" + ns.endpoint
    url = base + endpoint
    chat = is_chat(endpoint)
    api_key = ns.api_key or envs.openai_api_key()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    model = ns.model
    if model is None:
        try:
            model = fetch_model(base, headers)
        except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
            print(f"error: cannot list the models at {base}/v1/models: {exc}", file=sys.stderr)
            return 2
    try:
        tokenizer = load_tokenizer(ns.tokenizer)
        samples: list[SampleRequest] = sample_from_args(ns, tokenizer)
    except (OSError, ValueError) as exc:
        print(f"error: dataset: {exc}", file=sys.stderr)
        return 2

    def job(s: SampleRequest) -> Job:
        prompt = s.prompt
        if chat and not isinstance(prompt, str):
            prompt = tokenizer.decode(prompt)
        payload = build_payload(
            model,
            prompt,
            s.expected_output_len,
            chat=chat,
            temperature=ns.temperature,
            ignore_eos=ns.ignore_eos,
        )
        return Job(payload, s.prompt_len)

    jobs = [job(s) for s in samples]
    warmup = [jobs[i % len(jobs)] for i in range(ns.warmup_requests)]
    offsets = arrival_offsets(len(jobs), ns.request_rate, ns.burstiness, ns.seed)
    print(
        f"Benchmarking {url} (model {model}): {len(jobs)} {ns.dataset_name} requests, "
        f"rate {ns.request_rate:g} req/s, burstiness {ns.burstiness:g}, "
        f"max concurrency {ns.max_concurrency or 'none'}",
        file=sys.stderr,
    )
    started_at = datetime.now().isoformat(timespec="seconds")
    records, duration = asyncio.run(
        run_load(jobs, warmup, url, headers, chat, offsets, ns.max_concurrency, ns.disable_tqdm)
    )
    metrics = aggregate(records, duration, percentiles, metrics_names, slos or None)
    print(
        format_report(
            metrics,
            request_rate=ns.request_rate,
            max_concurrency=ns.max_concurrency,
            percentiles=percentiles,
        ),
        flush=True,
    )

    if ns.save_result:
        _save_result(ns, started_at, base, endpoint, model, (metrics_names, percentiles, slos),
                     metrics, records)  # fmt: skip

    if metrics.completed == 0:
        first = next((r.error for r in records if r.error), "unknown error")
        print(f"error: all {len(records)} requests failed; first error: {first}", file=sys.stderr)
        return 1
    if metrics.failed:
        first = next(r.error for r in records if not r.success)
        print(f"warning: {metrics.failed} request(s) failed; first: {first}", file=sys.stderr)
    return 0
