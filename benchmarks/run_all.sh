#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md in one run, one engine at a time (nothing else may
# run on the machine meanwhile). Results: one JSON line per run in $PEERS_WORK/results.jsonl;
# then `benchmarks/report.py` prints the ratios table.
#   benchmarks/run_all.sh        (peers must be installed: benchmarks/peers/install.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PEERS_WORK="${PEERS_WORK:-/opt/peers/work}"
mkdir -p "$PEERS_WORK"
OUT="$PEERS_WORK/results.jsonl"
: > "$OUT"
[ -f "$PEERS_WORK/workload.json" ] ||
  "$ROOT/.venv/bin/python" "$ROOT/benchmarks/workload.py" --out "$PEERS_WORK/workload.json"
HF_N="${HF_REQUESTS:-32}"
for dtype in bfloat16 float32; do
  for n in 200 "$HF_N"; do
    echo "== pagedinfer $dtype n=$n" >&2
    "$ROOT/.venv/bin/python" "$ROOT/benchmarks/bench_pagedinfer.py" --dtype "$dtype" \
      --num-requests "$n" 2> "$PEERS_WORK/pagedinfer-$dtype-$n.log" | tee -a "$OUT"
  done
done
HF_REQUESTS="$HF_N" "$ROOT/benchmarks/peers/run_all.sh"
"$ROOT/.venv/bin/python" "$ROOT/benchmarks/report.py" "$OUT"
