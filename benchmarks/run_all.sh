#!/usr/bin/env bash
# Every engine on every model, ours alternated with each peer, then the ratio table.
# Nothing else may run on the machine meanwhile.
#
#   benchmarks/run_all.sh
#   MODELS="smollm2 gemma3 llama1b-q4_0 llama1b-q4_k_m" PEERS="llamacpp openvino vllm" \
#   OURS="default int8" ROUNDS=2 NUM_REQUESTS=200 LARGE_REQUESTS=32 benchmarks/run_all.sh
#
# Per model and round, for each peer: every setting of ours, then the peer, back to back
# (a "pair"); so each peer is measured ROUNDS times, each next to its own runs of ours, and
# the report's ratios compare runs minutes apart. One JSON line per run, tagged with model,
# round, pair and setting, in $PEERS_WORK/results.jsonl; `benchmarks/report.py` prints the
# tables (also run at the end). The CPU model and flags go to $PEERS_WORK/cpu.txt.
#
# Models: smollm2 (the default Q4_1 file), gemma3 (Gemma 3 270M Q4_K_M, Gemma's tokenizer),
# llama1b-q4_0 / llama1b-q4_k_m (benchmarks/make_llama1b.py's files in $MODELS_DIR, made if
# missing; SmolLM2's token ids). 1B-scale models run LARGE_REQUESTS requests. Ours:
# "default" (the engine's defaults: float32 activations on float32 models), "int8"
# (--quant-activations int8, the arithmetic llama.cpp and OpenVINO use), "kv8" (the int8 KV
# cache, as OpenVINO's u8 one). Peers: installed
# by benchmarks/peers/install.sh; vllm (bf16 HF directory) only where its venv exists.
# Environment: PEERS_WORK (/opt/peers/work), MODELS_DIR (/opt/peers/models), THREADS (2),
# LLAMACPP_REQUESTS (llama.cpp serves one request at a time: first N, default 50 / 8).
# The AVX2-capped table: PAGEDINFER_MAX_CPU_ISA=avx2 PEERS="llamacpp-avx2 openvino" (our
# kernels capped to AVX2; llama.cpp built without AVX-512 by install.sh llamacpp-avx2).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
export PEERS_WORK="${PEERS_WORK:-/opt/peers/work}"
MODELS_DIR="${MODELS_DIR:-/opt/peers/models}"
MODELS="${MODELS:-smollm2 gemma3 llama1b-q4_0 llama1b-q4_k_m}"
PEERS="${PEERS:-llamacpp openvino vllm}"
OURS="${OURS:-default int8}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-2}"
mkdir -p "$PEERS_WORK"
OUT="$PEERS_WORK/results.jsonl"
: > "$OUT"
lscpu > "$PEERS_WORK/cpu.txt"

model_file() {  # model name -> GGUF path
  case "$1" in
    smollm2) "$PY" -c "from pagedinfer.gguf_metadata import find_default_model as f; print(f())" ;;
    gemma3) "$PY" -c "from pagedinfer.gguf_metadata import find_gemma3_270m as f; print(f())" ;;
    llama1b-q4_0) echo "$MODELS_DIR/llama1b-shaped.Q4_0.gguf" ;;
    llama1b-q4_k_m) echo "$MODELS_DIR/llama1b-shaped.Q4_K_M.gguf" ;;
    *) echo "unknown model $1" >&2; return 1 ;;
  esac
}

run() {  # log name, tags JSON, command...
  local name="$1" tags="$2"; shift 2
  echo "== $name" >&2
  if BENCH_TAGS="$tags" "$@" 2> "$PEERS_WORK/$name.log" | tee -a "$OUT"; then :; else
    echo "   failed: see $PEERS_WORK/$name.log" >&2
  fi
}

for model in $MODELS; do
  case "$model" in
    llama1b-*)
      [ -f "$(model_file "$model")" ] || "$PY" "$ROOT/benchmarks/make_llama1b.py" --out "$MODELS_DIR"
      n="${LARGE_REQUESTS:-32}"; n_llama="${LLAMACPP_REQUESTS:-8}"; tokenizer="" ;;
    gemma3) n="${NUM_REQUESTS:-200}"; n_llama="${LLAMACPP_REQUESTS:-50}"; tokenizer="gemma3" ;;
    *) n="${NUM_REQUESTS:-200}"; n_llama="${LLAMACPP_REQUESTS:-50}"; tokenizer="" ;;
  esac
  gguf="$(model_file "$model")"
  workload="$PEERS_WORK/workload-${tokenizer:-smollm2}.json"
  [ -f "$workload" ] || "$PY" "$ROOT/benchmarks/workload.py" --out "$workload" \
    ${tokenizer:+--tokenizer "$gguf"}
  common=(--workload "$workload" --threads "$THREADS")
  for round in $(seq 1 "$ROUNDS"); do
    for peer in $PEERS; do
      case "$peer" in
        llamacpp) peer_py=/opt/peers/llamacpp/bin/python ;;
        llamacpp-avx2) peer_py=/opt/peers/llamacpp-avx2/bin/python ;;
        openvino) peer_py=/opt/peers/openvino/bin/python ;;
        vllm) peer_py=/opt/peers/vllm/bin/python ;;
        *) echo "unknown peer $peer" >&2; exit 1 ;;
      esac
      [ -x "$peer_py" ] || { echo "== $peer not installed: skipped" >&2; continue; }
      pair="$model-$round-$peer"
      for setting in $OURS; do
        args=()
        [ "$setting" = int8 ] && args=(--quant-activations int8)
        [ "$setting" = kv8 ] && args=(--kv-cache-dtype int8)
        run "$pair-pagedinfer-$setting" \
          "{\"bench_model\": \"$model\", \"round\": $round, \"pair\": \"$pair\", \"setting\": \"$setting\"}" \
          "$PY" "$ROOT/benchmarks/bench_pagedinfer.py" --model "$gguf" --num-requests "$n" \
          "${common[@]}" "${args[@]}"
      done
      tags="{\"bench_model\": \"$model\", \"round\": $round, \"pair\": \"$pair\", \"setting\": \"$peer\"}"
      case "$peer" in
        llamacpp|llamacpp-avx2) run "$pair" "$tags" "$peer_py" "$ROOT/benchmarks/peers/llamacpp_bench.py" \
                    --model "$gguf" --num-requests "$n_llama" "${common[@]}" ;;
        openvino) run "$pair" "$tags" "$peer_py" "$ROOT/benchmarks/peers/openvino_bench.py" \
                    --model "$gguf" --num-requests "$n" "${common[@]}" ;;
        vllm)
          hf="$MODELS_DIR/$model-bf16"
          [ -f "$hf/config.json" ] || "$PY" -c "import sys, torch; \
from pagedinfer.model.loader import export_hf_dir; \
export_hf_dir(sys.argv[1], sys.argv[2], dtype=torch.bfloat16)" "$gguf" "$hf" >&2
          MODEL_DIR="$hf" THREADS="$THREADS" run "$pair" "$tags" \
            "$ROOT/benchmarks/peers/run_vllm.sh" --num-requests "$n" --workload "$workload" ;;
      esac
    done
  done
done
"$PY" "$ROOT/benchmarks/report.py" "$OUT"
