#!/usr/bin/env bash
# Fits levee's simulated engine to a real llama-server and checks the fit, side by side:
#  1. installs llama-server and gemma-3-270m (bench/install-llama.sh) and builds levee;
#  2. starts one llama-server as bench/real-backend.sh starts each of its (4 slots, one
#     thread; see bench/llama-servers.sh);
#  3. `levee sim calibrate` measures it (closed loop at concurrency 1, 2, 4, 8, 16 with
#     unique prompts, TTFT against prompt length, and whether a second prompt sent during
#     a first one's prefill delays the first one's first token) and writes the profile
#     (default: the shipped profiles/llamacpp-gemma3-270m-2core.toml) and the sweep
#     (target/calibrate/, copied beside the profile as PROFILE.sweep.json);
#  4. stops it, starts `levee engine --profile-file` with that profile, runs the same sweep
#     against it with `--compare`: req/s and p50 TTFT side by side, each within 20% or the
#     script fails.
#
#   bench/calibrate-llama.sh [PROFILE_OUT]
#
# The machine's load changes a real server's speed: run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-profiles/llamacpp-gemma3-270m-2core.toml}
OUT=target/calibrate
mkdir -p "$OUT" "$(dirname "$PROFILE")"
source bench/llama-servers.sh
ENGINE_PID=
cleanup() {
  stop_llama_servers
  if [ -n "$ENGINE_PID" ]; then
    kill "$ENGINE_PID" 2>/dev/null || true
    wait "$ENGINE_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT

mapfile -t LLAMA < <(bench/install-llama.sh)
cargo build --release -q -p levee
LEVEE=${CARGO_TARGET_DIR:-target}/release/levee

echo "== real: llama-server (gemma-3-270m, 4 slots, 1 thread)"
start_llama_servers 1 "${LLAMA[0]}" "${LLAMA[1]}" "$OUT"
"$LEVEE" sim calibrate --target "${LLAMA_URLS[0]}" --name llamacpp-gemma3-270m-2core \
  --sweep-json "$OUT/real.json" --out "$PROFILE"
stop_llama_servers
cp "$OUT/real.json" "${PROFILE%.toml}.sweep.json"
sed -i "1i # Produced by bench/calibrate-llama.sh (one llama-server: --parallel 4 --ctx-size 8192 --threads 1)." "$PROFILE"

echo "== fitted: levee engine --profile-file $PROFILE"
PORT=$(free_port)
"$LEVEE" engine --port "$PORT" --profile-file "$PROFILE" >"$OUT/engine.log" 2>&1 &
ENGINE_PID=$!
for ((i = 0; i < 100; i++)); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.1
done
"$LEVEE" sim calibrate --target "http://127.0.0.1:$PORT" --no-prefill \
  --sweep-json "$OUT/fitted.json" --compare "$OUT/real.json"
