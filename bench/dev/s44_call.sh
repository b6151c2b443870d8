#!/usr/bin/env bash
# Session 44's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# wstests, splitab, threeab, splittest, probe, ab against OLD, grid, dgrid, dtests, dab against OLD: OLD made
# here with git archive HEAD cuflash cuda_src bench/dev/decode_splits.py | tar -x -C .oldtree/main44).
#   sweep     decode_splits.py over split counts x warp counts, contiguous and 16-row pages (SW_SHAPES,
#             SW_SPLITS, SW_WARPS)
#   STEPS="suite sweep" CALL=c1 bash bench/dev/s44_call.sh   (OUT: where logs go; the kernel cache carried as
#   .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main44}"
# the dab step (call_steps.sh) on session 44's shapes unless told otherwise
DAB_SHAPES="${DAB_SHAPES:-1x512x1 4x512x4 1x8192x4 1x32768x4 1x131072x4 4x8192x8 4x2048x8 1x2048x1 4x2048x4 4x8192x4 \
  1x8192x1 16x2048x8 1x2048x8 16x512x8}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    sweep)
      python3 bench/dev/decode_splits.py --paged --splits ${SW_SPLITS:-0 1 2 4 8 16} --warps ${SW_WARPS:-0 4 8} \
        --calls "${CALLS:-20}" --rounds "${ROUNDS:-5}" --json "$OUT/${N}_sweep.json" \
        --shapes ${SW_SHAPES:-16x2048x8 16x512x4 4x512x1 16x512x8 4x512x4 1x131072x4 1x8192x4 1x2048x1 1x2048x4} \
        > "$OUT/${N}_sweep.log" 2>&1
      grep -c us "$OUT/${N}_sweep.log"; tail -n 3 "$OUT/${N}_sweep.log" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
