#!/usr/bin/env bash
# Offline throughput and batch-1 decode of several models on this checkout, alternated
# round by round (the machine's speed drifts, so models compare only side by side):
#   benchmarks/compare_models.sh [ROUNDS] [DTYPE] [MODEL...]
# Models default to the two shipped ones: SmolLM2-135M-Instruct ("default") and Gemma 3
# 270M ("gemma-3-270m"). Prints the CPU first, then "model round output_tok_s
# b1_decode_tok_s" per run: offline = random 128 -> 64 tokens, 64 prompts; batch-1 decode
# = 128 / average latency of 32 -> 128 tokens.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
ROUNDS="${1:-3}"; DTYPE="${2:-auto}"; shift 2 2>/dev/null || shift $#
MODELS=("$@"); [ ${#MODELS[@]} -eq 0 ] && MODELS=(default gemma-3-270m)
OUT="$(mktemp -d)"
lscpu | grep -E "^(Model name|CPU\(s\)):"
echo "Vector flags: $(grep -m1 -o -wE 'avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for round in $(seq "$ROUNDS"); do
  for model in "${MODELS[@]}"; do
    flag=("$model"); [ "$model" = default ] && flag=()
    (cd "$ROOT" && "$PY" -m pagedinfer.entrypoints.cli bench throughput "${flag[@]}" \
      --dtype "$DTYPE" --dataset-name random --random-input-len 128 --random-output-len 64 \
      --num-prompts 64 --ignore-eos --disable-tqdm --output-json "$OUT/tp.json" >/dev/null 2>&1)
    (cd "$ROOT" && "$PY" -m pagedinfer.entrypoints.cli bench latency "${flag[@]}" \
      --dtype "$DTYPE" --batch-size 1 --input-len 32 --output-len 128 --num-iters-warmup 2 \
      --num-iters 5 --disable-tqdm --output-json "$OUT/lat.json" >/dev/null 2>&1)
    "$PY" -c 'import json, sys
tp = json.load(open(sys.argv[3] + "/tp.json")); lat = json.load(open(sys.argv[3] + "/lat.json"))
print(sys.argv[1], sys.argv[2], round(tp["output_tokens_per_second"], 1),
      round(128 / lat["avg_latency"], 1), flush=True)' "$model" "$round" "$OUT"
  done
done
rm -rf "$OUT"
