#!/usr/bin/env bash
# Session 48's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, dab against OLD, ...).
#   dabmid    dab against MID (default .oldtree/mid48), its files named ${CALL}_m_dab_*
#   psplit    decode_splits.py on this tree at forced split counts (PS_SPLITS) and warps (PS_WARPS)
#   tl        bench/dev/decode_timeline.py on this tree (TL_SHAPES, --paged): one block's timeline per
#             shape, idle / graph / back-to-back (its kernels carry the probe, their own cache entries)
#   STEPS="tl dab dtests" CALL=c2 OLD=.oldtree/main48 bash bench/dev/s48_call.sh   (OUT: where logs go;
#   the kernel cache carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main48}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    tl)
      python3 bench/dev/decode_timeline.py --paged --reps "${TL_REPS:-10}" --modes ${TL_MODES:-idle graph} \
        --shapes ${TL_SHAPES:-16x512x8 4x512x1 1x8192x4 16x2048x8 64x8192x8} --json "$OUT/${N}_tl.json" \
        > "$OUT/${N}_tl.log" 2>&1
      echo "tl: $(grep -c span "$OUT/${N}_tl.log") rows" ;;
    dabmid)
      local n0="$N" o0="$OLD"
      N="${N}_m" OLD="${MID:-.oldtree/mid48}"
      common_step dab
      N="$n0" OLD="$o0" ;;
    psplit)
      python3 bench/dev/decode_splits.py --paged --splits ${PS_SPLITS:-0 4 8 16 32} --warps ${PS_WARPS:-0} \
        --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" --json "$OUT/${N}_psplit.json" \
        --shapes ${PS_SHAPES:-1x8192x4 1x2048x4 16x512x8 4x512x8 1x8192x8} > "$OUT/${N}_psplit.log" 2>&1
      grep -c " us " "$OUT/${N}_psplit.log"; tail -n 2 "$OUT/${N}_psplit.log" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
# one archive of the call's logs and JSON (the device returns a few files a call), beside the grid's
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" -delete)
