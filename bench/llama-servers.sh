# Sourced by bench/real-backend.sh and bench/calibrate-llama.sh: starts llama-servers the
# same way in both, and kills them (by PID) on exit.
#
# One server = llama-server serving gemma-3-270m with 4 slots (--parallel 4) of 2048 tokens
# each (--ctx-size 8192, split per slot: llama-server does not unify the KV cache when
# --parallel is given) on one CPU thread (--threads 1), and Prometheus metrics (--metrics).
# Why: on a 2-core machine two such servers use one core each; more threads per server
# would make them fight each other (and levee and the load generator) for the same cores.
# Four slots: on one core a decode step costs nearly in proportion to its batch, so more
# sequences at once add little throughput (the calibration sweep: 0.79 req/s alone, 0.92 at
# four, no more past four; BENCHMARKS.md, "A real engine") and more slots would only
# stretch every answer; four still take a new prompt in at once while others decode.
# --no-repack: llama.cpp built for the machine's own CPU moves weights into AMX tile buffers
# when the CPU advertises AMX, and on virtual machines whose kernel does not grant AMX to
# processes (seen here: Sapphire Rapids guests) the first matrix product dies with SIGILL
# (`tilezero`). Without repacking, the plain AVX2/AVX-512 kernels run on every machine.
# LLAMA_BATCH=N sets --batch-size and --ubatch-size to N: the most prompt tokens a server
# computes in one step beside its running answers (chunked prefill). Unset, llama-server's
# own defaults (2048 and 512): a prompt of up to 2048 tokens is computed in one step, and a
# request that arrives meanwhile waits for all of it.

LLAMA_PIDS=()
LLAMA_URLS=()

# Prints a free TCP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

stop_llama_servers() {
  for pid in "${LLAMA_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${LLAMA_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  LLAMA_PIDS=()
}

# start_llama_servers N BINARY MODEL LOGDIR: starts N servers, waits until each is healthy
# (at most 120 s), and fills LLAMA_URLS.
start_llama_servers() {
  local n=$1 binary=$2 model=$3 logdir=$4 i port url
  if [[ -n ${LLAMA_BATCH:-} && ! $LLAMA_BATCH =~ ^[1-9][0-9]*$ ]]; then
    echo "LLAMA_BATCH=$LLAMA_BATCH: give a whole number of tokens (e.g. 128), or leave it unset" >&2
    return 1
  fi
  mkdir -p "$logdir"
  for ((i = 0; i < n; i++)); do
    port=$(free_port)
    "$binary" --model "$model" --host 127.0.0.1 --port "$port" \
      --parallel 4 --ctx-size 8192 --threads 1 --metrics --no-repack --alias gemma-3-270m \
      ${LLAMA_BATCH:+--batch-size "$LLAMA_BATCH" --ubatch-size "$LLAMA_BATCH"} \
      >"$logdir/llama-server-$i.log" 2>&1 &
    LLAMA_PIDS+=($!)
    LLAMA_URLS+=("http://127.0.0.1:$port")
  done
  for url in "${LLAMA_URLS[@]}"; do
    for ((i = 0; i < 1200; i++)); do
      if curl -sf "$url/health" >/dev/null 2>&1; then
        break
      fi
      if ((i == 1199)); then
        echo "llama-server at $url did not become healthy in 120 s; see $logdir" >&2
        return 1
      fi
      sleep 0.1
    done
  done
}
