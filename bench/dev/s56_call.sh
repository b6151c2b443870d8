#!/usr/bin/env bash
# Session 56's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, psplit, newcache, ...).
#   esplit  bench/dev/eager_splits.py at ES_SHAPES (default: the 12 eager points of session 55, batch 1 / 4 x
#           2k / 8k / 32k x GQA 4 / 8) with forced split counts ES_SPLITS beside the library's plan and the
#           peers: single eager calls, back-to-back GPU time, and the GPU time of one call alone (gpu1);
#           ES_ENV: environment for it (CUFLASH_PDL=0, say), ES_TAG: a suffix of its file names
#   inner   bench/dev/eager_inner.py at IN_SHAPES (the plans whose eager call has a combine kernel): the
#           combine launched plainly or as a programmatic dependent of the call's decode kernel, and cuDNN
#   gcnt    bench/dev/graph_counters_ab.py (GC_SHAPES): graph replay by capture stream and fused limit
#   STEPS="esplit" CALL=c1 bash bench/dev/s56_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main56}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    esplit)
      env ${ES_ENV:-} python3 bench/dev/eager_splits.py --shapes ${ES_SHAPES:-1x2048x4 1x2048x8 1x8192x4 1x8192x8 \
        1x32768x4 1x32768x8 4x2048x4 4x2048x8 4x8192x4 4x8192x8 4x32768x4 4x32768x8} \
        --splits ${ES_SPLITS:-1 4 8 16 32} --reps "${ES_REPS:-150}" --gpu1-rounds "${ES_G1:-60}" \
        --json "$OUT/${N}_esplit${ES_TAG:-}.json" > "$OUT/${N}_esplit${ES_TAG:-}.log" 2>&1
      echo "esplit${ES_TAG:-}: $(grep -c ' gpu1 ' "$OUT/${N}_esplit${ES_TAG:-}.log") rows"
      grep -E "Error|error" "$OUT/${N}_esplit${ES_TAG:-}.log" | head -5 ;;
    inner)
      python3 bench/dev/eager_inner.py --shapes ${IN_SHAPES:-1x2048x8 1x8192x8 1x32768x8 1x131072x8} \
        --reps "${IN_REPS:-300}" --json "$OUT/${N}_inner.json" > "$OUT/${N}_inner.log" 2>&1
      cat "$OUT/${N}_inner.log" | tail -n 20 ;;
    gcnt)
      python3 bench/dev/graph_counters_ab.py ${GC_SHAPES:+--shapes $GC_SHAPES} --json "$OUT/${N}_gcnt.json" \
        > "$OUT/${N}_gcnt.log" 2>&1
      tail -n 40 "$OUT/${N}_gcnt.log" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs "${ES_TAG:-}"
