#!/usr/bin/env bash
# Session 67's device calls: the steps below, those of bench/dev/call_steps.sh (suite, slow, dtests, dgrid,
# host, ...) and bench/dev/s66_call.sh's (specE, specF, psq, esq, abx, seed).
#   dstar  bench/dev/bwd_dstar_ab.py: below head_dim 32, the dQ kernel first (D* for the dK/dV kernel) against
#          the former order, in one process: dk's accuracy on shared-component values, and the backward's
#          GPU time at head_dim 8 / 16 / 24 (DSTAR_ENV: environment for it, e.g. "ROUNDS=7")
#   bwdt   the backward GPU test files (tests/test_gpu_backward.py and the feature backward's)
#   STEPS="seed dstar suite slow" CALL=c1 bash bench/dev/s67_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s66_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s66_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    dstar)
      env ${DSTAR_ENV:-} python3 bench/dev/bwd_dstar_ab.py > "$OUT/${N}_dstar.log" 2>&1
      grep -E "^acc|^geomean|Error|error" "$OUT/${N}_dstar.log" | cut -c1-200 ;;
    bwdt)
      python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider tests/test_gpu_backward.py \
        $(ls tests/test_*feat*gpu*.py tests/test_gpu_*feat*.py 2>/dev/null) > "$OUT/${N}_bwdt.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_bwdt.log" | head -20
      echo "bwdt: $(tail -n 1 "$OUT/${N}_bwdt.log")" ;;
    *) s66_step "$1" ;;
  esac
}
run_steps
archive_logs
