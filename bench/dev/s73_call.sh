#!/usr/bin/env bash
# Session 73's device calls: the steps below and those of bench/dev/call_steps.sh (suite, slow, dtests,
# layout, dgrid, host, ...).
#   speers   now in call_steps.sh
#   rdbw     bench/dev/decode_read_bw.py (every reader, cuflash's decode and cuDNN's) at RD_SHAPES (BxLxHEADS_KV,
#            default 16x131072x8 4x8192x32), 7 rounds (call 4 ran these two lines inline, logs rd_*)
#   lateab   bench/dev/latetree/decode_split_peers.py on the tree bench/dev/latetree (not on main: 2eccb61's cuflash
#            and cuda_src with bench/dev/s73_late_issue.patch, under which CUFLASH_DECODE_LATE_ISSUE=1 compiles the TMA
#            decode kernels of 3+ stages to issue tile it + STAGES - 1 from warp 0 once tile it landed, contiguous
#            caches; made by git archive 2eccb61 cuflash cuda_src | tar -x -C bench/dev/latetree, patch -p1 there,
#            decode_split_peers.py and decode_splits.py copied in, its kernels built into bench/dev/latetree/cf):
#            the library's plan, the plan made under that setting, and cuDNN, at LA_SHAPES
#   STEPS="speers" CALL=c1 bash bench/dev/s73_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    rdbw)
      for s in ${RD_SHAPES:-16x131072x8 4x8192x32}; do
        IFS=x read -r rb rl rh <<< "$s"
        python3 bench/dev/decode_read_bw.py --batch "$rb" --seqlen "$rl" --heads-kv "$rh" --rounds "${RD_ROUNDS:-7}" ${RD_ARGS:-} \
          --json "$OUT/${N}_rd_$s.json" > "$OUT/${N}_rd_$s.log" 2>&1
        echo "== $s"; grep -E " us |rror" "$OUT/${N}_rd_$s.log" | cut -c1-150
      done ;;
    lateab)
      CUFLASH_CACHE_DIR="$PWD/bench/dev/latetree/cf" PYTHONPATH=bench/dev/latetree python3 \
        bench/dev/latetree/decode_split_peers.py --shapes ${LA_SHAPES:-16x131072x4 4x131072x1 4x8192x1 16x32768x4 \
        4x32768x1 16x8192x4 64x8192x4 16x8192x1 1x131072x1 16x2048x4 4x512x1 256x8192x8} --splits \
        --settings late:CUFLASH_DECODE_LATE_ISSUE=1 --rounds "${LA_ROUNDS:-11}" --json "$OUT/${N}_lateab.json" \
        > "$OUT/${N}_lateab.log" 2>&1
      grep -E "^==| us |Error|error" "$OUT/${N}_lateab.log" | cut -c1-200 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
