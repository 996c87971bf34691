#!/usr/bin/env bash
# Gateway overhead, side by side in one run, on loopback:
#   direct  : loadgen -> levee engine (zero profile)
#   levee   : loadgen -> levee serve -> engine
#   bare    : loadgen -> bare_proxy (hyper's server and pooled client on tokio, nothing
#             else: the floor of the stack levee is built on) -> engine
#   nginx   : loadgen -> nginx (plain reverse proxy, keep-alive upstream) -> engine
# at 1k and 5k requests/s (open loop, fixed rate; latency measured from each request's due
# time). Each round's added p99 is also printed beside the CPU the hypervisor took from the
# machine meanwhile and the load generator's own worst lag, so that a round slow for the
# machine is told apart from a round slow for a proxy. Then RSS of levee with 10k requests
# queued.
#
#   bench/gateway-overhead.sh            # SECS=5 ROUNDS=3 RATES="1000 5000" by default
#   RSS_H2=1 ...                          # queue the 10k requests over h2c instead of HTTP/1.1
#   ONLY_RSS=1 / NO_BUILD=1               # skip the latency runs / the cargo build
#   LEVEE_WORKERS=1                       # levee's tokio worker threads (default: one per core)
#   LEVEE_EVENT_LOOPS=2                   # levee (and a base that knows the option) on that many
#                                         # single-threaded event loops (`serve --event-loops`)
#   SYSCALLS=1                            # also count each proxy's system calls and context
#                                         # switches per request (perf stat on the syscall
#                                         # tracepoints: apt-get install -y linux-perf, as root)
#   LEVEE_BASE=/path/to/levee             # also a second levee from another build ("base"),
#                                         # interleaved in the same rounds: before/after
#
# Needs: cargo, nginx (apt-get install -y nginx). Builds release binaries first.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-5}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-2}
RATES=${RATES:-"1000 5000"}
QUEUED=${QUEUED:-10000}
ulimit -n 65536 2>/dev/null || ulimit -n 16384 || true

# NO_BUILD=1 reuses the binaries already in target/release.
# Two builds: `--example` alone selects only the example, not levee's binary.
[ "${NO_BUILD:-0}" = 1 ] || { cargo build --release -q -p levee && cargo build --release -q -p levee-gateway --example loadgen --example bare_proxy; }
BIN=target/release/levee
BASE_BIN=${LEVEE_BASE:-}
[ -z "$BASE_BIN" ] || [ -x "$BASE_BIN" ] || { echo "LEVEE_BASE=$BASE_BIN is not an executable" >&2; exit 1; }
LOADGEN=target/release/examples/loadgen
BARE=target/release/examples/bare_proxy
[ -x "$BARE" ] || { echo "$BARE not built: cargo build --release -p levee-gateway --example bare_proxy" >&2; exit 1; }
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "nginx not found: apt-get install -y nginx" >&2; exit 1; }

TMP=$(mktemp -d /tmp/levee-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 200); do curl -s -o /dev/null "$1" && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; exit 1; }

ENGINE_PORT=$(free_port); LEVEE_PORT=$(free_port); ADMIN_PORT=$(free_port); NGINX_PORT=$(free_port)
BARE_PORT=$(free_port)
BASE_PORT=$(free_port); BASE_ADMIN_PORT=$(free_port)
KEY=sk-bench
KEY_SHA=$(printf %s "$KEY" | sha256sum | cut -d' ' -f1)

"$BIN" engine --port "$ENGINE_PORT" --profile zero >"$TMP/engine.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ENGINE_PORT/health"

# A base build from before the connection caps does not know `[server]
# max_connections_per_ip`: its configuration leaves that block out (it has no per-IP cap).
fit_base_config() { # $1 = file
  "$BASE_BIN" config check "$1" >/dev/null 2>&1 || sed -i '/^\[server\]/,+1d' "$1"
}

write_levee_config() { # $1 = max_in_flight, $2 = hard watermark, $3 = queue wait ms [$4 public port, $5 admin port, $6 file]
cat >"${6:-$TMP/levee.toml}" <<TOML
[listen]
public = "127.0.0.1:${4:-$LEVEE_PORT}"
admin = "127.0.0.1:${5:-$ADMIN_PORT}"
[server]
max_connections_per_ip = 0      # every connection of the bench comes from 127.0.0.1
[ip_guard]
enabled = false
[tiers.standard]
priority = 0
queue_wait_ms = $3
soft_queue_wait_ms = $3
[[tenants]]
name = "bench"
tier = "standard"
key_sha256 = ["$KEY_SHA"]
[[models]]
name = "levee-sim-7b"
[[models.backends]]
url = "http://127.0.0.1:$ENGINE_PORT"
max_in_flight = $1
[queue]
safe = $(( $2 / 2 ))
soft = $(( $2 - 1 ))
hard = $2
[degrade]
enabled = false
TOML
}

start_levee() {
  env RUST_LOG=warn ${LEVEE_WORKERS:+TOKIO_WORKER_THREADS=$LEVEE_WORKERS} "$BIN" serve --config "$TMP/levee.toml" >"$TMP/levee.log" 2>&1 &
  LEVEE_PID=$!
  PIDS+=($LEVEE_PID)
  wait_http "http://127.0.0.1:$LEVEE_PORT/healthz"
}

write_levee_config 4096 100000 30000
start_levee
if [ -n "$BASE_BIN" ]; then
  write_levee_config 4096 100000 30000 "$BASE_PORT" "$BASE_ADMIN_PORT" "$TMP/base.toml"
  fit_base_config "$TMP/base.toml"
  env RUST_LOG=warn ${LEVEE_WORKERS:+TOKIO_WORKER_THREADS=$LEVEE_WORKERS} "$BASE_BIN" serve --config "$TMP/base.toml" >"$TMP/base.log" 2>&1 &
  BASE_PID=$!
  PIDS+=($BASE_PID)
  wait_http "http://127.0.0.1:$BASE_PORT/healthz"
fi

cat >"$TMP/nginx.conf" <<NGINX
worker_processes auto;
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx-body;
  proxy_temp_path $TMP/nginx-proxy;
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
"$NGINX" -c "$TMP/nginx.conf" -g 'daemon off;' >"$TMP/nginx.log" 2>&1 &
NGINX_PID=$!
PIDS+=($NGINX_PID)
"$BARE" --listen "127.0.0.1:$BARE_PORT" --upstream "http://127.0.0.1:$ENGINE_PORT" >"$TMP/bare.log" 2>&1 &
BARE_PID=$!
PIDS+=($BARE_PID)
sleep 0.3

# CPU ticks (1/100 s) used so far by processes (all their threads): "user system".
ticks() {
  local u=0 s=0 pu ps
  for p in "$@"; do
    read -r pu ps < <(awk '{print $14, $15}' /proc/$p/stat 2>/dev/null || echo 0 0)
    u=$(( u + pu )); s=$(( s + ps ))
  done
  echo "$u $s"
}
proxy_pids() { # $1 target -> the proxy's pids (none for direct)
  case $1 in
    levee) echo "$LEVEE_PID" ;;
    base) echo "$BASE_PID" ;;
    bare) echo "$BARE_PID" ;;
    nginx) echo "$NGINX_PID $(pgrep -P "$NGINX_PID" | tr '\n' ' ')" ;;
  esac
}
# CPU ticks (1/100 s) the hypervisor took from this machine so far, all cores (the `steal`
# column of /proc/stat; 0 on bare metal).
stolen() { awk '/^cpu /{print $9}' /proc/stat; }
run() { # $1 name $2 url $3 rate $4 round
  local out pids t0 t1 st0 st1
  pids=$(proxy_pids "$1")
  t0=$(ticks $pids)
  st0=$(stolen)
  local load=("$LOADGEN" --url "$2/v1/chat/completions" --rate "$3" --secs "$SECS" --warmup-secs "$WARMUP" --key "$KEY")
  rm -f "$TMP/perf.csv"
  if [ "${SYSCALLS:-0}" = 1 ] && [ -n "$pids" ]; then
    local pid_list
    pid_list=$(echo $pids | tr ' ' ',')
    out=$(perf stat -x, -o "$TMP/perf.csv" -e "$PERF_EVENTS" -p "$pid_list" -- "${load[@]}")
  else
    out=$("${load[@]}")
  fi
  t1=$(ticks $pids)
  st1=$(stolen)
  # CPU microseconds per request spent in the proxy (0 for direct): in all, in user space
  # and in the kernel. And the milliseconds of CPU the hypervisor took meanwhile.
  out=$(python3 -c "
import json, sys
d = json.loads(sys.argv[1]); n = $3 * ($SECS + $WARMUP)
(u0, s0), (u1, s1) = [map(int, t.split()) for t in sys.argv[2:4]]
d['stolen_ms'] = ($st1 - $st0) * 10
d['proxy_user_us_per_req'] = (u1 - u0) * 10000.0 / n
d['proxy_sys_us_per_req'] = (s1 - s0) * 10000.0 / n
d['proxy_cpu_us_per_req'] = d['proxy_user_us_per_req'] + d['proxy_sys_us_per_req']
try:
    for line in open(sys.argv[4]):
        f = line.strip().split(',')
        if len(f) > 2 and f[0].replace('.', '').isdigit():
            d['per_req_' + f[2].split(':')[-1]] = float(f[0]) / n
except FileNotFoundError:
    pass
print(json.dumps(d))" "$out" "$t0" "$t1" "$TMP/perf.csv")
  echo "$1 $3 $4 $out" >>"$TMP/results.txt"
  echo "round $4: $1 @ $3/s: $out" >&2
}

# What SYSCALLS=1 counts (the proxy's threads, all its processes for nginx).
PERF_EVENTS=context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom
if [ "${SYSCALLS:-0}" = 1 ]; then
  command -v perf >/dev/null || { echo "SYSCALLS=1 needs perf: apt-get install -y linux-perf" >&2; exit 1; }
fi

# Rounds interleave the targets so a burst of background load hits all of them alike; the
# table reports, per rate and target, the median over rounds of each percentile, and the
# median over rounds of (target p99 - direct p99 in the same round).
[ "${ONLY_RSS:-0}" = 1 ] && RATES=""
for round in $(seq 1 "$ROUNDS"); do
  for rate in $RATES; do
    for target in direct levee ${BASE_BIN:+base} bare nginx; do
      case $target in
        direct) url="http://127.0.0.1:$ENGINE_PORT" ;;
        levee) url="http://127.0.0.1:$LEVEE_PORT" ;;
        base) url="http://127.0.0.1:$BASE_PORT" ;;
        bare) url="http://127.0.0.1:$BARE_PORT" ;;
        nginx) url="http://127.0.0.1:$NGINX_PORT" ;;
      esac
      run "$target" "$url" "$rate" "$round"
    done
  done
done

[ -s "$TMP/results.txt" ] && python3 - "$TMP/results.txt" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rate, rnd, js = line.split(" ", 3)
    rows[(name, int(rate), int(rnd))] = json.loads(js)
rates = sorted({k[1] for k in rows})
rounds = sorted({k[2] for k in rows})
med = statistics.median
print()
print(f"{len(rounds)} rounds; latency in ms from each request's due time (open loop); medians over rounds")
print()
print("| rate | target | ok / sent | p50 | p90 | p99 | p99.9 | proxy CPU µs/req (user + kernel) | added p99 vs direct (median of per-round differences) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for rate in rates:
    for name in ("direct", "levee", "base", "bare", "nginx"):
        rs = [rows[(name, rate, r)] for r in rounds if (name, rate, r) in rows]
        if not rs:
            continue
        ok = sum(r["ok"] for r in rs); sent = sum(r["requests"] for r in rs)
        p = {q: med([r["ms_from_due"][q] for r in rs]) for q in ("p50", "p90", "p99", "p999")}
        if name == "direct":
            added = ""
        else:
            diffs = [rows[(name, rate, r)]["ms_from_due"]["p99"] - rows[("direct", rate, r)]["ms_from_due"]["p99"]
                     for r in rounds if (name, rate, r) in rows and ("direct", rate, r) in rows]
            added = f"{med(diffs):+.3f} (rounds: {', '.join(f'{d:+.2f}' for d in diffs)})"
        cpu, user, kernel = (med([r.get(f"proxy_{k}_us_per_req", 0) for r in rs]) for k in ("cpu", "user", "sys"))
        cpu_s = "" if name == "direct" else f"{cpu:.0f} ({user:.0f} + {kernel:.0f})"
        print(f"| {rate}/s | {name} | {ok} / {sent} | {p['p50']:.3f} | {p['p90']:.3f} | {p['p99']:.3f} | {p['p999']:.3f} | {cpu_s} | {added} |")
# What the machine did in each round: a round whose load generator fell behind its own
# schedule, or whose CPU the hypervisor took, is slow for every target it hits.
print()
print("Added p99 by round (ms), with the CPU the hypervisor took from this machine meanwhile (ms, all cores) and the load generator's worst lag behind its schedule (ms):")
print()
print("| rate | target | " + " | ".join(f"round {r}" for r in rounds) + " |")
print("| --- | --- | " + " | ".join("---" for _ in rounds) + " |")
for rate in rates:
    for name in ("direct", "levee", "base", "bare", "nginx"):
        cells = []
        for r in rounds:
            x, d = rows.get((name, rate, r)), rows.get(("direct", rate, r))
            if x is None or d is None:
                cells.append("")
                continue
            added = "" if name == "direct" else f"{x['ms_from_due']['p99'] - d['ms_from_due']['p99']:+.2f} "
            cells.append(f"{added}(stolen {x['stolen_ms']}, lag {x['max_schedule_lag_ms']:.1f})")
        if any(cells):
            print(f"| {rate}/s | {name} | " + " | ".join(cells) + " |")
# CPU per request against nginx's, each the median over rounds of the ratio in one round.
print()
for rate in rates:
    ratios = []
    for name in ("levee", "base", "bare"):
        rs = [(rows[(name, rate, r)], rows[("nginx", rate, r)]) for r in rounds
              if (name, rate, r) in rows and ("nginx", rate, r) in rows]
        if rs and all(n["proxy_cpu_us_per_req"] > 0 for _, n in rs):
            ratios.append(f"{name} {med([x['proxy_cpu_us_per_req'] / n['proxy_cpu_us_per_req'] for x, n in rs]):.2f}×")
    if ratios:
        print(f"CPU per request against nginx's at {rate}/s (median of the rounds' ratios): {', '.join(ratios)}")
counted = ("sys_enter", "sys_enter_writev", "sys_enter_recvfrom", "sys_enter_epoll_wait", "sys_enter_futex", "context-switches")
if any("per_req_sys_enter" in r for r in rows.values()):
    print()
    print("Per request, medians over rounds (SYSCALLS=1; the proxy's own threads and processes):")
    print()
    print("| rate | target | system calls | writev | recvfrom | epoll_wait | futex | context switches |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rate in rates:
        for name in ("levee", "base", "bare", "nginx"):
            rs = [rows[(name, rate, r)] for r in rounds if (name, rate, r) in rows]
            if rs and all("per_req_sys_enter" in r for r in rs):
                cells = " | ".join(f"{med([r.get('per_req_' + k, 0) for r in rs]):.2f}" for k in counted)
                print(f"| {rate}/s | {name} | {cells} |")
PY

# --- RSS with QUEUED requests waiting in levee's queue -----------------------------------
[ -z "$BASE_BIN" ] || { kill "$BASE_PID"; wait "$BASE_PID" 2>/dev/null || true; }
rss_queued() { # $1 = label, $2 = binary
  kill "$LEVEE_PID"; wait "$LEVEE_PID" 2>/dev/null || true
  write_levee_config 8 $(( QUEUED * 2 )) 600000
  [ "$1" != base ] || fit_base_config "$TMP/levee.toml"
  BIN=$2 start_levee
  RSS_IDLE=$(awk '/VmRSS/{print $2}' /proc/$LEVEE_PID/status)
  curl -s -X POST "http://127.0.0.1:$ENGINE_PORT/admin/hang" >/dev/null
  "$LOADGEN" --url "http://127.0.0.1:$LEVEE_PORT/v1/chat/completions" --rate 5000 \
    --count $(( QUEUED + 8 )) --warmup-secs 0 --timeout-secs 120 --key "$KEY" ${RSS_H2:+--h2} >"$TMP/queued.json" &
  LG=$!
  PIDS+=($LG)
  for _ in $(seq 1 600); do
    q=$(curl -s "http://127.0.0.1:$ADMIN_PORT/admin/state" | python3 -c 'import json,sys; print(json.load(sys.stdin)["queued"])')
    [ "$q" -ge "$QUEUED" ] && break
    sleep 0.1
  done
  RSS_QUEUED=$(awk '/VmRSS/{print $2}' /proc/$LEVEE_PID/status)
  echo
  echo "$1 RSS idle: $(( RSS_IDLE / 1024 )) MB; with $q requests queued ($([ -n "${RSS_H2:-}" ] && echo "h2c, multiplexed" || echo "HTTP/1.1, one connection each")): $(( RSS_QUEUED / 1024 )) MB"
  curl -s -X POST "http://127.0.0.1:$ENGINE_PORT/admin/unhang" >/dev/null
  kill "$LG" 2>/dev/null || true
  wait "$LG" 2>/dev/null || true
}
rss_queued levee "$BIN"
[ -z "$BASE_BIN" ] || rss_queued base "$BASE_BIN"
