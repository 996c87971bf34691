#!/usr/bin/env bash
# A levee fleet on one machine, with plain processes (no Docker needed): one Redis, two
# simulated engines and three levee replicas sharing their limits through Redis. It prints
# where everything listens, shows the fleet limit holding, and keeps running until Ctrl-C.
#
#   bench/fleet.sh                  # builds target/release/levee first
#   NO_BUILD=1 bench/fleet.sh       # reuse the binary already built
#   REDIS_URL=redis://host:port bench/fleet.sh   # use a Redis you run (else one is started)
#   DEMO=0 bench/fleet.sh           # skip the demonstration flood
#
# Tenant "demo" (key sk-fleet-demo) may send 60 requests per minute with a burst of 20 —
# for the whole fleet, whichever replica it reaches. Needs: cargo, redis-server, curl.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${NO_BUILD:-0}" = 1 ] || cargo build --release -q -p levee
BIN=target/release/levee

TMP=$(mktemp -d /tmp/levee-fleet.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 200); do curl -s -o /dev/null "$1" && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; exit 1; }

if [ -z "${REDIS_URL:-}" ]; then
  command -v redis-server >/dev/null || { echo "redis-server not found: apt-get install -y redis-server (or set REDIS_URL)" >&2; exit 1; }
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$TMP/redis.log" 2>&1 &
  PIDS+=($!)
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
fi

ENGINES=()
for i in 1 2; do
  p=$(free_port)
  "$BIN" engine --port "$p" >"$TMP/engine$i.log" 2>&1 &
  PIDS+=($!)
  ENGINES+=("http://127.0.0.1:$p")
  wait_http "http://127.0.0.1:$p/health"
done

KEY=sk-fleet-demo
KEY_SHA=$(printf %s "$KEY" | sha256sum | cut -d' ' -f1)
PUBLIC=(); ADMIN=()
for i in 1 2 3; do
  pp=$(free_port); ap=$(free_port)
  cat >"$TMP/levee$i.toml" <<TOML
[listen]
public = "127.0.0.1:$pp"
admin = "127.0.0.1:$ap"

[state]
backend = "redis"
url = "$REDIS_URL"
key_prefix = "levee-fleet:"
replica_id = "replica-$i"

[[tenants]]
name = "demo"
tier = "standard"
key_sha256 = ["$KEY_SHA"]
requests_per_minute = 60
requests_burst = 20

[[models]]
name = "levee-sim-7b"
[[models.backends]]
url = "${ENGINES[0]}"
[[models.backends]]
url = "${ENGINES[1]}"
TOML
  "$BIN" serve --config "$TMP/levee$i.toml" >"$TMP/levee$i.log" 2>&1 &
  PIDS+=($!)
  PUBLIC+=("http://127.0.0.1:$pp"); ADMIN+=("http://127.0.0.1:$ap")
  wait_http "http://127.0.0.1:$pp/healthz"
done

echo "Redis:    $REDIS_URL (keys under levee-fleet:)"
echo "engines:  ${ENGINES[*]}"
for i in 0 1 2; do echo "replica $((i + 1)): ${PUBLIC[$i]}   dashboard ${ADMIN[$i]}/"; done
echo "tenant demo, key $KEY: 60 requests/min, burst 20, for the whole fleet"
echo "logs in $TMP"

if [ "${DEMO:-1}" = 1 ]; then
  sleep 1.5 # a heartbeat: every replica has counted its peers
  ok=0; limited=0
  for n in $(seq 1 60); do
    url=${PUBLIC[$((n % 3))]}
    code=$(curl -s -o /dev/null -w '%{http_code}' "$url/v1/chat/completions" \
      -H "authorization: Bearer $KEY" -H 'content-type: application/json' \
      -d '{"model":"levee-sim-7b","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}')
    case $code in 200) ok=$((ok + 1));; 429) limited=$((limited + 1));; *) echo "unexpected HTTP $code" >&2;; esac
  done
  echo "60 requests round-robin over the 3 replicas: $ok admitted, $limited refused (429)"
  echo "(the fleet allows 20 at once plus one per second; in-memory state would allow 20 per replica)"
  curl -s "${ADMIN[0]}/admin/state" | python3 -c 'import json,sys; print("replica 1 state:", json.dumps(json.load(sys.stdin)["state"]))'
fi
echo "running; Ctrl-C stops everything"
wait
