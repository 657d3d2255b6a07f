"""Plain decoding at several batch sizes with different `quant_max_tokens` (the largest step
that multiplies by the GGUF file's own quantised blocks instead of the dense weights): the
evidence for its default.

All engines stay alive; for each batch size every engine runs the same batch in turn (the
order reversed every round, so the machine's drift hits all alike), 64 greedy tokens per
request (ignore_eos), ShareGPT held-out prompts (repeated when the batch is larger).
Reported: median output tok/s over the rounds, and each setting's ratio to the first.

Usage: .venv/bin/python benchmarks/bench_quant_cutoff.py [--settings 8,32,32:int8] \
           [--batch-sizes 4,16,32,64] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from bench_spec_decode import add_dataset_path_arg, checked_dataset_path, sharegpt_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--settings",
        default="8,32",
        help="quant_max_tokens values, each optionally :MODE for quant_activations (32:int8)",
    )
    parser.add_argument("--batch-sizes", default="4,16,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    add_dataset_path_arg(parser)
    args = parser.parse_args()
    args.dataset_path = checked_dataset_path(parser, args.dataset_path)

    from pagedinfer import LLM, SamplingParams

    settings = args.settings.split(",")
    llms = {
        q: LLM(dtype=args.dtype, max_model_len=2048, kv_cache_memory_bytes=512 * 2**20,
               log_stats_interval_s=0, quant_max_tokens=int(q.split(":")[0]),
               quant_activations=(q.split(":") + ["auto"])[1])
        for q in settings
    }  # fmt: skip
    base = sharegpt_prompts(llms[settings[0]].get_tokenizer(), 32, args.dataset_path)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"Command: `.venv/bin/python {' '.join(sys.argv)}` ({args.dtype}, "
          f"{os.cpu_count()} cores); median output tok/s (ratio to q={settings[0]})\n")  # fmt: skip
    print("| batch | " + " | ".join(f"q={q}" for q in settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batch = [{"prompt_token_ids": base[i % len(base)]} for i in range(bs)]
        rates: dict[str, list[float]] = {q: [] for q in settings}
        for r in range(args.rounds):
            for q in settings if r % 2 == 0 else settings[::-1]:
                start = time.perf_counter()
                llms[q].generate(batch, params, use_tqdm=False)
                rates[q].append(bs * args.max_tokens / (time.perf_counter() - start))
        med = {q: statistics.median(v) for q, v in rates.items()}
        cells = [f"{med[q]:.0f} ({med[q] / med[settings[0]]:.2f}x)" for q in settings]
        print(f"| {bs} | " + " | ".join(cells) + " |", flush=True)
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
