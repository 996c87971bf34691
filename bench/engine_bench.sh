#!/usr/bin/env bash
# Can one simulated engine hold thousands of concurrent streams on this machine while keeping
# its simulated step time? Starts an engine process and a load process (both the release
# build of crates/levee-engine/examples/engine_bench.rs) and prints a JSON report per config.
#
#   bench/engine_bench.sh [STREAMS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-2000}
SECONDS_=${2:-20}
# Each stream is one TCP connection on each side.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
[ "$(ulimit -n)" -gt $((STREAMS * 2 + 100)) ] || { echo "ulimit -n $(ulimit -n) is too low for $STREAMS streams" >&2; exit 1; }

cargo build --release -p levee-engine --example engine_bench >&2
BIN=target/release/examples/engine_bench
PORT=${PORT:-18431}

ENGINE_PID=
cleanup() { [ -n "$ENGINE_PID" ] && kill "$ENGINE_PID" 2>/dev/null || true; }
trap cleanup EXIT

run() {
  local name=$1; shift
  "$BIN" serve --port "$PORT" --profile a100-7b --max-running-seqs 8192 \
    --kv-capacity-tokens 50000000 --max-model-len 8192 "$@" >/dev/null 2>&1 &
  ENGINE_PID=$!
  for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "== $name ($*)"
  "$BIN" load --url "http://127.0.0.1:$PORT" --streams "$STREAMS" --seconds "$SECONDS_" \
    --engine-pid "$ENGINE_PID"
  kill "$ENGINE_PID"
  wait "$ENGINE_PID" 2>/dev/null || true
  ENGINE_PID=
}

# a100-7b decode cost: 12 ms + 0.1 ms per sequence (212 ms steps at 2,000 streams).
run "a100-7b timing" --decode-base-ms 12 --decode-per-seq-ms 0.1
# A much faster GPU: 20 ms + 0.005 ms per sequence (30 ms steps at 2,000 streams): ~6x the
# token rate, the harder case for the host.
run "fast GPU timing" --decode-base-ms 20 --decode-per-seq-ms 0.005

# What one request costs: the `zero` profile (no simulated delay), closed loop of
# non-streaming chat requests of 16 tokens.
"$BIN" serve --port "$PORT" --profile zero >/dev/null 2>&1 &
ENGINE_PID=$!
for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.1
done
echo "== zero profile, non-streaming requests (64 concurrent, 16 tokens)"
"$BIN" rps --url "http://127.0.0.1:$PORT" --concurrency 64 --seconds 10 --engine-pid "$ENGINE_PID"
kill "$ENGINE_PID"
wait "$ENGINE_PID" 2>/dev/null || true
ENGINE_PID=
