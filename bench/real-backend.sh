#!/usr/bin/env bash
# levee in front of real inference servers, from a clean clone:
#  1. installs llama-server and gemma-3-270m (bench/install-llama.sh: a ~10 minute build the
#     first time) and builds levee (release);
#  2. starts two llama-servers on free loopback ports, 4 slots and one CPU thread each (the
#     why is in bench/llama-servers.sh);
#  3. `levee drill --calibrate-config` against them (--backend): measures their capacity on
#     THIS machine by the drill's own method (a low-rate sample for the servers' prompt
#     sizes, then open-loop steps of rising rate through the competent capped proxy, the
#     flood's request mix, no retries; the knee is the mean goodput of two repeats of the
#     best step on other arrival seeds) and derives levee's configuration from it
#     by the formula in crates/levee-drill/drill-gateway.toml's comments, written to
#     target/real-backend/gateway.toml;
#  4. `levee drill` with that configuration: measures the knee again, then floods the
#     servers with bench/real-backend-flood.toml (5x the knee for 30 s, naive retries)
#     through every contender: unprotected round-robin, the capped pass-through, HAProxy
#     (when installed) and levee; prints the side-by-side table and the verdicts (goodput
#     >= 90% of the knee, premium >= 99.9%, 0 crashes).
# Every process it starts is killed at the end (by PID). About 15 to 25 minutes after the
# build. Reports in target/real-backend/.
#
#   bench/real-backend.sh [--quick] [more levee drill options]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=target/real-backend
mkdir -p "$OUT"
source bench/llama-servers.sh
trap stop_llama_servers EXIT

mapfile -t LLAMA < <(bench/install-llama.sh)
cargo build --release -q -p levee

start_llama_servers 2 "${LLAMA[0]}" "${LLAMA[1]}" "$OUT"
echo "llama-servers: ${LLAMA_URLS[*]} (logs in $OUT)"
BACKENDS=()
for url in "${LLAMA_URLS[@]}"; do
  BACKENDS+=(--backend "$url")
done
LEVEE="${CARGO_TARGET_DIR:-target}/release/levee"
COMMON=(--scenario bench/real-backend-flood.toml
        --backend-profile profiles/llamacpp-gemma3-270m-2core.toml "${BACKENDS[@]}")
# Bounds on each step: the drill stops by itself, these only guard against a hang.
timeout 1800 "$LEVEE" drill --calibrate-config "${COMMON[@]}" --out "$OUT/calibrate" \
  > "$OUT/gateway.toml"
echo "levee's configuration for these servers, derived on this machine: $OUT/gateway.toml"
timeout 2400 "$LEVEE" drill "${COMMON[@]}" \
  --gateway-config "$OUT/gateway.toml" \
  --goodput-target 0.90 \
  --out "$OUT" "$@"
