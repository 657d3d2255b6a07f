#!/usr/bin/env bash
# Batch-1 decode and 512-token prefill, Hugging Face and pagedinfer alternated (the machine's
# speed drifts by ~25% over minutes, so near-goal ratios need runs side by side):
#   benchmarks/b1_alternate.sh [ROUNDS]      prints "engine dtype decode_b1_tok_s prefill_512_tok_s"
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PEERS_WORK="${PEERS_WORK:-/opt/peers/work}"
PY="$ROOT/.venv/bin/python"
fields() { "$PY" -c 'import json, sys; d = json.load(sys.stdin)
print(sys.argv[1], d["dtype"], d["decode_b1_tok_s"], d["prefill_512_tok_s"], flush=True)' "$1"; }
for round in $(seq "${1:-3}"); do
  for dtype in float32 bfloat16; do
    "$PY" "$ROOT/benchmarks/peers/hf_bench.py" --dtype "$dtype" --num-requests 1 2>/dev/null | fields hf
    "$PY" "$ROOT/benchmarks/bench_pagedinfer.py" --dtype "$dtype" --num-requests 1 2>/dev/null | fields ours
  done
done
