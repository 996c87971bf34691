#!/usr/bin/env bash
# levee sim beside Debian's wrk, against the same trivial endpoint, in one run.
#
#   bash bench/sim-vs-wrk.sh                # 20 000 req/s for 10 s
#   RATES="10000 20000 30000" bash bench/sim-vs-wrk.sh
#
# wrk is closed loop (64 connections, as fast as answers come back): it gives the
# endpoint's ceiling on this machine. levee sim is open loop at each fixed rate: the figures
# that matter are achieved vs offered rate and the schedule lag (how late sends were).
# The server, wrk and the simulator share the machine's 2 cores; the server gets 1 thread.
# All traffic goes to 127.0.0.1; every run is bounded by DURATION.
set -euo pipefail
cd "$(dirname "$0")/.."

RATES=${RATES:-20000}
# Both tools run 10 s: the simulator's duration comes from bench/sim-20k.toml.
DURATION=10
PORT=${PORT:-18080}
URL="http://127.0.0.1:${PORT}"
OUT=${OUT:-target/bench-sim}
mkdir -p "$OUT"

if ! command -v wrk >/dev/null; then
  apt-get install -y wrk >/dev/null || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }
fi
# Two commands: --example would restrict a combined build to examples only.
cargo build --release -q -p levee --bin levee
cargo build --release -q -p levee-sim --example trivial_server
SERVER=target/release/examples/trivial_server
LEVEE=target/release/levee

"$SERVER" "127.0.0.1:${PORT}" 1 > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q listening "$OUT/server.log" 2>/dev/null && break; sleep 0.1; done
grep -q listening "$OUT/server.log" || { echo "trivial_server did not start"; cat "$OUT/server.log"; exit 1; }

# Same request body as the simulator sends for bench/sim-20k.toml.
PROMPT=$(printf 'tok %.0s' $(seq 16)); PROMPT=${PROMPT% }
cat > "$OUT/post.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.body = '{"model":"levee-sim-7b","messages":[{"role":"user","content":"${PROMPT}"}],"max_tokens":1,"stream":false}'
LUA

echo "== machine: $(nproc) cores; $(date -u +%FT%TZ); git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
# Other work on the machine steals the cores these tools need: print the load first.
echo "== wrk (closed loop, 1 thread, 64 connections, ${DURATION}s); load: $(cut -d' ' -f1-3 /proc/loadavg)"
wrk -t1 -c64 -d"${DURATION}s" --latency -s "$OUT/post.lua" "$URL/v1/chat/completions" | tee "$OUT/wrk.txt"

# CPU and memory of the simulator itself, when GNU time is there.
TIME=()
if [ -x /usr/bin/time ]; then TIME=(/usr/bin/time -f "sim cost: user %U s, sys %S s, max RSS %M kB"); fi

for RATE in $RATES; do
  echo "== levee sim (open loop, Poisson, ${RATE} req/s, ${DURATION}s); load: $(cut -d' ' -f1-3 /proc/loadavg)"
  "${TIME[@]}" "$LEVEE" sim bench/sim-20k.toml --target "$URL" --capacity-rps "$RATE" --quiet \
    --out "$OUT/sim-$RATE" --drain-s 5 \
    2>&1 | tee "$OUT/sim-$RATE.txt"
done
