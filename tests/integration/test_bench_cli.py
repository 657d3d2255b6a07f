"""`pagedinfer bench serve|throughput|latency` as subprocesses: serve against a real
`pagedinfer serve` on loopback (random and ShareGPT workloads, a failing model name), and the
offline throughput / latency benchmarks with a small engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.data import SHAREGPT_SAMPLE
from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = pytest.mark.integration

ENGINE = small_engine_flags(max_model_len=512)
TIMEOUT = 300


def _pagedinfer(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedinfer", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*ENGINE)
    yield srv.base
    srv.stop()


def _only_json(folder) -> dict:
    files = [f for f in os.listdir(folder) if f.endswith(".json")]
    assert len(files) == 1, files
    with open(os.path.join(folder, files[0]), encoding="utf-8") as f:
        return json.load(f)


def test_bench_serve_random(server, tmp_path) -> None:
    proc = _pagedinfer(
        "bench", "serve", "--base-url", server,
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
        "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos",
        "--save-result", "--result-dir", "tmp", "--disable-tqdm",
        "--goodput", "ttft:100000",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for line in ("Successful requests:", "Request goodput (req/s):", "P99 ITL (ms):"):
        assert line in proc.stdout
    result = _only_json(tmp_path / "tmp")
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == 12 * 32
    assert result["total_output_tokens"] == 96
    assert result["output_lens"] == [8] * 12 and result["errors"] == [""] * 12
    # At most one gap per token after the first (chunks may merge tokens or carry no text).
    assert all(len(gaps) <= 7 for gaps in result["itls"]) and any(result["itls"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"mean_{metric}_ms"] > 0
        assert result[f"p99_{metric}_ms"] >= result[f"p50_{metric}_ms"] > 0
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["request_throughput"] == pytest.approx(12 / result["duration"])
    assert result["max_concurrency"] == 4 and result["dataset_name"] == "random"
    assert all(0 <= t < result["duration"] for t in result["start_times"])


def test_bench_serve_sharegpt_chat(server, tmp_path) -> None:
    proc = _pagedinfer(
        "bench", "serve", "--base-url", server, "--endpoint", "/v1/chat/completions",
        "--dataset-path", SHAREGPT_SAMPLE, "--num-prompts", "4", "--sharegpt-output-len", "8",
        "--ignore-eos",
        "--request-rate", "20", "--save-result", "--result-filename", "share.json",
        "--disable-tqdm",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = _only_json(tmp_path)
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 32
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 4 * 4
    assert result["dataset_path"] == SHAREGPT_SAMPLE
    assert result["mean_ttft_ms"] > 0 and result["request_goodput"] is None


def test_bench_serve_without_a_dataset_names_the_flag(server, tmp_path) -> None:
    """No --dataset-path and no default file: exit status 2 and a message naming the flag."""
    env = {**os.environ, "PAGEDINFER_DATA_DIR": str(tmp_path / "no-data")}
    proc = _pagedinfer("bench", "serve", "--base-url", server, "--num-prompts", "2",
                       "--disable-tqdm", cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--dataset-path" in proc.stderr and "does not exist" in proc.stderr


def test_bench_serve_counts_failed_requests(server, tmp_path) -> None:
    """Every request fails (404: unknown model): reported and saved, exit status 1."""
    proc = _pagedinfer(
        "bench", "serve", "--base-url", server, "--model", "no-such-model",
        "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "2",
        "--num-prompts", "3", "--save-result", "--result-dir", ".", "--disable-tqdm",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "all 3 requests failed" in proc.stderr and "HTTP 404" in proc.stderr
    result = _only_json(tmp_path)
    assert result["completed"] == 0 and result["failed"] == 3
    assert all("HTTP 404" in e for e in result["errors"])
    assert result["total_output_tokens"] == 0


def test_bench_throughput(tmp_path) -> None:
    proc = _pagedinfer(
        "bench", "throughput", "--dataset-name", "random",
        "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "8",
        "--ignore-eos", "--disable-tqdm", *ENGINE, "--output-json", "f.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "requests/s" in proc.stdout and "output tokens/s" in proc.stdout
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["num_requests"] == 8
    assert result["total_prompt_tokens"] == 8 * 32
    assert result["total_output_tokens"] == 8 * 8
    assert result["total_num_tokens"] == 8 * 40
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert result["requests_per_second"] == pytest.approx(8 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(64 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(320 / elapsed)


def test_bench_latency(tmp_path) -> None:
    proc = _pagedinfer(
        "bench", "latency", "--input-len", "16", "--output-len", "8", "--batch-size", "2",
        "--num-iters-warmup", "1", "--num-iters", "2", "--disable-tqdm",
        *ENGINE, "--output-json", "f.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Avg latency:" in proc.stdout and "99% percentile latency:" in proc.stdout
    result = json.loads((tmp_path / "f.json").read_text())
    assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
