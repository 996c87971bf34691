#!/usr/bin/env bash
# Does the replica recommendation lead the queue? Two simulated engines (tiny-fast profile,
# 8 sequences each) behind levee (max_in_flight 8 per backend, so 2 replicas of 8 slots),
# flooded by scenarios/slow-ramp.toml (0.2x -> 2x capacity over 120 s) while levee sim
# scrapes the gateway's levee_recommended_replicas and levee_queued every 500 ms.
# CAPACITY_RPS (what "1x" means) is the pair's measured goodput, about 40 req/s here.
# Prints when the recommendation first asked for more than the 2 running replicas and when
# the queue first held more than QUEUE_MARK requests (sustained over 2 s).
#
#   bench/slow-ramp.sh                # CAPACITY_RPS=40 TIME_SCALE=1 LEVEE_BIN=target/release/levee
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LEVEE_BIN:-target/release/levee}
CAPACITY_RPS=${CAPACITY_RPS:-40}
TIME_SCALE=${TIME_SCALE:-1}
QUEUE_MARK=${QUEUE_MARK:-8}
[ -x "$BIN" ] || { echo "no levee binary at $BIN (cargo build --release -p levee)" >&2; exit 1; }

TMP=$(mktemp -d /tmp/levee-ramp.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 200); do curl -s -o /dev/null "$1" && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; exit 1; }

E0=$(free_port); E1=$(free_port); PUB=$(free_port); ADM=$(free_port)
for p in "$E0" "$E1"; do
  "$BIN" engine --port "$p" --profile tiny-fast --model m >"$TMP/engine-$p.log" 2>&1 &
  PIDS+=($!)
done
sha() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
cat >"$TMP/levee.toml" <<TOML
[listen]
public = "127.0.0.1:$PUB"
admin = "127.0.0.1:$ADM"
[scrape]
interval_ms = 500
[[tenants]]
name = "acme"
tier = "standard"
key_sha256 = ["$(sha sk-ramp-acme)"]
[[tenants]]
name = "globex"
tier = "standard"
key_sha256 = ["$(sha sk-ramp-globex)"]
[[models]]
name = "m"
[[models.backends]]
url = "http://127.0.0.1:$E0"
max_in_flight = 8
[[models.backends]]
url = "http://127.0.0.1:$E1"
max_in_flight = 8
[autoscale]
min_replicas = 1
max_replicas = 16
warm_pool = 0
window_ms = 5000
TOML
"$BIN" serve --config "$TMP/levee.toml" >"$TMP/levee.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$E0/health"; wait_http "http://127.0.0.1:$E1/health"
wait_http "http://127.0.0.1:$PUB/healthz"

"$BIN" sim scenarios/slow-ramp.toml --target "http://127.0.0.1:$PUB" --model m \
  --capacity-rps "$CAPACITY_RPS" --time-scale "$TIME_SCALE" \
  --metrics "gateway=http://127.0.0.1:$ADM/metrics" --out "$TMP/report" --quiet

python3 - "$TMP/report/report.json" "$QUEUE_MARK" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); mark = float(sys.argv[2])
series = {m["name"]: m["points"] for m in r["metrics"] if m["source"] == "gateway"}
rec, queued = series["levee_recommended_replicas"], series["levee_queued"]
first_rec = next((t for t, v in rec if v > 2), None)
first_q = None
for i, (t, v) in enumerate(queued):
    window = [w for tt, w in queued[i:] if tt <= t + 2.0]
    if v > mark and all(w > mark for w in window):
        first_q = t; break
def at(points, t):
    return max((v for tt, v in points if tt <= t), default=0) if t is not None else None
print(f"recommendation > 2 replicas first at  t = {first_rec} s")
print(f"queue > {mark:g} (for 2 s) first at        t = {first_q} s")
if first_rec is not None and first_q is not None:
    print(f"lead: {first_q - first_rec:.1f} s")
print("recommended replicas by 10 s:", [int(at(rec, t)) for t in range(10, int(rec[-1][0]) + 1, 10)])
print("queued (max) by 10 s:       ", [int(max([v for tt, v in queued if t - 10 < tt <= t] or [0])) for t in range(10, int(queued[-1][0]) + 1, 10)])
if first_q is not None:
    print(f"recommended when the queue formed: {at(rec, first_q):g}")
PY
