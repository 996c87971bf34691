#!/usr/bin/env bash
# Session affinity against load-only routing, side by side, on two real llama-servers:
#  1. installs llama-server and gemma-3-270m (bench/install-llama.sh) and builds levee
#     (release);
#  2. for each flood — bench/sessions-flood.toml (multi-turn conversations of questions of
#     similar size that resend their history), bench/sessions-document.toml (conversations
#     that open with a long document and go on with short follow-ups) and
#     bench/sessions-plain.toml (single-turn requests, the control) — and each
#     routing — load only ([affinity] enabled = false) and affinity ([affinity] enabled =
#     true, epsilon 0.5) — starts two fresh llama-servers (4 slots, one CPU thread each; the
#     why is in bench/llama-servers.sh: fresh so that no run finds the previous run's
#     prompts cached), a gateway in front of them, and runs the flood with `levee sim`;
#  3. prints TTFT p50/p99, goodput and success per run as a markdown table, then per flood
#     the medians of the rounds with affinity's change against load only, then per run where
#     the time to first token goes (the wait in levee's queue, with REQUEST_LOG=1; the
#     servers' prefill, and how many prompts were prefilled beside another prompt on the same
#     server), all also written to target/sessions/table.md, with each run's report in
#     target/sessions/<flood>-<routing>-<round>/.
# The goal: on a session flood, TTFT p50 at least halved at equal goodput; on the plain
# flood, affinity no more than 5% worse than load only.
# Every process it starts is killed at the end (by PID). About 12 minutes a round after the
# build.
#
#   bench/sessions.sh            # two llama-servers
#   bench/sessions.sh --sim      # two simulated engines (levee engine) calibrated to them
#
# LEVEE=path/to/levee uses that binary instead of building one; FLOODS="plain" runs only
# those floods (of flood, document, plain); ROUNDS=N runs each pair N times, load and
# affinity alternating (run-to-run spread is the yardstick for a 5% difference); SCALE=X
# multiplies every flood's rates (`levee sim --rate-scale`); REQUEST_LOG=1 has the gateway
# log every request (queue and TTFT ms, backend) to <run>/gateway.log; LLAMA_BATCH=N has the
# llama-servers compute at most N prompt tokens a step (chunked prefill; see
# bench/llama-servers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=target/sessions
mkdir -p "$OUT"
source bench/two-backends.sh

# write_config FILE AFFINITY PUBLIC ADMIN: the gateway in front of URLS. Roomy watermarks,
# no degradation: only the backend choice differs between runs.
write_config() {
  local file=$1 affinity=$2 public=$3 admin=$4 url
  {
    echo "[listen]"
    echo "public = \"127.0.0.1:$public\""
    echo "admin = \"127.0.0.1:$admin\""
    echo "[scrape]"
    echo "interval_ms = 1000"
    echo "[queue]"
    echo "safe = 64"
    echo "soft = 256"
    echo "hard = 1024"
    if [[ ${REQUEST_LOG:-0} == 1 ]]; then
      echo "[observe]"
      echo "request_log_sample = 1.0"
    fi
    echo "[degrade]"
    echo "enabled = false"
    echo "[affinity]"
    echo "enabled = $affinity"
    echo "epsilon = 0.5"
    echo "[[tenants]]"
    echo "name = \"chat\""
    echo "tier = \"standard\""
    echo "key_sha256 = [\"$(printf %s sk-sessions-bench | sha256sum | cut -d' ' -f1)\"]"
    echo "[[models]]"
    echo "name = \"gemma-3-270m\""
    for url in "${URLS[@]}"; do
      echo "[[models.backends]]"
      echo "kind = \"$KIND\""
      echo "url = \"$url\""
      echo "max_in_flight = 4"
    done
  } >"$file"
}

# run FLOOD ROUTING ROUND: one run on fresh backends; its report in $OUT/FLOOD-ROUTING-ROUND/.
run() {
  local flood=$1 routing=$2 dir="$OUT/$1-$2-$3" affinity=false public admin
  [[ $routing == affinity ]] && affinity=true
  rm -rf "$dir"
  mkdir -p "$dir"
  start_backends "$dir"
  public=$(free_port)
  admin=$(free_port)
  write_config "$dir/gateway.toml" "$affinity" "$public" "$admin"
  "$LEVEE" serve --config "$dir/gateway.toml" >"$dir/gateway.log" 2>&1 &
  GATEWAY_PID=$!
  wait_healthy "http://127.0.0.1:$public/healthz"
  # A bound only against a hang: the flood ends by itself.
  timeout 600 "$LEVEE" sim "bench/sessions-$flood.toml" --target "http://127.0.0.1:$public" \
    --rate-scale "${SCALE:-1}" --out "$dir" >"$dir/sim.log" 2>&1
  curl -s "http://127.0.0.1:$admin/metrics" >"$dir/gateway-metrics.txt" || true
  stop_all
}

RUNS=()
for flood in ${FLOODS:-flood document plain}; do
  for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
    for routing in load affinity; do
      echo "running sessions-$flood with $routing routing, round $round ($MODE backends)" >&2
      run "$flood" "$routing" "$round"
      RUNS+=("$flood-$routing-$round")
    done
  done
done

python3 - "$OUT" "$MODE" "${RUNS[@]}" <<'PY' | tee "$OUT/table.md"
import functools, glob, json, os, re, statistics, sys
out, mode, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
batch = os.environ.get("LLAMA_BATCH")
chunk = f", prompts computed {batch} tokens a step" if batch else ""
print(f"backends: {f'two llama-servers (gemma-3-270m, 4 slots, 1 thread{chunk})' if mode == 'llama' else 'two simulated engines (profiles/llamacpp-gemma3-270m-2core.toml)'}")
print()
print("| flood | routing | round | requests | success | goodput req/s | TTFT p50 ms | TTFT p99 ms | cached prompt tokens | prefilled tokens | prefilled per warm turn, median | prefilled per request, median | TTFT p50 floor ms |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


@functools.lru_cache(maxsize=None)
def server_tasks(d):
    """Each task the llama-servers of run directory `d` logged, keyed by (log file, task id):
    when it started (s since the server's start), its prompt tokens computed, their time and
    ms per token, the tokens it generated, and the tokens its slot held at the end. Read once
    per directory: both tables use it (callers must not change what it returns)."""
    def seconds(stamp):  # llama-server's log stamps: minutes.seconds.milliseconds.microseconds
        m, s, ms, us = (int(x) for x in stamp.split("."))
        return m * 60 + s + ms / 1e3 + us / 1e6
    tasks = {}
    for f in glob.glob(f"{d}/llama-server-*.log"):
        for line in open(f):
            m = re.match(r"(\d+\.\d+\.\d+\.\d+) .*task (\d+) \| processing task", line)
            if m:
                tasks.setdefault((f, m[2]), {})["start"] = seconds(m[1])
            m = re.search(r"task (\d+) \| prompt eval time = +([\d.]+) ms / +(\d+) tokens \( +([\d.]+) ms per token", line)
            if m:
                tasks.setdefault((f, m[1]), {}).update(
                    prompt=int(m[3]), prompt_ms=float(m[2]), ms_per_token=float(m[4]))
            m = re.search(r"task (\d+) \| +eval time = +[\d.]+ ms / +(\d+) tokens", line)
            if m:
                tasks.setdefault((f, m[1]), {})["generated"] = int(m[2])
            m = re.search(r"task (\d+) \| stop processing: n_tokens = (\d+)", line)
            if m:
                tasks.setdefault((f, m[1]), {})["total"] = int(m[2])
    return tasks

def prefill(d):
    """From the llama-servers' own logs: the prompt tokens they computed (not found in a
    cache); the median of those per turn that found at least 50 tokens cached, and per
    request; and the floor under the TTFT p50 that routing can reach: the median request's
    computed tokens at the run's fastest prefill (the lowest ms per token of any prompt of
    64 tokens or more), what it would take with a server to itself."""
    tasks = [t for t in server_tasks(d).values() if "prompt" in t]
    if not tasks:
        return "", "", "", ""
    evaluated = [t["prompt"] for t in tasks]
    rates = [t["ms_per_token"] for t in tasks if t["prompt"] >= 64]
    warm = [t["prompt"] for t in tasks
            if "total" in t and "generated" in t and t["total"] - t["generated"] - t["prompt"] >= 50]
    median = statistics.median(evaluated)
    floor = f"{median * min(rates):.0f}" if rates else ""
    return (str(sum(evaluated)), (f"{statistics.median(warm):.0f}" if warm else ""),
            f"{median:.0f}", floor)

figures = {}
for run in runs:
    flood, routing, rnd = run.split("-")
    d = f"{out}/{run}"
    r = json.load(open(f"{d}/report.json"))
    cached = 0
    for line in open(f"{d}/gateway-metrics.txt"):
        if line.startswith("levee_prompt_cached_tokens_total"):
            cached += float(line.split()[-1])
    t = r["latency"]["ttft"]
    figures.setdefault((flood, routing), []).append(
        (t["p50"], t["p99"], r["rates"]["goodput_rps"], r["rates"]["success_rate"]))
    print(f"| sessions-{flood} | {routing} | {rnd} | {r['totals']['sent']} "
          f"| {r['rates']['success_rate']:.3f} | {r['rates']['goodput_rps']:.2f} "
          f"| {t['p50']:.0f} | {t['p99']:.0f} | {cached:.0f} | {' | '.join(prefill(d))} |")

def where_time_goes(d):
    """Where a run's time to first token goes, from the gateway's request log (with
    REQUEST_LOG=1: the wait in levee's queue) and the llama-servers' logs (when each prompt
    started and how long its prefill took): the mean wait in the queue and the share of
    requests that waited more than 100 ms; the TTFT less that wait (p50); the servers'
    prefill time (p50); the share of prompts whose prefill ran while another prompt was
    being prefilled on the same server; and the milliseconds per computed token of prompts
    prefilled alone and of those prefilled beside another (medians)."""
    queue, rest = [], []
    log = f"{d}/gateway.log"
    if os.path.exists(log):
        for line in open(log):
            if line.startswith("{") and '"queue_ms"' in line:
                r = json.loads(line)
                if r.get("ttft_ms") is not None and r.get("queue_ms") is not None:
                    queue.append(r["queue_ms"])
                    rest.append(r["ttft_ms"] - r["queue_ms"])
    prefills = [(f, t["start"], t["start"] + t["prompt_ms"] / 1e3, t["prompt"], t["prompt_ms"])
                for (f, _), t in server_tasks(d).items()
                if "start" in t and t.get("prompt", 0) > 0]  # (server, start s, end s, tokens, ms)
    alone, beside = [], []
    for i, (f, a, b, n, ms) in enumerate(prefills):
        shared = any(j != i and g == f and s < b and e > a for j, (g, s, e, _, _) in enumerate(prefills))
        (beside if shared else alone).append(ms / n)
    cell = lambda xs, fmt: fmt(xs) if xs else ""
    return [
        cell(queue, lambda q: f"{statistics.mean(q):,.0f} ({sum(v > 100 for v in q) / len(q):.0%})"),
        cell(rest, lambda r: f"{statistics.median(r):,.0f}"),
        cell(prefills, lambda p: f"{statistics.median(x[4] for x in p):,.0f}"),
        cell(prefills, lambda p: f"{len(beside) / len(p):.0%}"),
        cell(prefills, lambda _: f"{cell(alone, lambda a: f'{statistics.median(a):.1f}')} → "
             f"{cell(beside, lambda b: f'{statistics.median(b):.1f}')}"),
    ]

# Medians over the rounds, and affinity's change against load only.
print()
print("| flood | rounds | TTFT p50 ms, load → affinity | TTFT p99 ms | goodput req/s | success |")
print("| --- | --- | --- | --- | --- | --- |")
for flood in dict.fromkeys(f for f, _ in figures):
    load, aff = figures.get((flood, "load")), figures.get((flood, "affinity"))
    if not load or not aff:
        continue
    cells = []
    for i, fmt in enumerate(("{:,.0f}", "{:,.0f}", "{:.2f}", "{:.3f}")):
        a, b = statistics.median(x[i] for x in load), statistics.median(x[i] for x in aff)
        change = f" ({(b - a) / a:+.0%})" if a else ""
        cells.append(f"{fmt.format(a)} → {fmt.format(b)}{change}")
    print(f"| sessions-{flood} | {min(len(load), len(aff))} | {' | '.join(cells)} |")

# Where each run's time to first token goes.
print()
print("| flood | routing | round | TTFT p50 ms | levee queue: mean ms (requests > 100 ms) | TTFT less the queue, p50 ms | server prefill p50 ms | prompts prefilled beside another | ms per computed token, alone → beside another |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for run in runs:
    flood, routing, rnd = run.split("-")
    t = json.load(open(f"{out}/{run}/report.json"))["latency"]["ttft"]
    print(f"| sessions-{flood} | {routing} | {rnd} | {t['p50']:,.0f} | {' | '.join(where_time_goes(f'{out}/{run}'))} |")
PY
