#!/usr/bin/env bash
# Session 63's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s62_call.sh's envab.
#   rbw    bench/dev/decode_read_bw.py at 256 x 2048 x 32 kv heads and at its default 64 x 8192 x 32
#          (--no-rows): the read-only readers, the persistent ones among them, beside cuflash's decode
#          and cuDNN's (the bandwidth-bound point of issue 13: 256 x 2k x 1)
#   tail   bench_decode.py at 128 / 256 / 512 x 2048 x GQA 1, contiguous, cuflash and cuDNN, GPU time
#          only: what a launch costs beyond its bytes (2 T(256) - T(512))
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
    envab) s62_step envab ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
