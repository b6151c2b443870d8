# Steps shared by the session device-call scripts (bench/dev/s23_call.sh, s26_call.sh, s27_call.sh,
# s28_call.sh);
# source it after OUT is set. Each run_* step writes its log to $OUT and prints its exit status; the
# show_* steps print the summary lines of those logs.

# The GPU test files TESTS (-m "gpu and not slow" unless MARK), if set: $OUT/tests.log.
run_tests() {
  [ -n "${TESTS:-}" ] || return 0
  timeout "${TESTS_S:-240}" python3 -m pytest $TESTS -m "${MARK:-gpu and not slow}" -rf -p no:cacheprovider -q -n 8 \
    > "$OUT/tests.log" 2>&1
  echo "tests rc $?"
}

# bench/dev/fwd_ab_inproc.py once per AB_SETS entry ("TREES|TREE_ENV|HDS|SEQS", ";"-separated):
# $OUT/ab1.log, ab2.log, ...
run_ab_sets() {
  local j=0 set trees tenv hds seqs
  local -a sets
  IFS=';' read -ra sets <<< "${AB_SETS:-}"
  for set in "${sets[@]}"; do
    j=$((j + 1))
    IFS='|' read -r trees tenv hds seqs <<< "$set"
    TREES="$trees" TREE_ENV="$tenv" HDS="$hds" SEQS="$seqs" DTYPES="${DTYPES:-bfloat16 float16}" \
      timeout "${AB_S:-300}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/ab$j.log" 2>&1
    echo "ab$j rc $?"
  done
}

# The quick GPU suite SUITE_RUNS times: $OUT/suite1.log, ...
run_suites() {
  local r
  for r in $(seq 1 "${SUITE_RUNS:-0}"); do
    timeout "${SUITE_S:-300}" python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 \
      > "$OUT/suite$r.log" 2>&1
    echo "suite run $r rc $?"
  done
}

# The tail of each A/B log (AB_TAIL lines, default $1 or 60).
show_ab_logs() {
  local f
  for f in "$OUT"/ab*.log; do
    [ -e "$f" ] || continue
    echo "== $(basename "$f")"; grep -v " from " "$f" | tail -"${AB_TAIL:-${1:-60}}"
  done
}

# Failures (with their seeds) and the counts of the test-file run and of each suite.
show_tests() {
  local f
  [ -n "${TESTS:-}" ] && grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -12
  for f in "$OUT"/suite*.log; do
    [ -e "$f" ] || continue
    echo "== $(basename "$f")"; grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$f" | cut -c1-300 | tail -8
  done
  return 0
}

# The GPU's name, driver, top clock and power limit, the md5 of cuda_src, then nvidia-smi sampling
# clocks / power / temperature / throttle reasons every 100 ms into $OUT/smi.csv in the background
# (its pid in SMI, for smi_stop).
smi_start() {
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
  md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
  SMI=$!
}

# Stops smi_start's sampling and prints one line: samples, SM clock range, top power draw.
smi_stop() {
  kill "$SMI" 2>/dev/null
  python3 - "$OUT/smi.csv" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
if rows:
    sm = [int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit()]
    pw = [float(r[3].split()[0]) for r in rows if r[3].split()[0].replace(".", "").isdigit()]
    print(f"smi: {len(rows)} samples, sm clock min {min(sm)} max {max(sm)} MHz, power max {max(pw):.0f} W")
PY
}
