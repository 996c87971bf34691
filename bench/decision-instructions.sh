#!/usr/bin/env bash
# Instructions per admission decision, counted by valgrind (callgrind) in the criterion
# benchmark `admission/full_decision/1_thread`: a figure that host noise does not move, for
# comparing builds on a machine whose timings swing by tens of percent.
#
#   bench/decision-instructions.sh                    # this checkout's benchmark
#   bench/decision-instructions.sh /path/to/policy-*  # also other builds' benchmark binaries
#                                                     # (target/release/deps/policy-<hash>)
#
# Each binary runs twice under callgrind (4 s and 12 s of profiling); the difference in
# instructions spent inside the benchmark's cycle over the difference in cycles is the
# steady cost of one decision (setup and warm-up cancel out). Needs valgrind
# (apt-get install -y valgrind); takes about two minutes per binary.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install -y valgrind" >&2; exit 1; }
own=$(cargo bench -p levee-policy --bench policy --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1)
[ -x "$own" ] || { echo "could not find the benchmark binary (cargo bench --no-run)" >&2; exit 1; }
TMP=$(mktemp -d /tmp/levee-instr.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
for bin in "$own" "$@"; do
  [ -x "$bin" ] || { echo "$bin is not an executable" >&2; exit 1; }
  bin=$(realpath "$bin")
  counts=()
  for secs in 4 12; do
    out="$TMP/cg.$secs"
    (cd "$TMP" && valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" \
      --bench 'admission/full_decision/1_thread$' --profile-time "$secs" >/dev/null 2>&1) \
      || { echo "valgrind failed on $bin" >&2; exit 1; }
    # The line naming the cycle as called from criterion's loop: inclusive Ir and calls.
    line=$(callgrind_annotate --tree=calling --inclusive=yes "$out" 2>/dev/null \
      | grep -E '>.*Bench<K>::cycle \(' | head -1)
    [ -n "$line" ] || { echo "no benchmark cycle found in $bin's profile" >&2; exit 1; }
    counts+=("$(sed -E 's/^ *([0-9,]+) .*\(([0-9,]+)x\).*/\1 \2/' <<<"$line" | tr -d ,)")
  done
  read -r ir1 n1 <<<"${counts[0]}"
  read -r ir2 n2 <<<"${counts[1]}"
  python3 -c "import sys; print(f'{sys.argv[1]}: {(int(sys.argv[3])-int(sys.argv[2]))/(int(sys.argv[5])-int(sys.argv[4])):,.0f} instructions per decision ({sys.argv[4]} and {sys.argv[5]} decisions profiled)')" \
    "$bin" "$ir1" "$ir2" "$n1" "$n2"
done
