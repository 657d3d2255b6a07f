"""Two load generators against one real `pagedinfer serve`: NVIDIA's aiperf and guidellm (#23
item 6). Both run on the same machine as the server, as a user on a small box would run them;
aiperf starts several busy worker processes of its own, guidellm one mostly idle loop, so the
gap between their inter-token latencies shows how the server's threading copes with a
client that takes CPU.

For each server setting (`--settings`: `serve` flags and VAR=VALUE environment words,
`;`-separated, as in bench_contention.py), per round: a fresh server, then guidellm and aiperf
one after the other (the order alternates between rounds), each sending `--requests` streamed
completions at concurrency `--concurrency`, `--isl` prompt tokens -> `--osl` output tokens
(`ignore_eos`). Prints each client's mean and median ITL and TTFT, and the aiperf / guidellm
ratio of mean ITL.

The clients live in their own venvs (PEERS_DIR, /opt/peers by default):
    python3 -m venv /opt/peers/aiperf && /opt/peers/aiperf/bin/pip install aiperf
    python3 -m venv /opt/peers/guidellm && /opt/peers/guidellm/bin/pip install guidellm
and count tokens with a Hugging Face tokenizer (`--tokenizer`: a directory with SmolLM2's
tokenizer.json, e.g. benchmarks/make_llama1b.py's llama1b-shaped-bf16/).

    .venv/bin/python benchmarks/bench_clients.py --tokenizer DIR \\
        [--settings="--adapt-threads;--no-adapt-threads"] [--rounds 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_contention import start_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def _run(cmd: list[str], timeout_s: float) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")  # fmt: skip


def run_aiperf(args: argparse.Namespace, port: int) -> dict:
    out = tempfile.mkdtemp(prefix="aiperf-")
    _run([
        os.path.join(args.peers_dir, "aiperf/bin/aiperf"), "profile",
        "--url", f"http://127.0.0.1:{port}", "--model", MODEL, "--tokenizer", args.tokenizer,
        "--endpoint-type", "completions", "--streaming",
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl),
        "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"max_tokens:{args.osl}",
        "--random-seed", "0", "--ui-type", "none", "--artifact-dir", out,
    ], args.timeout)  # fmt: skip
    (path,) = glob.glob(os.path.join(out, "**", "profile_export_aiperf.json"), recursive=True)
    with open(path) as f:
        data = json.load(f)
    metrics = data.get("records", data)

    def stat(name: str, key: str) -> float:
        return float(metrics[name][key])

    return {
        "itl_mean_ms": stat("inter_token_latency", "avg"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "ttft_mean_ms": stat("time_to_first_token", "avg"),
        "requests": int(stat("request_count", "avg")),
    }


def run_guidellm(args: argparse.Namespace, port: int) -> dict:
    work = tempfile.mkdtemp(prefix="guidellm-")
    out = os.path.join(work, "result.json")
    scenario = {
        "metadata": {"name": "pagedinfer-itl"},
        "spec": {
            "backend": {
                "kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": MODEL,
                "request_format": "/v1/completions", "stream": True,
                "extras": {"body": {"ignore_eos": True}},
            },
            "profile": {"kind": "concurrent", "streams": [args.concurrency]},
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": args.tokenizer},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.isl,
                      "output_tokens": args.osl}],
            "seed": {"kind": "static", "value": 0},
            "outputs": [{"kind": "json", "path": out}],
        },
    }  # fmt: skip
    path = os.path.join(work, "scenario.json")
    with open(path, "w") as f:
        json.dump(scenario, f)
    guidellm = os.path.join(args.peers_dir, "guidellm/bin/guidellm")
    _run([guidellm, "run", "-c", path, "--disable-console-interactive"], args.timeout)
    with open(out) as f:
        data = json.load(f)
    metrics = data["benchmarks"][0]["metrics"]

    def stat(name: str, key: str) -> float:
        return float(metrics[name]["successful"][key])

    return {
        "itl_mean_ms": stat("inter_token_latency_ms", "mean"),
        "itl_p50_ms": stat("inter_token_latency_ms", "median"),
        "ttft_mean_ms": stat("time_to_first_token_ms", "mean"),
        "requests": int(metrics["request_totals"]["successful"]),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="HF directory with tokenizer.json")
    ap.add_argument("--settings", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per client run")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/opt/peers"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"cpu: {_cpu_model()}, {os.cpu_count()} cores; "
          f"{args.requests} requests at concurrency {args.concurrency}, "
          f"{args.isl} -> {args.osl} tokens")  # fmt: skip
    print("| setting | round | client | ITL mean ms | ITL p50 ms | TTFT mean ms | requests |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    clients = {"guidellm": run_guidellm, "aiperf": run_aiperf}
    for rnd in range(args.rounds):
        for setting in (s.strip() for s in args.settings.split(";")):
            order = list(clients) if rnd % 2 == 0 else list(reversed(clients))
            srv = start_server(setting, "--max-model-len", "1024")
            try:
                for name in order:
                    row = {"setting": setting, "round": rnd, "client": name,
                           **clients[name](args, srv.port)}  # fmt: skip
                    rows.append(row)
                    print(f"| {setting} | {rnd} | {name} | {row['itl_mean_ms']:.1f} | "
                          f"{row['itl_p50_ms']:.1f} | {row['ttft_mean_ms']:.0f} | "
                          f"{row['requests']} |", flush=True)  # fmt: skip
            finally:
                srv.stop()
    print("\n| setting | round | aiperf / guidellm mean ITL |\n|---|---|---|")
    for rnd in range(args.rounds):
        for setting in (s.strip() for s in args.settings.split(";")):
            by = {r["client"]: r for r in rows if r["setting"] == setting and r["round"] == rnd}
            ratio = by["aiperf"]["itl_mean_ms"] / by["guidellm"]["itl_mean_ms"]
            print(f"| {setting} | {rnd} | {ratio:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
