#!/usr/bin/env bash
# Session 62's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...).
#   lsutest  the GPU tests of the decode kernels whose paged 16-key groups the threads copy
#            (tests/test_kvcache_decode.py -k lsu: on branch s62-lsu, call 1; main has no such test)
#   envtest  tests/test_kvcache_decode.py -k "$ENVT_K" with ENVT_VAR=ENVT_MODE in the environment
#   envab    decode_splits.py at the library's plans (contiguous and 16-row pages) with the variable
#            ENVAB_VAR set to each of ENVAB_MODES in turn, each run its own process on the same card
#            (ENVAB_SHAPES); bench/dev/env_ab_summary.py prints each shape's time per mode. Call 1 ran
#            it as `lsuab` with CUFLASH_DECODE_LSU (branch s62-lsu)
#   ENVT_K=group_kernel ENVAB_VAR=CUFLASH_DECODE_GRP ENVAB_MODES="0 8 1 0 8 1" STEPS="envtest envab" \
#     CALL=c3 bash bench/dev/s62_call.sh   (OUT: where logs go; call 3 ran this, when the variable
#     also took 8: the twin on 8 warps only)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main62}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    lsutest)
      python3 -m pytest -q -rf -n 8 -p no:cacheprovider tests/test_kvcache_decode.py -k lsu \
        > "$OUT/${N}_lsutest.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_lsutest.log" | head -20
      echo "lsutest: $(tail -n 1 "$OUT/${N}_lsutest.log")" ;;
    envtest)
      env "${ENVT_VAR:-CUFLASH_DECODE_EARLY_ORDER}=${ENVT_MODE:-2}" python3 -m pytest -q -rf -n 8 -p no:cacheprovider \
        tests/test_kvcache_decode.py -k "${ENVT_K:-decode_warps or cluster_merge}" > "$OUT/${N}_envtest.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_envtest.log" | head -20
      echo "envtest ${ENVT_VAR:-CUFLASH_DECODE_EARLY_ORDER}=${ENVT_MODE:-2}: $(tail -n 1 "$OUT/${N}_envtest.log")" ;;
    envab)
      local k=0 mode var="${ENVAB_VAR:-CUFLASH_DECODE_EARLY_ORDER}"
      for mode in ${ENVAB_MODES:-0 1 2 0 1 2}; do
        k=$((k + 1))
        env "$var=$mode" python3 bench/dev/decode_splits.py --paged --splits 0 --calls "${CALLS:-30}" \
          --rounds "${ROUNDS:-9}" --json "$OUT/${N}_envab_m${mode}_$k.json" \
          --shapes ${ENVAB_SHAPES:-4x512x1 16x512x4 16x512x8 1x512x1 1x2048x4 16x2048x8 16x2048x4 1x8192x1 4x32768x4 16x8192x8} \
          > "$OUT/${N}_envab_m${mode}_$k.log" 2>&1
        echo "envab $var=$mode ($k): $(grep -c ' us ' "$OUT/${N}_envab_m${mode}_$k.log") rows"
      done
      python3 bench/dev/env_ab_summary.py "$OUT"/${N}_envab_m*.json | tee "$OUT/${N}_envab_summary.log" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
