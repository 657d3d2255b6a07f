"""Metric math of `pagedinfer bench`: pure functions, no I/O, no engine.

- `RequestRecord`: what one streamed request measured (seconds).
- `aggregate(records, duration, ...)`: the serving metrics: counts, throughputs, goodput and,
  per latency metric (ttft, tpot, itl, e2el), mean / median / std / percentiles in ms.
- `arrival_offsets(n, rate, burstiness, seed)`: when to send each request (Poisson arrivals for
  burstiness 1, gamma-distributed gaps otherwise; the mean gap is always 1 / rate).
- `parse_goodput`, `parse_percentiles`, `percentile_label`: option parsing shared by the CLI.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "LATENCY_METRICS",
    "LATENCY_PERCENTILES",
    "RequestRecord",
    "ServingMetrics",
    "aggregate",
    "arrival_offsets",
    "latency_summary",
    "meets_slos",
    "parse_goodput",
    "parse_percentiles",
    "percentile_label",
    "summarize",
]

# Latency metrics of `bench serve`, with their long names for the report.
LATENCY_METRICS: dict[str, str] = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
# Percentiles `bench latency` reports.
LATENCY_PERCENTILES: tuple[int, ...] = (10, 25, 50, 75, 90, 99)


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds."""

    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens when it sent one, else the dataset's
    output_tokens: int = 0
    ttft: float = 0.0  # send -> first chunk carrying text
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between later text chunks
    e2el: float = 0.0  # send -> [DONE]
    start_time: float = 0.0  # when it was sent (`bench serve` saves it relative to the start)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass
class ServingMetrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None when no SLO was given
    # metric -> {"mean": ms, "median": ms, "std": ms, "p99": ms, ...}
    latency: dict[str, dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        """Flat, vLLM-like keys: completed, request_throughput, mean_ttft_ms, p99_itl_ms, ..."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "latency"
        }
        for metric, values in self.latency.items():
            for stat, value in values.items():
                out[f"{stat}_{metric}_ms"] = value
        return out


def percentile_label(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def parse_percentiles(spec: str) -> list[float]:
    """Parse "50,90,99" into [50.0, 90.0, 99.0]; each must be in [0, 100]."""
    out: list[float] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        value = float(part)
        if not 0.0 <= value <= 100.0 or math.isnan(value):
            raise ValueError(f"percentile {part!r} is not in [0, 100]")
        out.append(value)
    if not out:
        raise ValueError("no percentile given")
    return out


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    The SLO metrics are ttft, tpot and e2el; each value must be a non-negative number.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        for part in item.split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(
                    f"goodput SLO {part!r}: expected METRIC:MS with METRIC one of ttft, tpot, e2el"
                )
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"goodput SLO {part!r}: {value!r} is not a number") from None
            if ms < 0 or math.isnan(ms):
                raise ValueError(f"goodput SLO {part!r}: the value must be >= 0")
            slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms). A request with a single output token
    has no TPOT and passes a TPOT SLO."""
    if not record.success:
        return False
    if "ttft" in slos and record.ttft * 1000 > slos["ttft"]:
        return False
    if "e2el" in slos and record.e2el * 1000 > slos["e2el"]:
        return False
    tpot = record.tpot
    if "tpot" in slos and tpot is not None and tpot * 1000 > slos["tpot"]:
        return False
    return True


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / percentiles of seconds, in milliseconds (all 0.0 when empty)."""
    out: dict[str, float] = {}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = arr.size == 0
    out["mean"] = 0.0 if empty else float(arr.mean())
    out["median"] = 0.0 if empty else float(np.median(arr))
    out["std"] = 0.0 if empty else float(arr.std())
    for p in percentiles:
        out[percentile_label(p)] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def aggregate(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (99,),
    metrics: Sequence[str] = tuple(LATENCY_METRICS),
    slos: dict[str, float] | None = None,
) -> ServingMetrics:
    """Serving metrics of a run that took `duration` seconds. Failed requests count in `failed`
    only: they add no tokens and no latencies. ITL pools the gaps of every request; TPOT has one
    value per request with at least two output tokens."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    unknown = [m for m in metrics if m not in samples]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {list(samples)}")
    goodput = None
    if slos:
        goodput = sum(meets_slos(r, slos) for r in ok) / duration
    return ServingMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        request_goodput=goodput,
        latency={m: summarize(samples[m], percentiles) for m in metrics},
    )


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of `n` requests arriving at `rate` per second.

    The gaps are gamma-distributed with shape `burstiness` and mean 1 / rate: burstiness 1 is a
    Poisson process (exponential gaps); below 1 arrivals are burstier (larger variance), above 1
    more regular. An infinite rate sends everything at once. The first request goes at 0.
    """
    if n <= 0:
        return []
    if burstiness <= 0 or math.isnan(burstiness):
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def latency_summary(latencies_s: Sequence[float]) -> dict[str, Any]:
    """`bench latency`'s numbers: average, every latency, and the 10..99th percentiles (s)."""
    arr = np.asarray(latencies_s, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no latencies")
    return {
        "avg_latency": float(arr.mean()),
        "latencies": [float(x) for x in arr],
        "percentiles": {str(p): float(np.percentile(arr, p)) for p in LATENCY_PERCENTILES},
    }
