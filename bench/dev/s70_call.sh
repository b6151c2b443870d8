#!/usr/bin/env bash
# Session 70's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s69_call.sh (reager, tsuite).
#   ptest   the paged feature forward's GPU tests (tests/test_paged_direct_gpu.py) and the chunk tests of
#           tests/test_kvcache_device.py
#   proute  bench/dev/prefill_route.py at PROUTE_SHAPES on 16-row pages (and PROUTE_LAYOUTS): the decode
#           kernels, the forward reading the pages in place, the forward after the gather, the library's
#           choice; GPU time and (PROUTE_EAGER, default 20) single eager calls
#   pprefill  bench/dev/paged_prefill.py: attention_varlen with a block_table, the pages read in place against
#           the gather and against the keys already packed (GPU time; PP_EAGER single eager calls)
#   abfeat  bench/dev/fwd_ab_inproc.py with options (AB_OPTS), OLD's tree against this one
#   STEPS="ptest proute" CALL=c1 bash bench/dev/s70_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s69_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s69_call.sh)"; session_step "$1"); }
PROUTE_DEFAULT="1x8192x8x16 4x8192x8x16 1x2048x8x128 4x2048x8x64 16x2048x4x64 4x8192x4x64 2x8192x4x128 \
16x8192x8x128 4x32768x8x128 2x32768x8x64 8x8192x8x64 4x8192x4x32 2x8192x4x64"
session_step() {
  case "$1" in
    ptest)
      md5sum cuflash/_config.py | cut -c1-12
      python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider tests/test_paged_direct_gpu.py tests/test_paged_varlen_gpu.py \
        tests/test_kvcache_device.py -k "direct or chunk or prefill" > "$OUT/${N}_ptest.log" 2>&1
      grep -E "^FAILED|^ERROR|^E .*seed" "$OUT/${N}_ptest.log" | cut -c1-300 | head -20
      echo "ptest: $(tail -n 1 "$OUT/${N}_ptest.log")" ;;
    proute)
      python3 bench/dev/prefill_route.py --batches --shapes ${PROUTE_SHAPES:-$PROUTE_DEFAULT} \
        --layouts ${PROUTE_LAYOUTS:-paged16} --eager "${PROUTE_EAGER:-20}" --json "$OUT/${N}_proute.json" \
        > "$OUT/${N}_proute.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_proute.log" | cut -c1-220 ;;
    pprefill)
      python3 bench/dev/paged_prefill.py --eager "${PP_EAGER:-10}" --json "$OUT/${N}_pprefill.json" \
        > "$OUT/${N}_pprefill.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_pprefill.log" | cut -c1-240 ;;
    abfeat)  # the forward with options (the warp-specialized feature kernel), OLD against this tree
      TREES="old=$OLD new=." OPTS="${AB_OPTS:-kvlen=0.9 softcap=30}" ROUNDS="${ROUNDS:-7}" \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_abfeat.log" 2>&1
      grep -E "kvlen|softcap|^geomean|Error|error" "$OUT/${N}_abfeat.log" | cut -c1-200 ;;
    reager|tsuite) s69_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
