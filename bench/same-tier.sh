#!/usr/bin/env bash
# A same-tier flood on two real llama-servers: do quiet tenants feel it (issue 26)?
#  1. installs llama-server and gemma-3-270m (bench/install-llama.sh) and builds levee
#     (release);
#  2. runs bench/same-tier-calm.toml (three quiet standard tenants at 0.6x of the fleet) and
#     then bench/same-tier-flood.toml (the same quiet traffic, and a fourth standard tenant
#     flooding at 4x — 20x its 0.2x share — for 40 s), each on two fresh llama-servers (4
#     slots, one CPU thread each; the why is in bench/llama-servers.sh) behind a fresh
#     gateway, with `levee sim`;
#  3. prints the quiet tenants' success and p99 TTFT calm against flood, and the flooder's
#     goodput against its weighted share (a quarter of the fleet's goodput in the flood run:
#     four tenants of equal weight), as a markdown table, also written to
#     target/same-tier/table.md, with each run's report in target/same-tier/<run>/.
# The gateway's standard tier carries the scenario's objectives (ttft_slo_ms = 5000,
# tpot_slo_ms = 250): each backend's batch is capped by its learned latency, and a request
# predicted to miss 5 s to first token is refused at once. SLO=off runs without them;
# PREEMPT=on lets the lane cut short the flooder's youngest request whose answer has not
# started when a quiet one waits (`queue.preempt_over_share`).
# Every process it starts is killed at the end (by PID). About 4 minutes after the build.
#
#   bench/same-tier.sh            # two llama-servers
#   bench/same-tier.sh --sim      # two simulated engines (levee engine) calibrated to them
#
# LEVEE=path/to/levee uses that binary instead of building one; ROUNDS=N runs the pair N
# times (run-to-run spread is the yardstick); SCALE=X multiplies both runs' rates
# (`levee sim --rate-scale`).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=target/same-tier
mkdir -p "$OUT"
source bench/two-backends.sh

# write_config FILE PUBLIC ADMIN: the gateway in front of URLS; the four tenants in the
# standard tier with equal weights, no quotas (only fairness inside the tier separates
# them), roomy watermarks, no degradation.
write_config() {
  local file=$1 public=$2 admin=$3 url name
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
    if [[ ${PREEMPT:-off} == on ]]; then
      echo "preempt_over_share = true"
    fi
    echo "[degrade]"
    echo "enabled = false"
    echo "[tiers.standard]"
    echo "priority = 1"
    echo "queue_wait_ms = 10000"
    echo "soft_queue_wait_ms = 2000"
    if [[ ${SLO:-on} != off ]]; then
      echo "ttft_slo_ms = 5000"
      echo "tpot_slo_ms = 250"
    fi
    for name in quiet-a quiet-b quiet-c noisy; do
      echo "[[tenants]]"
      echo "name = \"$name\""
      echo "tier = \"standard\""
      echo "key_sha256 = [\"$(printf %s "sk-same-tier-$name" | sha256sum | cut -d' ' -f1)\"]"
    done
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

# run TRAFFIC ROUND: one run on fresh backends; its report in $OUT/TRAFFIC-ROUND/.
run() {
  local traffic=$1 dir="$OUT/$1-$2" public admin
  rm -rf "$dir"
  mkdir -p "$dir"
  start_backends "$dir"
  public=$(free_port)
  admin=$(free_port)
  write_config "$dir/gateway.toml" "$public" "$admin"
  "$LEVEE" serve --config "$dir/gateway.toml" >"$dir/gateway.log" 2>&1 &
  GATEWAY_PID=$!
  wait_healthy "http://127.0.0.1:$public/healthz"
  # A bound only against a hang: the traffic ends by itself.
  timeout 600 "$LEVEE" sim "bench/same-tier-$traffic.toml" --target "http://127.0.0.1:$public" \
    --rate-scale "${SCALE:-1}" --out "$dir" >"$dir/sim.log" 2>&1
  curl -s "http://127.0.0.1:$admin/metrics" >"$dir/gateway-metrics.txt" || true
  stop_all
}

ROUNDS_RUN=()
for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
  for traffic in calm flood; do
    echo "running same-tier-$traffic, round $round ($MODE backends, objectives ${SLO:-on})" >&2
    run "$traffic" "$round"
  done
  ROUNDS_RUN+=("$round")
done

python3 - "$OUT" "$MODE" "${SLO:-on}" "${ROUNDS_RUN[@]}" <<'PY' | tee "$OUT/table.md"
import json, sys
out, mode, slo, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
print(f"backends: {'two llama-servers (gemma-3-270m, 4 slots, 1 thread)' if mode == 'llama' else 'two simulated engines (profiles/llamacpp-gemma3-270m-2core.toml)'}; tier objectives {slo}")
print()
print("| round | quiet requests calm / flood | quiet success calm / flood | quiet TTFT p99 calm ms | quiet TTFT p99 flood ms | change | flooder goodput req/s | flooder's weighted share req/s | fleet goodput flood req/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for rnd in rounds:
    calm = json.load(open(f"{out}/calm-{rnd}/report.json"))
    flood = json.load(open(f"{out}/flood-{rnd}/report.json"))
    qc, qf = calm["per_group"]["quiet"], flood["per_group"]["quiet"]
    noisy = flood["per_group"].get("noisy", {"goodput_rps": 0.0})
    fleet = flood["rates"]["goodput_rps"]
    a, b = qc["ttft"]["p99"], qf["ttft"]["p99"]
    change = f"{100 * (b / a - 1):+.0f}%" if a > 0 else "n/a"
    print(f"| {rnd} | {qc['requests']} / {qf['requests']} | {qc['success_rate']:.3f} / {qf['success_rate']:.3f} "
          f"| {a:.0f} | {b:.0f} | {change} | {noisy['goodput_rps']:.2f} | {fleet / 4:.2f} | {fleet:.2f} |")
PY
