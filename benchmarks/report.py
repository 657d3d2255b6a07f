"""Turn results.jsonl (from benchmarks/run_all.sh) into the ratio tables of docs/benchmarks.md.

.venv/bin/python benchmarks/report.py /opt/peers/work/results.jsonl

Rows tagged by run_all.sh (bench_model, round, pair, setting): per model, every run, then
each setting of ours against each peer, one ratio per pair (runs back to back), and against
the best peer of each figure. Untagged rows (older files): the all-rows table and the goal
lines of the first peer comparison.
"""

from __future__ import annotations

import json
import statistics
import sys

FIGURES = (
    ("offline_output_tok_s", "offline out tok/s"),
    ("prefill_512_tok_s", "prefill 512 tok/s"),
    ("decode_b1_tok_s", "batch-1 decode tok/s"),
)


def _label(row: dict) -> str:
    if row["engine"] == "pagedinfer":
        return f"pagedinfer ({row.get('setting', row.get('quant_activations'))})"
    return row["engine"].split(" ")[0]


def paired_report(rows: list[dict]) -> None:
    """Per model: the runs, then ours / peer per pair and ours / best peer."""
    for model in dict.fromkeys(r["bench_model"] for r in rows):
        mine = [r for r in rows if r["bench_model"] == model]
        print(f"### {model}\n")
        print("| round | engine | dtype | requests | offline out tok/s | prefill 512 tok/s | "
              "batch-1 decode tok/s | load s | peak RSS MB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for r in mine:
            print(
                f"| {r['round']} | {_label(r)} | {r.get('dtype')} | "
                f"{r.get('offline_num_requests')} | {r.get('offline_output_tok_s')} | "
                f"{r.get('prefill_512_tok_s')} | {r.get('decode_b1_tok_s')} | {r.get('load_s')} | "
                f"{r.get('peak_rss_mb')} |"
            )
        print()
        ours = [r for r in mine if r["engine"] == "pagedinfer"]
        peers = [r for r in mine if r["engine"] != "pagedinfer"]
        settings = list(dict.fromkeys(r["setting"] for r in ours))
        peer_names = list(dict.fromkeys(_label(r) for r in peers))
        print("| figure | ours | " + " | ".join(f"vs {p} (per round)" for p in peer_names)
              + " | vs best peer |")  # fmt: skip
        print("|---|---|" + "---|" * (len(peer_names) + 1))
        for key, name in FIGURES:
            # The best peer of this figure: highest mean over its runs (llama.cpp's offline
            # figure is sequential, batch 1: not a throughput peer).
            means = {}
            for p in peer_names:
                values = [r[key] for r in peers if _label(r) == p and r.get(key)]
                if values and not (key == "offline_output_tok_s" and p.startswith("llama")):
                    means[p] = statistics.mean(values)
            best = max(means, key=lambda p: means[p]) if means else None
            for setting in settings:
                cells, best_ratios = [], []
                for p in peer_names:
                    ratios = []
                    for peer_row in (r for r in peers if _label(r) == p):
                        mate = next(
                            (r for r in ours
                             if r["pair"] == peer_row["pair"] and r["setting"] == setting),
                            None,
                        )  # fmt: skip
                        if mate and mate.get(key) and peer_row.get(key):
                            ratios.append(mate[key] / peer_row[key])
                    cells.append(" / ".join(f"{x:.2f}x" for x in ratios) or "n/a")
                    if p == best:
                        best_ratios = ratios
                best_cell = (
                    f"{best}: {min(best_ratios):.2f}-{max(best_ratios):.2f}x"
                    if best_ratios
                    else "n/a"
                )
                print(f"| {name} | {setting} | " + " | ".join(cells) + f" | {best_cell} |")
        print()


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]
    tagged = [r for r in rows if "bench_model" in r]
    if tagged:
        paired_report(tagged)
        return

    def pick(engine: str, dtype: str | None = None, n: int | None = None) -> dict | None:
        for r in rows:
            if not r["engine"].startswith(engine):
                continue
            if dtype is not None and r.get("dtype") != dtype:
                continue
            if n is not None and r.get("offline_num_requests") != n:
                continue
            return r
        return None

    print(
        "| engine | dtype | requests | offline out tok/s | prefill 512 tok/s | "
        "batch-1 decode tok/s | load s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r.get('dtype')} | {r.get('offline_num_requests')} | "
            f"{r.get('offline_output_tok_s')} | {r.get('prefill_512_tok_s')} | "
            f"{r.get('decode_b1_tok_s')} | {r.get('load_s')} | {r.get('peak_rss_mb')} |"
        )
    print()

    def ratio(a: dict | None, b: dict | None, key: str) -> str:
        if not a or not b or not a.get(key) or not b.get(key):
            return "n/a"
        return f"{a[key] / b[key]:.2f}x ({a[key]} vs {b[key]})"

    ours_bf16 = pick("pagedinfer", "bfloat16", 200)
    ours_fp32 = pick("pagedinfer", "float32", 200)
    hf_n = next(
        (r["offline_num_requests"] for r in rows if r["engine"].startswith("transformers")), None
    )
    ours_bf16_hf = pick("pagedinfer", "bfloat16", hf_n)
    ours_fp32_hf = pick("pagedinfer", "float32", hf_n)
    hf_bf16, hf_fp32 = pick("transformers", "bfloat16"), pick("transformers", "float32")
    vllm, llama = pick("vllm"), pick("llama")
    hf_best = max(
        (r for r in (hf_bf16, hf_fp32) if r), key=lambda r: r["offline_output_tok_s"], default=None
    )
    ours_best_hf = max(
        (r for r in (ours_bf16_hf, ours_fp32_hf) if r),
        key=lambda r: r["offline_output_tok_s"],
        default=None,
    )
    print("| goal | measured |")
    print("|---|---|")
    print(
        f"| offline vs HF (best dtype, same {hf_n} requests) >= 2x | "
        f"{ratio(ours_best_hf, hf_best, 'offline_output_tok_s')} |"
    )
    print(
        f"| offline vs vLLM CPU (200 requests) >= 0.8x | "
        f"{ratio(ours_bf16, vllm, 'offline_output_tok_s')} |"
    )
    print(f"| prefill 512 vs llama.cpp >= 2.5x | {ratio(ours_bf16, llama, 'prefill_512_tok_s')} |")
    print(f"| batch-1 decode vs HF, bf16 >= 3x | {ratio(ours_bf16, hf_bf16, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs HF, fp32 >= 3x | {ratio(ours_fp32, hf_fp32, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs llama.cpp | {ratio(ours_bf16, llama, 'decode_b1_tok_s')} |")
    print(f"| batch-1 decode vs vLLM CPU | {ratio(ours_bf16, vllm, 'decode_b1_tok_s')} |")


if __name__ == "__main__":
    main(sys.argv[1])
