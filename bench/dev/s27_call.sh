#!/usr/bin/env bash
# Session 27's device call: nvidia-smi samples clocks / power / temperature every 100 ms in the
# background; then bench/dev/s27_dist.py once per DIST_SETS entry ("SHAPES|ENV_B|GRAD", ";"-separated),
# then (QUICK=1) bench.py --quick, (GRID=1) the grid against SDPA flash and cuDNN (GRID_ARGS), then
# bench/dev/fwd_ab_inproc.py per AB_SETS entry ("TREES|TREE_ENV|HDS|SEQS", ";"-separated),
# bench/dev/s27_energy.py on ENERGY_SHAPES (if set), then the GPU test files TESTS (if set), then the quick GPU suite SUITE_RUNS times. Logs to $OUT; a
# summary last. Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
smi_start
i=0
IFS=';' read -ra SETS <<< "${DIST_SETS:-}"
for set in "${SETS[@]}"; do
  i=$((i + 1))
  IFS='|' read -r shapes envb grad <<< "$set"
  SHAPES="$shapes" ENV_B="$envb" GRAD="${grad:-1}" OUT="$OUT" timeout "${DIST_S:-240}" python3 bench/dev/s27_dist.py \
    > "$OUT/dist$i.log" 2>&1
  echo "dist$i rc $?"; [ -e "$OUT/dist.json" ] && mv "$OUT/dist.json" "$OUT/dist$i.json"
done
if [ "${QUICK:-0}" = 1 ]; then
  timeout 150 python3 bench/bench.py --quick --no-compile-timing > "$OUT/quick.log" 2>&1; echo "quick rc $?"
fi
if [ "${GRID:-0}" = 1 ]; then
  timeout "${GRID_S:-300}" python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
    ${GRID_ARGS:-} --json "$OUT/grid.json" > "$OUT/grid.log" 2>&1; echo "grid rc $?"
fi
run_ab_sets
if [ -n "${ENERGY_SHAPES:-}" ]; then
  SHAPES="$ENERGY_SHAPES" timeout "${ENERGY_S:-240}" python3 bench/dev/s27_energy.py > "$OUT/energy.log" 2>&1
  echo "energy rc $?"
fi
run_tests
run_suites
smi_stop
for f in "$OUT"/dist*.log; do
  [ -e "$f" ] || continue
  echo "== $(basename "$f")"; grep -v "^\s*$" "$f" | grep -v "Warning\|warn" | tail -"${DIST_TAIL:-60}"
done
[ -e "$OUT/quick.log" ] && { echo "== quick.log"; tail -12 "$OUT/quick.log"; }
[ -e "$OUT/grid.log" ] && { echo "== grid.log"; tail -"${GRID_TAIL:-25}" "$OUT/grid.log"; }
show_ab_logs 40
[ -e "$OUT/energy.log" ] && { echo "== energy.log"; grep -v "^\s*$" "$OUT/energy.log" | tail -40; }
show_tests
exit 0
