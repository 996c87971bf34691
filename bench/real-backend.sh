#!/usr/bin/env bash
# levee in front of real inference servers, from a clean clone:
#  1. installs llama-server and gemma-3-270m (bench/install-llama.sh: a ~10 minute build the
#     first time) and builds levee (release);
#  2. starts two llama-servers on free loopback ports, 4 slots and one CPU thread each (the
#     why is in bench/llama-servers.sh);
#  3. `levee drill` against them (--backend): measures their capacity WITHOUT levee
#     (open-loop steps of rising rate through a plain round-robin proxy, the flood's request
#     mix, no retries; the knee is the best goodput), then floods them with
#     bench/real-backend-flood.toml (5x the knee for 30 s, naive retries) three times:
#     unprotected round-robin, a capped pass-through (4 per server + FIFO queue), and levee
#     configured by bench/real-backend-gateway.toml; prints the side-by-side table and the
#     verdicts (goodput >= 90% of the knee, premium >= 99.9%, 0 crashes).
# Every process it starts is killed at the end (by PID). About 6 to 10 minutes after the
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
# A bound on the whole run: the drill stops by itself, this only guards against a hang.
timeout 1800 "${CARGO_TARGET_DIR:-target}/release/levee" drill \
  --scenario bench/real-backend-flood.toml \
  --gateway-config bench/real-backend-gateway.toml \
  --backend-profile profiles/llamacpp-gemma3-270m-2core.toml \
  --goodput-target 0.90 \
  "${BACKENDS[@]}" --out "$OUT" "$@"
