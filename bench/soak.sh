#!/usr/bin/env bash
# The soak (issue 22): a bounded mixed flood of well-behaved and hostile clients for
# SOAK_SECONDS (default 600 s = 10 min) against levee in front of two simulated engines
# (tiny-fast profile, 8 sequences each), with quotas and watermarks small enough that
# every kind of refusal happens. The flood (bench/soak_flood.py) mixes: plain and
# streamed chats, streams the client cuts after the first event, clients that leave before
# the answer head, unknown keys, malformed bodies, n = 100000, 200 levels of nesting,
# bodies that never finish (408 after 1 s), a premium tenant, and connections that send
# nothing or only the h2c preface. It samples levee's RSS, descriptors, open connections,
# in-flight and queued requests every SAMPLE_S seconds, waits for levee to go idle, and
# checks: every request sent has exactly one outcome in levee_requests_total, the client's
# served + refused + rejected + failed + left = sent, in flight / queued / open connections
# back to 0, descriptors back to their baseline, RSS flat. Exit 1 when a check fails; the
# report is target/soak/report.json.
#
#   bench/soak.sh          # SOAK_SECONDS=600 RATE=150 SAMPLE_S=30 LEVEE_BIN=target/debug/levee
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LEVEE_BIN:-target/debug/levee}
SOAK_SECONDS=${SOAK_SECONDS:-600}
RATE=${RATE:-150}
SAMPLE_S=${SAMPLE_S:-30}
OUT=${OUT:-target/soak}
[ -x "$BIN" ] || { echo "no levee binary at $BIN (cargo build -p levee)" >&2; exit 1; }
mkdir -p "$OUT"

TMP=$(mktemp -d /tmp/levee-soak.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 400); do curl -s -o /dev/null "$1" && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; exit 1; }

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
[server]
body_read_timeout_ms = 1000
header_read_timeout_ms = 2000
idle_timeout_ms = 5000
max_connections_per_ip = 0      # every client of the soak is 127.0.0.1
[scrape]
interval_ms = 500
[queue]
safe = 8
soft = 24
hard = 48
[degrade]
enabled = true
[[tenants]]
name = "acme"
tier = "standard"
requests_per_minute = 3000
key_sha256 = ["$(sha sk-soak-acme)"]
[[tenants]]
name = "globex"
tier = "standard"
requests_per_minute = 1200
key_sha256 = ["$(sha sk-soak-globex)"]
[[tenants]]
name = "initech"
tier = "premium"
key_sha256 = ["$(sha sk-soak-initech)"]
[[models]]
name = "m"
max_context_tokens = 4096
[[models.backends]]
url = "http://127.0.0.1:$E0"
max_in_flight = 8
[[models.backends]]
url = "http://127.0.0.1:$E1"
max_in_flight = 8
TOML
"$BIN" config check "$TMP/levee.toml" >/dev/null
"$BIN" serve --config "$TMP/levee.toml" >"$TMP/levee.log" 2>&1 &
LEVEE_PID=$!
PIDS+=("$LEVEE_PID")
wait_http "http://127.0.0.1:$PUB/healthz"
wait_http "http://127.0.0.1:$E0/health"
wait_http "http://127.0.0.1:$E1/health"

echo "soak: ${SOAK_SECONDS}s at ${RATE}/s offered, levee pid $LEVEE_PID ($BIN)" >&2
set +e
python3 bench/soak_flood.py --target "127.0.0.1:$PUB" --admin "http://127.0.0.1:$ADM" \
  --pid "$LEVEE_PID" --keys sk-soak-acme,sk-soak-globex --premium-key sk-soak-initech \
  --rate "$RATE" --seconds "$SOAK_SECONDS" --sample "$SAMPLE_S" >"$OUT/report.json"
rc=$?
set -e
curl -s "http://127.0.0.1:$ADM/metrics" >"$OUT/metrics.txt"
python3 - "$OUT/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"sent {r['sent']} in {r['duration_s']} s (skipped at the client cap: {r['skipped_at_client_cap']}); "
      f"levee_requests_total +{r['levee_requests_total']:.0f}")
print("client view:", r["client_view"])
print("levee outcomes:", {k: int(v) for k, v in sorted(r["levee_outcomes"].items())})
print("RSS MB:", r["rss_mb"], " descriptors:", r["fds"], " end:", r["end_state"])
for k, ok in r["checks"].items():
    print(("PASS " if ok else "FAIL ") + k)
PY
exit $rc
