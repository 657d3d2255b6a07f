"""Per-step request statistics and the Prometheus exporter behind the server's `/metrics`.

Flow (vLLM's design): after every engine step the front end's `OutputProcessor` fills an
`IterationStats` (time to first token of requests that got their first token, the gap since
each running request's previous token, one `FinishedRequestStats` per finished request);
`AsyncLLM` hands it with the step's `SchedulerStats` to every registered stat logger.
`PrometheusStatLogger` turns them into counters, gauges and histograms in its own
`CollectorRegistry` (one per server, so tests may run several in one process).

Times are `time.monotonic()` seconds: the arrival time is taken in the front end, token times
are the engine core's step timestamps (another process; CLOCK_MONOTONIC is one clock for the
whole machine on Linux). Requests are counted as the engine core sees them: each child of an
`n > 1` request is one request. A request the client aborts (a disconnect) finishes with
reason "abort".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedinfer.core.messages import SchedulerStats

__all__ = ["FinishedRequestStats", "IterationStats", "PrometheusStatLogger", "StatLogger"]


@dataclass
class FinishedRequestStats:
    finish_reason: str
    """"stop", "length", "abort" or "error"."""
    e2e_latency: float
    """Arrival to finish, seconds."""
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step (or one batch of front-end aborts) did to the requests."""

    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger:
    """Receives every step's statistics from `AsyncLLM`'s output handler."""

    def record_prompt_tokens(self, num_tokens: int) -> None:
        """Prompt tokens of newly added requests (counted once per engine-core request)."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        raise NotImplementedError


# Buckets as vLLM's (seconds / tokens), so existing dashboards read our figures the same way.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        scale *= 10


class PrometheusStatLogger(StatLogger):
    """Counters, gauges and histograms named like vLLM's, with the `pagedinfer:` prefix and a
    `model_name` label."""

    PREFIX = "pagedinfer:"

    def __init__(self, model_name: str, max_model_len: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        p, r = self.PREFIX, self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(p + name, doc, labels + list(extra), registry=r)

        def gauge(name: str, doc: str):
            return Gauge(p + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge(
            "num_requests_running", "Requests in the running queue (being scheduled)."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled (new or preempted)."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions (running -> waiting).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests added.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Arrival to first token (queueing and prefill included).",
            _TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's consecutive tokens.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of each finished request.",
            _E2E_BUCKETS,
        )  # fmt: skip
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of each finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated by each finished request.",
            token_buckets,
        )  # fmt: skip
        # Speculative decoding (vLLM's names): drafts verified, draft tokens proposed and
        # accepted, and accepted tokens per draft position.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Drafts verified.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ("position",),
        )
        # KV connectors (disaggregated prefill): what was loaded into and saved from the
        # paged cache, and loads that failed (their prompts were recomputed or failed).
        self.kv_transfer_counters = {
            name: counter(f"kv_transfer_{name}", doc)
            for name, doc in (
                ("num_loaded_tokens", "Prompt tokens whose KV a KV connector loaded."),
                ("num_loaded_bytes", "Bytes of KV a KV connector loaded."),
                ("load_time_s", "Seconds spent loading KV."),
                ("num_saved_tokens", "Prompt tokens whose KV a KV connector saved."),
                ("num_saved_bytes", "Bytes of KV a KV connector saved."),
                ("save_time_s", "Seconds spent saving KV."),
                ("num_failed_loads", "Requests whose KV load failed."),
            )
        }
        self.model_name = model_name
        for reason in ("stop", "length", "abort", "error"):  # every series exists from start
            self.request_success.labels(model_name, reason)
        self._preemptions_seen = 0

    def record_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        name = self.model_name
        if scheduler_stats is not None:
            s = scheduler_stats
            self.num_requests_running.set(s.num_running_reqs)
            self.num_requests_waiting.set(s.num_waiting_reqs)
            self.kv_cache_usage.set(s.kv_cache_usage)
            # The scheduler reports preemptions since start; the counter takes increments.
            if s.num_preemptions > self._preemptions_seen:
                self.num_preemptions.labels(name).inc(s.num_preemptions - self._preemptions_seen)
                self._preemptions_seen = s.num_preemptions
            if s.prefix_cache_queries:
                self.prefix_cache_queries.labels(name).inc(s.prefix_cache_queries)
                self.prefix_cache_hits.labels(name).inc(s.prefix_cache_hits)
            if s.spec_decoding is not None:
                spec = s.spec_decoding
                self.spec_decode_num_drafts.labels(name).inc(spec.num_drafts)
                self.spec_decode_num_draft_tokens.labels(name).inc(spec.num_draft_tokens)
                self.spec_decode_num_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self.spec_decode_num_accepted_tokens_per_pos.labels(name, str(pos)).inc(n)
            if s.kv_transfer is not None:
                for field, metric in self.kv_transfer_counters.items():
                    if value := getattr(s.kv_transfer, field):
                        metric.labels(name).inc(value)
        if iteration_stats is None:
            return
        it = iteration_stats
        if it.num_generation_tokens:
            self.generation_tokens.labels(name).inc(it.num_generation_tokens)
        for ttft in it.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for fin in it.finished_requests:
            self.request_success.labels(name, fin.finish_reason).inc()
            self.e2e_request_latency.observe(fin.e2e_latency)
            self.request_prompt_tokens.observe(fin.num_prompt_tokens)
            self.request_generation_tokens.observe(fin.num_generation_tokens)

    def update_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Fresh values asked of the engine core at scrape time."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
