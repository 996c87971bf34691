#!/usr/bin/env bash
# User-space instructions per proxied request, counted by valgrind (callgrind): levee (and a
# second build, "base") against the bare hyper proxy (examples/bare_proxy.rs: the stack levee
# is built on, nothing else) and nginx, in front of the same `levee engine --profile zero`. A
# figure host noise does not move, for the part of a request's cost that is the proxy's own
# code (the kernel's part, about half of levee's CPU per request and most of nginx's, is not
# counted: bench/gateway-overhead.sh measures the whole).
#
#   bench/gateway-instructions.sh                        # levee (target/release), bare, nginx
#   LEVEE_BASE=/path/to/levee bench/gateway-instructions.sh
#   PROFILES=dir bench/gateway-instructions.sh      # keep each proxy's profile there, to read
#                                                   # with callgrind_annotate --inclusive=yes
#
# Each proxy runs alone under callgrind (one worker thread's worth of speed: about 50 times
# slower), takes 500 requests to warm up at 100/s, then its counters are zeroed and 2,000
# more are sent at 100/s; the instructions counted over those, per request, are printed.
# Periodic work (scrapes, recomputations) is counted too, spread over 100 requests a second
# where a real load spreads it over thousands. Needs valgrind and nginx (apt-get install -y
# valgrind nginx) and release builds (cargo build --release -p levee && cargo build --release
# -p levee-gateway --example loadgen --example bare_proxy). About three minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/levee
LOADGEN=target/release/examples/loadgen
BARE=target/release/examples/bare_proxy
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
for t in valgrind callgrind_control callgrind_annotate; do
  command -v $t >/dev/null || { echo "$t not found: apt-get install -y valgrind" >&2; exit 1; }
done
[ -x "$NGINX" ] || { echo "nginx not found: apt-get install -y nginx" >&2; exit 1; }
[ -x "$BIN" ] && [ -x "$LOADGEN" ] && [ -x "$BARE" ] || { echo "build first: cargo build --release -p levee && cargo build --release -p levee-gateway --example loadgen --example bare_proxy" >&2; exit 1; }
[ -z "${LEVEE_BASE:-}" ] || [ -x "$LEVEE_BASE" ] || { echo "LEVEE_BASE=$LEVEE_BASE is not an executable" >&2; exit 1; }

TMP=$(mktemp -d /tmp/levee-instr.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 400); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "timeout waiting for $1" >&2; exit 1; }
KEY=sk-bench
KEY_SHA=$(printf %s "$KEY" | sha256sum | cut -d' ' -f1)
ENGINE_PORT=$(free_port)
"$BIN" engine --port "$ENGINE_PORT" --profile zero >"$TMP/engine.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ENGINE_PORT/health"

# $1 label, $2 url of the proxy, $3 pid of callgrind's process: warm up, zero, count, dump.
count() {
  "$LOADGEN" --url "$2/v1/chat/completions" --rate 100 --count 500 --warmup-secs 0 --timeout-secs 120 --key "$KEY" >/dev/null
  callgrind_control -z "$3" >/dev/null 2>&1
  "$LOADGEN" --url "$2/v1/chat/completions" --rate 100 --count 2000 --warmup-secs 0 --timeout-secs 120 --key "$KEY" >"$TMP/$1.json"
  callgrind_control -d "$3" >/dev/null 2>&1
  local ir ok
  ir=$(callgrind_annotate "$TMP/$1.out.1" 2>/dev/null | awk '/PROGRAM TOTALS/{gsub(",","",$1); print $1}')
  ok=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ok'])" "$TMP/$1.json")
  [ "$ok" -gt 0 ] || { echo "$1: no request answered" >&2; exit 1; }
  [ -z "${PROFILES:-}" ] || { mkdir -p "$PROFILES" && cp "$TMP/$1.out.1" "$PROFILES/$1.callgrind"; }
  printf '%-6s %9s instructions per request (%s requests answered 200)\n' "$1" \
    "$(python3 -c "import sys; print(f'{int(sys.argv[1])//int(sys.argv[2]):,}')" "$ir" "$ok")" "$ok"
}

levee() { # $1 label, $2 binary
  local port admin
  port=$(free_port); admin=$(free_port)
  cat >"$TMP/$1.toml" <<TOML
[listen]
public = "127.0.0.1:$port"
admin = "127.0.0.1:$admin"
[server]
max_connections_per_ip = 0
[ip_guard]
enabled = false
[tiers.standard]
priority = 0
[[tenants]]
name = "bench"
tier = "standard"
key_sha256 = ["$KEY_SHA"]
[[models]]
name = "levee-sim-7b"
[[models.backends]]
url = "http://127.0.0.1:$ENGINE_PORT"
max_in_flight = 4096
[degrade]
enabled = false
TOML
  env RUST_LOG=warn valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$TMP/$1.out" \
    "$2" serve --config "$TMP/$1.toml" >"$TMP/$1.log" 2>&1 &
  local pid=$!
  PIDS+=($pid)
  wait_http "http://127.0.0.1:$port/healthz"
  count "$1" "http://127.0.0.1:$port" "$pid"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

levee levee "$BIN"
[ -z "${LEVEE_BASE:-}" ] || levee base "$LEVEE_BASE"

# The floor: hyper and tokio alone (examples/bare_proxy.rs).
BARE_PORT=$(free_port)
valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$TMP/bare.out" \
  "$BARE" --listen "127.0.0.1:$BARE_PORT" --upstream "http://127.0.0.1:$ENGINE_PORT" >"$TMP/bare.log" 2>&1 &
BARE_PID=$!
PIDS+=($BARE_PID)
wait_http "http://127.0.0.1:$BARE_PORT/v1/models"
count bare "http://127.0.0.1:$BARE_PORT" "$BARE_PID"
kill "$BARE_PID"; wait "$BARE_PID" 2>/dev/null || true

NGINX_PORT=$(free_port)
mkdir -p "$TMP/nginx"
cat >"$TMP/nginx.conf" <<NGINX
worker_processes 1;
master_process off;
daemon off;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/body;
  proxy_temp_path $TMP/nginx/proxy;
  upstream engine { server 127.0.0.1:$ENGINE_PORT; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$TMP/nginx.out" \
  "$NGINX" -c "$TMP/nginx.conf" >"$TMP/nginx.log" 2>&1 &
NPID=$!
PIDS+=($NPID)
wait_http "http://127.0.0.1:$NGINX_PORT/health"
count nginx "http://127.0.0.1:$NGINX_PORT" "$NPID"
