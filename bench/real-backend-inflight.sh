#!/usr/bin/env bash
# How full levee keeps two real llama-servers in bench/real-backend.sh's flood: starts two
# fresh llama-servers (4 slots, one CPU thread each; the why is in bench/llama-servers.sh),
# `levee serve` with the configuration bench/real-backend.sh derived on this machine
# (target/real-backend/gateway.toml, its backend URLs replaced by the new servers'), floods
# it with bench/real-backend-flood.toml through `levee sim`, and reads levee's admin
# /metrics every 100 ms (`levee_in_flight`, `levee_queued`). Prints the distribution of
# requests in flight over the flood's 5x stretch (10 s to 40 s of the scenario), its mean
# against the servers' 8 slots, and how often a slot was free while nothing was queued.
# Every process it starts is killed at the end. About 2 minutes.
#
#   bench/real-backend.sh && bench/real-backend-inflight.sh
#
# LEVEE=path/to/levee uses that binary instead of target/release/levee; CONFIG=FILE another
# derived configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=target/real-backend-inflight
CONFIG=${CONFIG:-target/real-backend/gateway.toml}
LEVEE=${LEVEE:-${CARGO_TARGET_DIR:-target}/release/levee}
if [ ! -f "$CONFIG" ]; then
  echo "no $CONFIG: run bench/real-backend.sh first (it derives the configuration)" >&2
  exit 1
fi
mkdir -p "$OUT"
source bench/llama-servers.sh
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  stop_llama_servers
}
trap cleanup EXIT

mapfile -t LLAMA < <(bench/install-llama.sh)
start_llama_servers 2 "${LLAMA[0]}" "${LLAMA[1]}" "$OUT"
PUBLIC=$(free_port)
ADMIN=$(free_port)
python3 - "$CONFIG" "$OUT/gateway.toml" "$PUBLIC" "$ADMIN" "${LLAMA_URLS[@]}" <<'PY'
import re, sys
src, dst, public, admin, *urls = sys.argv[1:]
text = open(src).read()
text = re.sub(r'public = "[^"]*"', f'public = "127.0.0.1:{public}"', text, count=1)
text = re.sub(r'admin = "[^"]*"', f'admin = "127.0.0.1:{admin}"', text, count=1)
found = iter(urls)
text = re.sub(r'url = "[^"]*"', lambda m: f'url = "{next(found)}"', text)
open(dst, "w").write(text)
PY
"$LEVEE" serve --config "$OUT/gateway.toml" > "$OUT/levee.log" 2>&1 &
PIDS+=($!)
for ((i = 0; i < 100; i++)); do
  curl -sf "http://127.0.0.1:$PUBLIC/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
(
  for ((i = 0; i < 800; i++)); do
    echo "T $(date +%s.%N)"
    curl -s "http://127.0.0.1:$ADMIN/metrics" | grep -E '^levee_(in_flight|queued) ' || true
    sleep 0.1
  done
) > "$OUT/samples.txt" &
PIDS+=($!)
START=$(date +%s.%N)
"$LEVEE" sim bench/real-backend-flood.toml --target "http://127.0.0.1:$PUBLIC" \
  --out "$OUT/sim" > "$OUT/sim.txt" 2>&1
python3 - "$OUT/samples.txt" "$START" <<'PY'
import collections, sys
path, start = sys.argv[1], float(sys.argv[2])
rows, cur = [], None
for line in open(path):
    if line.startswith("T "):
        cur = {"t": float(line.split()[1]) - start}
        rows.append(cur)
    elif cur is not None:
        name, value = line.split()
        cur[name] = float(value)
flood = [r for r in rows if 10 <= r["t"] <= 40 and "levee_in_flight" in r]
if not flood:
    sys.exit("no samples in the flood stretch")
counts = collections.Counter(int(r["levee_in_flight"]) for r in flood)
mean = sum(r["levee_in_flight"] for r in flood) / len(flood)
idle = sum(1 for r in flood if r["levee_in_flight"] < 8 and r.get("levee_queued", 0) == 0)
print(f"samples in the flood (10-40 s): {len(flood)}")
print("in flight: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
print(f"mean in flight: {mean:.2f} of 8 slots")
print(f"a slot free and nothing queued: {100 * idle / len(flood):.0f}% of samples")
PY
echo "sim summary: $OUT/sim.txt; samples: $OUT/samples.txt"
