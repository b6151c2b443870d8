#!/usr/bin/env bash
# Session 71's device calls: the steps below, those of bench/dev/s70_call.sh (ptest, proute, abfeat)
# and of bench/dev/call_steps.sh (suite, slow, dtests, dgrid, host, newcache, ...).
#   pprefill  bench/dev/paged_prefill.py at pages PP_PAGES (default 16 32 64 256): the pages read in place into
#             the interleaved layout (whole-row boxes) and into SW128 panels (a box a panel, session 70's),
#             the gather, the rule and the keys already packed (GPU time; PP_EAGER single eager calls; PP_SHAPES)
#   STEPS="ptest pprefill" CALL=c1 bash bench/dev/s71_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s70_step() { (source /dev/stdin <<< "$(sed -n '/^PROUTE_DEFAULT=/,/^}/p' bench/dev/s70_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    pprefill)
      python3 bench/dev/paged_prefill.py --pages ${PP_PAGES:-16 32 64 256} --eager "${PP_EAGER:-0}" ${PP_SHAPES:+--shapes $PP_SHAPES} \
        --json "$OUT/${N}_pprefill.json" > "$OUT/${N}_pprefill.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_pprefill.log" | cut -c1-260 ;;
    ptest|proute|abfeat) s70_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
