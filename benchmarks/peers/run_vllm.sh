#!/usr/bin/env bash
# Run benchmarks/peers/vllm_bench.py in the vLLM CPU venv with the env vLLM's CPU backend wants.
# Makes the bf16 HF export of the default GGUF and the shared workload first if they are missing
# (both with the repo venv). Extra arguments go to vllm_bench.py; one JSON line on stdout.
#   VLLM_VENV=/opt/peers/vllm PEERS_WORK=/opt/peers/work THREADS=2 benchmarks/peers/run_vllm.sh --num-requests 200
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VLLM_VENV="${VLLM_VENV:-/opt/peers/vllm}"
export PEERS_WORK="${PEERS_WORK:-/opt/peers/work}"
MODEL_DIR="${MODEL_DIR:-/opt/peers/models/smollm2-135m-bf16}"
THREADS="${THREADS:-2}"

if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
  "$ROOT/.venv/bin/python" -c "import sys, torch; from pagedinfer.model.loader import export_hf_dir; \
export_hf_dir(None, sys.argv[1], dtype=torch.bfloat16)" "$MODEL_DIR" >&2
fi
if [ ! -f "$PEERS_WORK/workload.json" ]; then
  "$ROOT/.venv/bin/python" "$ROOT/benchmarks/workload.py" --out "$PEERS_WORK/workload.json"
fi

TCMALLOC="$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')"
[ -n "$TCMALLOC" ] || { echo "libtcmalloc_minimal.so.4 missing: apt-get install -y libtcmalloc-minimal4" >&2; exit 1; }
export LD_PRELOAD="$TCMALLOC:$VLLM_VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec "$VLLM_VENV/bin/python" "$ROOT/benchmarks/peers/vllm_bench.py" --model "$MODEL_DIR" \
  --threads "$THREADS" "$@"
