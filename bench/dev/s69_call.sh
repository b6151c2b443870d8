#!/usr/bin/env bash
# Session 69's device calls: the steps below, those of bench/dev/call_steps.sh (suite, slow, dtests, dgrid,
# host, newcache, ...) and bench/dev/s68_call.sh's (route, chunk, ...).
#   reager  bench/dev/prefill_route.py --eager: the chunk routes' GPU time beside single eager calls (host
#           included) and the host's part, at REAGER_SHAPES, contiguous and 16-row pages
#   tsuite  the quick GPU suite (as suite) under a time limit (SUITE_LIMIT s, default 500), so that a cold
#           kernel cache's compiles cannot take the call past its limit before newcache runs
#   STEPS="reager" CALL=c1 bash bench/dev/s69_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s68_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s68_call.sh)"; session_step "$1"); }
REAGER_DEFAULT="1x8192x8x16 4x8192x8x16 1x2048x8x128 4x2048x8x64 16x2048x4x64 1x8192x8x64 2x8192x8x64 \
4x8192x8x64 4x8192x4x64 16x8192x8x128 1x32768x8x256 4x32768x8x128"
session_step() {
  case "$1" in
    reager)
      python3 bench/dev/prefill_route.py --batches --shapes ${REAGER_SHAPES:-$REAGER_DEFAULT} \
        --layouts contig paged16 --eager "${REAGER_N:-40}" --json "$OUT/${N}_reager.json" > "$OUT/${N}_reager.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_reager.log" | cut -c1-200 ;;
    tsuite)
      timeout "${SUITE_LIMIT:-500}" python3 -m pytest -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider tests \
        > "$OUT/${N}_suite.log" 2>&1
      echo "tsuite (rc $?): $(tail -n 1 "$OUT/${N}_suite.log")" ;;
    route|chunk|m4t|m4ab|specE|specF|psq|esq|abx|seed|dstar|wave|mid|w8|midab|wide2k|bwdt) s68_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
