#!/usr/bin/env bash
# Session 51's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, dab against OLD, psplit, tl, host, newcache, ...).
#   esplit   bench/dev/eager_splits.py: single eager calls and GPU time at forced split counts beside the
#            library's plan and the peers (ES_SHAPES, ES_SPLITS, ES_PAGED=1 for 16-row pages, ES_REPS)
#   esab     eager_splits.py at the library's plans, OLD's tree and this one alternately (ES_SHAPES, ES_PAGED)
#   esalloc  eager_splits.py --alloc --paged twice: the stream's scratch against an allocation a call
#   grid8    bench.py's full grid with the peers, GRID_ROUNDS (8) rounds, and its plots
#   tmaab    decode_splits.py at the library's plans, contiguous and 16-row pages, with the TMA decode
#            kernel and with the cp.async one (CUFLASH_DECODE_TMA=0), alternately, each its own process
#            (TA_SHAPES)
#   STEPS="esplit tmaab" CALL=c1 bash bench/dev/s51_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main51}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    esplit)
      python3 bench/dev/eager_splits.py --reps "${ES_REPS:-200}" --shapes ${ES_SHAPES:-1x8192x1 1x32768x4 1x32768x8} \
        --splits ${ES_SPLITS:-4 8 16} $([ "${ES_PAGED:-0}" = 1 ] && echo --paged) --json "$OUT/${N}_esplit.json" \
        > "$OUT/${N}_esplit.log" 2>&1
      grep -v "^NVIDIA\|^==" "$OUT/${N}_esplit.log" | tail -n 60 ;;
    tmaab)
      k=0
      for tma in 1 0 1 0; do
        k=$((k + 1))
        CUFLASH_DECODE_TMA=$tma python3 bench/dev/decode_splits.py --paged --splits 0 --calls 50 --rounds 7 \
          --shapes ${TA_SHAPES:-4x512x1 16x512x4 16x512x8 16x2048x8} --json "$OUT/${N}_tmaab_${k}_tma$tma.json" \
          > "$OUT/${N}_tmaab_${k}_tma$tma.log" 2>&1
        echo "== run $k (TMA $tma)"; grep " us " "$OUT/${N}_tmaab_${k}_tma$tma.log"
      done ;;
    esab)  # eager_splits.py at the library's plans on OLD's tree and this one, alternately, each its own process
      k=0
      for t in "$OLD" . "$OLD" .; do
        k=$((k + 1)); tag=$([ "$t" = . ] && echo new || echo old)
        [ "$t" != . ] && cp bench/dev/eager_splits.py bench/dev/eager_parts.py bench/dev/decode_splits.py "$t/bench/dev/"
        PYTHONPATH="$t" python3 "$t/bench/dev/eager_splits.py" --reps "${ES_REPS:-200}" --splits \
          --shapes ${ES_SHAPES:-1x8192x1 1x32768x4 1x32768x8 16x2048x8} $([ "${ES_PAGED:-0}" = 1 ] && echo --paged) \
          --json "$OUT/${N}_esab_${k}_${tag}.json" > "$OUT/${N}_esab_${k}_${tag}.log" 2>&1
        echo "== run $k ($tag)"; grep -v "^NVIDIA\|^==" "$OUT/${N}_esab_${k}_${tag}.log" | cut -c1-110
      done ;;
    esalloc)  # eager_splits.py --alloc: the stream's scratch against a per-call allocation, in one process (x2)
      for k in 1 2; do
        python3 bench/dev/eager_splits.py --reps "${ES_REPS:-300}" --splits --alloc --paged \
          --shapes ${ES_SHAPES:-1x8192x1 1x32768x4 1x32768x8 16x2048x8} --json "$OUT/${N}_esalloc_$k.json" \
          > "$OUT/${N}_esalloc_$k.log" 2>&1
        echo "== run $k"; grep -v "^NVIDIA\|^==" "$OUT/${N}_esalloc_$k.log" | cut -c1-100
      done ;;
    grid8)  # bench.py's full grid with the peers, 8 rounds (session 42's setting), and its plots
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --rounds "${GRID_ROUNDS:-8}" --no-compile-timing \
        --json "$OUT/${N}_grid.json" --plots "$OUT/${N}_plots" > "$OUT/${N}_grid.log" 2>&1
      sed -n '/^cuflash \/ SDPA flash (TFLOP/,/^cuflash errors/p' "$OUT/${N}_grid.log" | head -60 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" ! -name "${N}_grid.json" ! -name "${N}_plots" -delete)
