#!/usr/bin/env bash
# Session 43's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# wstests, splitab, threeab, splittest, probe, ab against OLD, grid, dgrid, dtests).
#   eprobe    bench/dev/eager_probe.py: single eager decode calls, host and event time, per switch (EP_ARGS)
#   stab      the 4-warp decode kernel's pipeline stages forced (decode_splits.py --stages; STS), one process
#   STEPS="l2ab" CALL=c1 bash bench/dev/s43_call.sh   (OUT: where logs go; the kernel cache carried as
#   .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main43}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    eprobe)
      python3 bench/dev/eager_probe.py ${EP_ARGS:-} > "$OUT/${N}_eprobe.log" 2>&1
      cut -c1-200 "$OUT/${N}_eprobe.log" | tail -n 60 ;;
    stab)
      python3 bench/dev/decode_splits.py --splits 0 --paged --stages ${STS:-0 2 4 5 0} \
        --calls "${CALLS:-20}" --rounds "${ROUNDS:-5}" --json "$OUT/${N}_stab.json" \
        --shapes ${SHAPES2:-16x131072x4 1x8192x4 1x2048x4 4x32768x8 16x8192x8 1x131072x8 64x131072x8 64x8192x1 \
                  256x2048x4} > "$OUT/${N}_stab.log" 2>&1
      cut -c1-160 "$OUT/${N}_stab.log" | tail -n 100 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
