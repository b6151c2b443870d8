#!/usr/bin/env bash
# Session 63's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s62_call.sh's envab.
#   rbw    bench/dev/decode_read_bw.py at 256 x 2048 x 32 kv heads and at its default 64 x 8192 x 32
#          (--no-rows): the read-only readers, the persistent ones among them, beside cuflash's decode
#          and cuDNN's (the bandwidth-bound point of issue 13: 256 x 2k x 1)
#   tail   bench_decode.py at 128 / 256 / 512 x 2048 x GQA 1, contiguous, cuflash and cuDNN, GPU time
#          only: what a launch costs beyond its bytes (2 T(256) - T(512))
#   eagerx bench_decode.py at the shapes whose single eager calls or graph replays read over the faster
#          peer's in session 62's grids (batch 1 / 4 / 16, caches 2k / 8k / 32k, GQA 1 / 4 / 8), with
#          --eager-reps 200 (the grid takes 20) and 11 rounds: noise or a real gap? And 256 x 2k x 1
#          with 21 rounds (GPU time).
#   eparts bench/dev/eager_parts.py (a single eager call's host time, part by part, against cuDNN's) at
#          EP_SHAPES, EP_REPS single calls a variant; eparts0 the same with CUFLASH_DECODE_SPARE=0
#   envab2 a second envab in the same call (ENVAB2_VAR, ENVAB2_MODES; the same ENVAB_SHAPES)
#   STEPS="rbw tail envab newcache" ENVAB_VAR=CUFLASH_DECODE_EVICT_FIRST ENVAB_MODES="0 1 0 1" \
#     ENVAB_SHAPES="256x2048x1 64x8192x1 16x32768x1 4x131072x1" CALL=c1 bash bench/dev/s63_call.sh
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s62_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s62_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    rbw)
      python3 bench/dev/decode_read_bw.py --batch 256 --seqlen 2048 --heads-kv 32 --no-rows \
        --json "$OUT/${N}_rbw256.json" > "$OUT/${N}_rbw256.log" 2>&1
      cat "$OUT/${N}_rbw256.log"
      python3 bench/dev/decode_read_bw.py --no-rows --json "$OUT/${N}_rbw64.json" > "$OUT/${N}_rbw64.log" 2>&1
      cat "$OUT/${N}_rbw64.log" ;;
    tail)
      python3 bench/bench_decode.py --batches 128 256 512 --caches 2048 --gqa 1 --layouts contiguous \
        --impls cuflash sdpa_cudnn --no-graph --no-host --eager-reps 0 --json "$OUT/${N}_tail.json" \
        > "$OUT/${N}_tail.log" 2>&1
      tail -n 25 "$OUT/${N}_tail.log" ;;
    eagerx)
      python3 bench/bench_decode.py --batches 1 4 16 --caches 2048 8192 32768 --gqa 1 4 8 --layouts contiguous \
        --impls cuflash sdpa_flash sdpa_cudnn --eager-reps 200 --rounds 11 --no-host --json "$OUT/${N}_eagerx.json" \
        > "$OUT/${N}_eagerx.log" 2>&1
      tail -n 45 "$OUT/${N}_eagerx.log"
      python3 bench/bench_decode.py --batches 256 --caches 2048 --gqa 1 --layouts contiguous \
        --impls cuflash sdpa_flash sdpa_cudnn --rounds 21 --no-host --json "$OUT/${N}_bw21.json" \
        > "$OUT/${N}_bw21.log" 2>&1
      tail -n 25 "$OUT/${N}_bw21.log" ;;
    eparts|eparts0)  # eparts0: the same with CUFLASH_DECODE_SPARE=0 (outputs allocated before each launch)
      env CUFLASH_DECODE_SPARE="$([ "$1" = eparts0 ] && echo 0 || echo 1)" python3 bench/dev/eager_parts.py \
        --reps "${EP_REPS:-300}" --shapes ${EP_SHAPES:-4x8192x8 4x2048x1 1x8192x1 16x2048x4 1x2048x4} \
        --json "$OUT/${N}_$1.json" > "$OUT/${N}_$1.log" 2>&1
      grep -E "==| lib | cudnn " "$OUT/${N}_$1.log" ;;
    envab) s62_step envab ;;
    envab2)  # a second envab in the same call: ENVAB2_VAR, ENVAB2_MODES (files ${N}_2_envab_*)
      (N="${N}_2" ENVAB_VAR="$ENVAB2_VAR" ENVAB_MODES="$ENVAB2_MODES" s62_step envab) ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
