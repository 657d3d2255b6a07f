#!/usr/bin/env bash
# Offline throughput and batch-1 decode of two checkouts, alternated round by round on the
# same venv (the machine's speed drifts, so before/after must run side by side):
#   benchmarks/compare_trees.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]
# e.g. `git worktree add /tmp/before <commit>` then benchmarks/compare_trees.sh /tmp/before .
# Prints "tree round output_tok_s b1_decode_tok_s" per run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
OLD="$(cd "$1" && pwd)"; NEW="$(cd "$2" && pwd)"; ROUNDS="${3:-3}"
OUT="$(mktemp -d)"
for round in $(seq "$ROUNDS"); do
  for tree in old new; do
    dir=$OLD; [ "$tree" = new ] && dir=$NEW
    (cd "$dir" && PYTHONPATH="$dir" "$PY" -m pagedinfer.entrypoints.cli bench throughput \
      --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 \
      --ignore-eos --disable-tqdm --output-json "$OUT/tp.json" >/dev/null 2>&1)
    (cd "$dir" && PYTHONPATH="$dir" "$PY" -m pagedinfer.entrypoints.cli bench latency \
      --batch-size 1 --input-len 32 --output-len 128 --num-iters-warmup 2 --num-iters 5 \
      --disable-tqdm --output-json "$OUT/lat.json" >/dev/null 2>&1)
    "$PY" -c 'import json, sys
tp = json.load(open(sys.argv[3] + "/tp.json")); lat = json.load(open(sys.argv[3] + "/lat.json"))
print(sys.argv[1], sys.argv[2], round(tp["output_tokens_per_second"], 1),
      round(128 / lat["avg_latency"], 1), flush=True)' "$tree" "$round" "$OUT"
  done
done
rm -rf "$OUT"
