"""lm-evaluation-harness, unmodified, against a real `pagedinfer serve`, next to its own `hf`
backend on the same checkpoint.

    .venv/bin/python benchmarks/bench_lm_eval.py [--model FILE.gguf | gemma-3-270m] \\
        [--venv .venv-lmeval] [--out lm_eval.json]

The harness lives in its own virtual environment (`--venv`, made on first use from the
pinned versions below plus this project's torch and transformers pins): it is not one of
our dependencies. The tasks are ours, in benchmarks/lm_eval/: a 20-question multiple-choice
task (log-likelihood of each choice: completion requests with `echo` and `logprobs`) and an
8-prompt greedy `generate_until` task. Runs, all on `--model` (default: the default model's
GGUF) in float32:

- `hf` (transformers loading the GGUF), both tasks, then both again with the chat template;
- `local-completions` against `pagedinfer serve --enable-tokenizer-info-endpoint`, both
  tasks, tokenizing through the server (the harness's "remote" tokenizer, picked by itself);
- `local-chat-completions --apply_chat_template` against the same server, the generate task.

It then compares, per question, each choice's log-likelihood (must agree within `--atol`,
1e-3 by default), the accuracy (must be equal) and every generated text (must be equal),
prints a table, writes `--out`, and exits 1 on any difference.
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "benchmarks", "lm_eval")
LM_EVAL = "lm-eval[api,hf]==0.4.13"
PINNED_FROM_RUN_LOCK = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "gguf")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pins() -> list[str]:
    """This project's pins for the packages the harness shares with us (so its `hf` backend
    computes with the same torch and transformers the tests compare against)."""
    pins = []
    for lock in ("run.lock", "test.lock"):
        with open(os.path.join(ROOT, "requirements", lock)) as f:
            for line in f:
                name = line.split("==")[0].strip().lower()
                if name in PINNED_FROM_RUN_LOCK and "==" in line:
                    pins.append(line.strip())
    return pins


def ensure_venv(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "bin", "lm_eval")):
        _log(f"creating {venv} with {LM_EVAL}")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", LM_EVAL, *_pins()], check=True)
    return os.path.join(venv, "bin", "lm_eval")


def run_harness(lm_eval: str, out_dir: str, model: str, model_args: str, tasks: str,
                chat: bool = False) -> dict[str, list[dict]]:  # fmt: skip
    """One `lm_eval` run; its logged samples per task, sorted by doc_id."""
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", tasks,
           "--include_path", ".", "--log_samples", "--output_path", out_dir]  # fmt: skip
    if model == "hf":
        cmd += ["--batch_size", "1"]
    if chat:
        cmd.append("--apply_chat_template")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    _log(" ".join(cmd))
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"lm_eval failed ({model})")
    _log(f"  {time.monotonic() - start:.1f} s")
    samples = {}
    for task in tasks.split(","):
        path = sorted(glob.glob(os.path.join(out_dir, "*", f"samples_{task}_*.jsonl")))[-1]
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return samples


def loglikelihoods(rows: list[dict]) -> list[list[float]]:
    return [[float(r[0][0]) for r in row["resps"]] for row in rows]


def accuracy(rows: list[dict]) -> float:
    return sum(row["acc"] for row in rows) / len(rows)


def generations(rows: list[dict]) -> list[str]:
    return [row["resps"][0][0] for row in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="A GGUF file, or gemma-3-270m (default: the default model).")  # fmt: skip
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-lmeval"))
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="Write the comparison as JSON here.")
    args = ap.parse_args()

    sys.path.insert(0, ROOT)
    from pagedinfer.gguf_metadata import GEMMA3_270M, find_default_model, find_gemma3_270m
    from tests.integration.server_proc import ServerProcess

    if args.model == GEMMA3_270M:
        args.model = find_gemma3_270m()
    model = os.path.abspath(args.model or find_default_model())
    if not model.endswith(".gguf"):
        raise SystemExit("--model must be a .gguf file (the hf backend loads it by gguf_file)")
    lm_eval = ensure_venv(args.venv)
    hf_args = (f"pretrained={os.path.dirname(model)},gguf_file={os.path.basename(model)},"
               "dtype=float32")  # fmt: skip
    both = "pagedinfer_mc,pagedinfer_generate"
    with tempfile.TemporaryDirectory() as tmp:
        hf = run_harness(lm_eval, f"{tmp}/hf", "hf", hf_args, both)
        hf_chat = run_harness(lm_eval, f"{tmp}/hf_chat", "hf", hf_args, "pagedinfer_generate",
                              chat=True)  # fmt: skip
        server = ServerProcess(model, "--dtype", "float32", "--max-model-len", "2048",
                               "--served-model-name", "model",
                               "--enable-tokenizer-info-endpoint")  # fmt: skip
        try:
            base = server.base
            ours = run_harness(lm_eval, f"{tmp}/ours", "local-completions",
                               f"model=model,base_url={base}/v1/completions,num_concurrent=4",
                               both)  # fmt: skip
            ours_chat = run_harness(
                lm_eval, f"{tmp}/ours_chat", "local-chat-completions",
                f"model=model,base_url={base}/v1/chat/completions,num_concurrent=4",
                "pagedinfer_generate", chat=True,
            )  # fmt: skip
        finally:
            server.stop()

    ref, got = loglikelihoods(hf["pagedinfer_mc"]), loglikelihoods(ours["pagedinfer_mc"])
    per_question = [max(abs(a - b) for a, b in zip(r, g)) for r, g in zip(ref, got)]
    result = {
        "model": os.path.basename(model),
        "cpu": platform.processor() or platform.machine(),
        "questions": len(ref),
        "loglikelihood_max_abs_diff": max(per_question),
        "accuracy_hf": accuracy(hf["pagedinfer_mc"]),
        "accuracy_pagedinfer": accuracy(ours["pagedinfer_mc"]),
        "generate_until_equal": generations(hf["pagedinfer_generate"])
        == generations(ours["pagedinfer_generate"]),
        "chat_generate_until_equal": generations(hf_chat["pagedinfer_generate"])
        == generations(ours_chat["pagedinfer_generate"]),
        "generations_hf": generations(hf["pagedinfer_generate"]),
        "generations_pagedinfer": generations(ours["pagedinfer_generate"]),
    }
    ok = (
        result["loglikelihood_max_abs_diff"] <= args.atol
        and result["accuracy_hf"] == result["accuracy_pagedinfer"]
        and result["generate_until_equal"]
        and result["chat_generate_until_equal"]
    )
    print(f"model {result['model']}, {result['questions']} questions")
    print(f"{'':34} {'hf':>8} {'pagedinfer':>11}")
    print(f"{'accuracy (pagedinfer_mc)':34} {result['accuracy_hf']:8.2f} "
          f"{result['accuracy_pagedinfer']:11.2f}")  # fmt: skip
    print(f"max |loglikelihood difference|: {result['loglikelihood_max_abs_diff']:.2e} "
          f"(tolerance {args.atol:g})")  # fmt: skip
    print(f"generate_until texts equal: completions {result['generate_until_equal']}, "
          f"chat {result['chat_generate_until_equal']}")  # fmt: skip
    print("PASS" if ok else "FAIL")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
