#!/usr/bin/env bash
# Run every peer one after another (nothing else should run on the machine meanwhile) and
# append their JSON lines to $PEERS_WORK/results.jsonl; logs go to $PEERS_WORK/<peer>.log.
#   benchmarks/peers/run_all.sh            NUM_REQUESTS=200 LLAMACPP_REQUESTS=50 HF_REQUESTS=64
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export PEERS_WORK="${PEERS_WORK:-/opt/peers/work}"
mkdir -p "$PEERS_WORK"
OUT="$PEERS_WORK/results.jsonl"
N="${NUM_REQUESTS:-200}"
[ -f "$PEERS_WORK/workload.json" ] ||
  "$ROOT/.venv/bin/python" "$ROOT/benchmarks/workload.py" --out "$PEERS_WORK/workload.json"

run() {  # name, command...
  local name="$1"; shift
  echo "== $name" >&2
  "$@" 2> "$PEERS_WORK/$name.log" | tee -a "$OUT"
}
run vllm-bf16 "$ROOT/benchmarks/peers/run_vllm.sh" --num-requests "$N"
run openvino-q4_1 /opt/peers/openvino/bin/python "$ROOT/benchmarks/peers/openvino_bench.py" \
  --num-requests "$N"
run llamacpp-q4_1 /opt/peers/llamacpp/bin/python "$ROOT/benchmarks/peers/llamacpp_bench.py" \
  --num-requests "${LLAMACPP_REQUESTS:-50}"
for dtype in bfloat16 float32; do
  run "hf-$dtype" "$ROOT/.venv/bin/python" "$ROOT/benchmarks/peers/hf_bench.py" \
    --dtype "$dtype" --batch-size 32 --num-requests "${HF_REQUESTS:-64}"
done
