#!/usr/bin/env bash
# Session 55's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, psplit, ...).
#   lsplit  decode_splits.py at the long contiguous points still over the peers (LS_SHAPES, default 256 x
#           128k x 8, 256 x 32k x 8, 16 x 128k x 1, 16 x 32k x 1) at forced split counts (LS_SPLITS) and
#           4-warp pipeline depths (LS_STAGES; 0: the library's choice)
#   pstage  decode_splits.py --paged at PST_SHAPES (16 x 2k x 8) over splits (PST_SPLITS), depths
#           (PST_STAGES) and warps (PST_WARPS)
#   fillab  decode_splits.py --paged at the library's plans (FA_SHAPES), with the paged fill rule and without
#           (CUFLASH_DECODE_PAGED_FILL=0), alternated twice, each its own process
#   ruleab  decode_splits.py --paged at the library's plans (RA_SHAPES) with a rule (the tree's default) and
#           without it (RA_VAR=0, default CUFLASH_DECODE_LONG_SPLIT), alternated twice, each its own process
#   eagerpts  bench_decode.py at the eager grid's worst points (EP_BATCHES x EP_CACHES x EP_GQA), contiguous,
#           with EP_REPS single eager calls per implementation and shape; EP_ENV: environment for it, and
#           EP_TAG: a suffix of its file names
#   STEPS="lsplit psplit" CALL=c1 bash bench/dev/s55_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main55}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    lsplit)
      python3 bench/dev/decode_splits.py --splits ${LS_SPLITS:-0 2 3 4} --stages ${LS_STAGES:-0 2 4} \
        --calls "${CALLS:-20}" --rounds "${ROUNDS:-5}" --json "$OUT/${N}_lsplit.json" \
        --shapes ${LS_SHAPES:-256x131072x8 256x32768x8 16x131072x1 16x32768x1} > "$OUT/${N}_lsplit.log" 2>&1
      echo "lsplit: $(grep -c ' us ' "$OUT/${N}_lsplit.log") rows"; grep -E "Error|error" "$OUT/${N}_lsplit.log" | head -5 ;;
    pstage)
      python3 bench/dev/decode_splits.py --paged --splits ${PST_SPLITS:-0 1 2 4} --stages ${PST_STAGES:-0 2 3 4} \
        --warps ${PST_WARPS:-4 8} --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" --json "$OUT/${N}_pstage.json" \
        --shapes ${PST_SHAPES:-16x2048x8} > "$OUT/${N}_pstage.log" 2>&1
      echo "pstage: $(grep -c ' us ' "$OUT/${N}_pstage.log") rows"; grep -E "Error|error" "$OUT/${N}_pstage.log" | head -5 ;;
    fillab)
      local k=0 t
      for t in fill nofill fill nofill; do
        k=$((k + 1))
        if [ "$t" = fill ]; then unset CUFLASH_DECODE_PAGED_FILL; else export CUFLASH_DECODE_PAGED_FILL=0; fi
        python3 bench/dev/decode_splits.py --paged --splits 0 --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" \
          --json "$OUT/${N}_fillab_$t$k.json" --shapes ${FA_SHAPES:-16x2048x8 16x8192x8 16x32768x8 4x8192x4 4x32768x4 \
          1x8192x1 1x32768x1 4x8192x8 4x32768x8 1x32768x4 1x131072x4} > "$OUT/${N}_fillab_$t$k.log" 2>&1
        echo "fillab $t$k: $(grep -c ' us ' "$OUT/${N}_fillab_$t$k.log") rows"
      done
      unset CUFLASH_DECODE_PAGED_FILL ;;
    ruleab)
      local k=0 t var="${RA_VAR:-CUFLASH_DECODE_LONG_SPLIT}"
      for t in on off on off; do
        k=$((k + 1))
        if [ "$t" = on ]; then unset "$var"; else export "$var"=0; fi
        python3 bench/dev/decode_splits.py --paged --splits 0 --calls "${CALLS:-20}" --rounds "${ROUNDS:-5}" \
          --json "$OUT/${N}_ruleab_$t$k.json" --shapes ${RA_SHAPES:-256x131072x8 256x32768x8 16x131072x1 16x32768x1 \
          64x131072x4 64x32768x4} > "$OUT/${N}_ruleab_$t$k.log" 2>&1
        echo "ruleab $t$k: $(grep -c ' us ' "$OUT/${N}_ruleab_$t$k.log") rows"
      done
      unset "$var" ;;
    eagerpts)
      env ${EP_ENV:-} python3 bench/bench_decode.py --batches ${EP_BATCHES:-1 4} --caches ${EP_CACHES:-2048 8192 32768} \
        --gqa ${EP_GQA:-4 8} --layouts contiguous --eager-reps "${EP_REPS:-200}" --no-host --no-graph \
        --json "$OUT/${N}_eagerpts${EP_TAG:-}.json" > "$OUT/${N}_eagerpts${EP_TAG:-}.log" 2>&1
      grep -E "MET|MISSED" "$OUT/${N}_eagerpts${EP_TAG:-}.log" | cut -c1-200 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
# (the archive's name carries EP_TAG, so that runs of one call with different tags keep their own)
(cd "$OUT" && tar czf "${N}_logs${EP_TAG:-}.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs*.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" \
  ! -name "${N}_host.json" -delete)
