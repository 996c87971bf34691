# Sourced by bench/sessions.sh and bench/same-tier.sh: two fresh backends per run — two
# real llama-servers, or with --sim two simulated engines (levee engine) fitted to them —
# and a gateway in front of them, all killed (by PID) at exit. Sets MODE (llama | sim) from
# the first argument, LEVEE (built unless given), and defines stop_all, wait_healthy and
# start_backends (which fills URLS and KIND).
MODE=llama
if [[ ${1:-} == --sim ]]; then
  MODE=sim
fi
source bench/llama-servers.sh
ENGINE_PIDS=()
GATEWAY_PID=
stop_all() {
  [[ -n $GATEWAY_PID ]] && kill "$GATEWAY_PID" 2>/dev/null && wait "$GATEWAY_PID" 2>/dev/null
  GATEWAY_PID=
  stop_llama_servers
  for pid in "${ENGINE_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  ENGINE_PIDS=()
  return 0
}
trap stop_all EXIT

if [[ -z ${LEVEE:-} ]]; then
  cargo build --release -q -p levee
  LEVEE="${CARGO_TARGET_DIR:-target}/release/levee"
fi
if [[ $MODE == llama ]]; then
  mapfile -t LLAMA < <(bench/install-llama.sh)
fi

wait_healthy() {
  local url=$1 i
  for ((i = 0; i < 1200; i++)); do
    curl -sf "$url" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "$url did not answer in 120 s" >&2
  return 1
}

# Starts two fresh backends; fills URLS and KIND.
start_backends() {
  local logdir=$1 i port
  URLS=()
  if [[ $MODE == llama ]]; then
    start_llama_servers 2 "${LLAMA[0]}" "${LLAMA[1]}" "$logdir"
    URLS=("${LLAMA_URLS[@]}")
    LLAMA_URLS=()
    KIND=llamacpp
  else
    mkdir -p "$logdir"
    for i in 0 1; do
      port=$(free_port)
      "$LEVEE" engine --port "$port" --profile-file profiles/llamacpp-gemma3-270m-2core.toml \
        >"$logdir/engine-$i.log" 2>&1 &
      ENGINE_PIDS+=($!)
      URLS+=("http://127.0.0.1:$port")
      wait_healthy "http://127.0.0.1:$port/health"
    done
    KIND=vllm
  fi
}
