#!/usr/bin/env bash
# Does the batch band leave interactive traffic alone? Two simulated engines (small profile:
# 64 sequences, 16k KV tokens each) behind levee with async tasks on (batch tier priority 3,
# band of MAX_RUNNING tasks). Runs scenarios/async-batch-baseline.toml (streaming chat at
# 0.5x) and scenarios/async-batch.toml (the same chat, byte for byte, plus long async jobs
# at 0.2/s to /v1/tasks), each on fresh engines and a fresh gateway and task store, and
# prints the chat's goodput and TTFT side by side, and the tasks' outcomes and ETA error.
#
#   bench/async-batch.sh          # MAX_RUNNING=4 JOB_RPS=0.2 RUNS=1 LEVEE_BIN=target/release/levee
# JOB_RPS sets the jobs' submission rate (the scenario's 0.2/s by default). RUNS repeats the
# pair (both arms each time, fresh processes) and prints every run, then every run's
# figures on one line each. The scenarios run 120 s each (1,210 chat requests: p99 is the
# 13th slowest).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LEVEE_BIN:-target/release/levee}
MAX_RUNNING=${MAX_RUNNING:-4}
JOB_RPS=${JOB_RPS:-0.2}
RUNS=${RUNS:-1}
[ -x "$BIN" ] || { echo "no levee binary at $BIN (cargo build --release -p levee)" >&2; exit 1; }

TMP=$(mktemp -d /tmp/levee-async-batch.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 200); do curl -s -o /dev/null "$1" && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; exit 1; }
sha() { printf %s "$1" | sha256sum | cut -d' ' -f1; }

run() {
  local scenario=$1 out=$2
  local E0 E1 PUB ADM
  E0=$(free_port); E1=$(free_port); PUB=$(free_port); ADM=$(free_port)
  local pids=()
  for p in "$E0" "$E1"; do
    "$BIN" engine --port "$p" --profile small >"$TMP/engine-$p.log" 2>&1 &
    pids+=($!)
  done
  cat >"$TMP/levee-$out.toml" <<TOML
[listen]
public = "127.0.0.1:$PUB"
admin = "127.0.0.1:$ADM"
[ip_guard]
enabled = false
[scrape]
interval_ms = 250
[degrade]
enabled = false
[tiers.premium]
priority = 0
[tiers.standard]
priority = 1
queue_wait_ms = 1000
soft_queue_wait_ms = 500
[tiers.batch]
priority = 3
queue_wait_ms = 600000
soft_queue_wait_ms = 600000
[queue]
safe = 128
soft = 192
hard = 256
[[tenants]]
name = "quiet-a"
tier = "standard"
key_sha256 = ["$(sha sk-quiet-a)"]
[[tenants]]
name = "quiet-b"
tier = "standard"
key_sha256 = ["$(sha sk-quiet-b)"]
[[tenants]]
name = "globex"
tier = "standard"
key_sha256 = ["$(sha sk-globex-standard)"]
[[models]]
name = "levee-sim-7b"
[[models.backends]]
kind = "vllm"
url = "http://127.0.0.1:$E0"
max_in_flight = 64
[[models.backends]]
kind = "vllm"
url = "http://127.0.0.1:$E1"
max_in_flight = 64
[tasks]
enabled = true
store_path = "$TMP/tasks-$out.redb"
tier = "batch"
max_running = $MAX_RUNNING
TOML
  "$BIN" serve --config "$TMP/levee-$out.toml" >"$TMP/levee-$out.log" 2>&1 &
  pids+=($!)
  PIDS+=("${pids[@]}")
  wait_http "http://127.0.0.1:$E0/health"; wait_http "http://127.0.0.1:$E1/health"
  wait_http "http://127.0.0.1:$PUB/healthz"
  "$BIN" sim "$scenario" --target "http://127.0.0.1:$PUB" --out "$TMP/$out" --quiet >/dev/null
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
}

sed "s/rps = 0.2 }/rps = $JOB_RPS }/" scenarios/async-batch.toml >"$TMP/async-batch.toml"
grep -q "rps = $JOB_RPS }" "$TMP/async-batch.toml" || { echo "could not set JOB_RPS" >&2; exit 1; }
for i in $(seq 1 "$RUNS"); do
echo "== run $i of $RUNS (JOB_RPS=$JOB_RPS MAX_RUNNING=$MAX_RUNNING): $(uptime)"
run scenarios/async-batch-baseline.toml "baseline-$i"
run "$TMP/async-batch.toml" "with-jobs-$i"
python3 - "$TMP/baseline-$i/report.json" "$TMP/with-jobs-$i/report.json" "$TMP/summary" "$i" <<'PY'
import json, sys
base, jobs = (json.load(open(p)) for p in sys.argv[1:3])
def chat(r): return r["per_class"]["chat"]
b, j = chat(base), chat(jobs)
print(f"{'chat (interactive)':<26}{'without jobs':>14}{'with jobs':>14}{'change':>10}")
for name, f in [("requests", lambda g: g["requests"]), ("success", lambda g: 100 * g["success_rate"]),
                ("goodput req/s", lambda g: g["goodput_rps"]), ("p50 TTFT ms", lambda g: g["ttft"]["p50"]),
                ("p99 TTFT ms", lambda g: g["ttft"]["p99"])]:
    x, y = f(b), f(j)
    ch = f"{(y - x) / x * 100:+.1f}%" if x else "-"
    print(f"{name:<26}{x:>14.2f}{y:>14.2f}{ch:>10}")
t = jobs.get("tasks") or {}
print("tasks:", json.dumps({k: t.get(k) for k in ("submitted", "accepted", "outcomes", "eta_samples")}))
if t:
    e, r, d = t["eta_abs_error_s"], t["eta_rel_error_pct"], t["time_to_result"]
    print(f"ETA error: p50 {e['p50']:.1f} s ({r['p50']:.0f}%), p90 {e['p90']:.1f} s ({r['p90']:.0f}%), max {e['max']:.1f} s over {e['count']} tasks; "
          f"time to result p50 {d['p50']/1000:.1f} s, max {d['max']/1000:.1f} s")
pct = lambda x, y: (y - x) / x * 100 if x else 0.0
line = (f"run {sys.argv[4]}: goodput {b['goodput_rps']:.2f} -> {j['goodput_rps']:.2f} ({pct(b['goodput_rps'], j['goodput_rps']):+.1f}%), "
        f"p50 TTFT {b['ttft']['p50']:.0f} -> {j['ttft']['p50']:.0f} ms ({pct(b['ttft']['p50'], j['ttft']['p50']):+.1f}%), "
        f"p99 TTFT {b['ttft']['p99']:.0f} -> {j['ttft']['p99']:.0f} ms ({pct(b['ttft']['p99'], j['ttft']['p99']):+.1f}%), "
        f"tasks {(t.get('outcomes') or {}).get('succeeded', 0)}/{t.get('submitted', 0)} succeeded")
open(sys.argv[3], "a").write(line + "\n")
PY
done
echo "== every run (margin: goodput within 2%, p99 TTFT within +25%):"
cat "$TMP/summary"
