#!/usr/bin/env bash
# Session 61's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, host,
# newcache, ...).
#   knob   the warp-specialized backward's tuning switches at head_dim 128 against the library's
#          settings, one process, interleaved (bench/dev/fwd_ab_inproc.py PASS=bwd): the causal tail
#          group of 2 waves and of none, 3 stages of the Q / dO ring, dQ through sdQ and a bulk
#          reduction (KNOB_SEQS, KNOB_ROUNDS)
#   STEPS="suite slow newcache" CALL=c1 bash bench/dev/s61_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main61}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    knob)
      PASS=bwd HDS=128 SEQS="${KNOB_SEQS:-2048 4096}" ROUNDS="${KNOB_ROUNDS:-9}" \
        TREES="base=. tail2=. tail0=. st3=. bulk=." \
        TREE_ENV="tail2:CUFLASH_BWD_TAIL_WAVES=2 tail0:CUFLASH_BWD_TAIL_WAVES=0 st3:CUFLASH_BWD_WS_STAGES=3 bulk:CUFLASH_BWD_DQ_RED=0" \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_knob.log" 2>&1
      grep -E "^bwd|^geomean|Error|error" "$OUT/${N}_knob.log" | cut -c1-200 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
(cd "$OUT" && tar czf "${N}_logs.tgz" $(ls ${N}_*.log ${N}_*.json 2>/dev/null) && find . -maxdepth 1 \
  -name "${N}_*" ! -name "${N}_logs*.tgz" ! -name "${N}_newcache.tgz" -delete)
