#!/usr/bin/env bash
# Session 65's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s64_call.sh's (rot, sk, esplit, idleab, beager, nrate, dst).
#   dyn    bench/dev/decode_read_bw.py --only-dyn at DYN_SHAPES (BxLxHKV, default 256x2048x32 64x8192x32):
#          the whole-tile TMA readers, a block an item, against persistent readers that walk fixed strides
#          (read_tma_persist) and ones that take their next item from a global counter (read_tma_dyn),
#          beside cuflash's decode and cuDNN's. Does a persistent kernel whose items stay consecutive read the
#          many-wave bandwidth-bound points faster than a block an item (session 63's lever: each block's
#          start and epilogue without copies in flight)?
#   spec   bench_decode.py with --seqlen-q SQ (SPEC_SQ, default 2 4 8: speculative decoding, every
#          implementation non-causal) at SPEC_BATCHES (1 16 64) x SPEC_CACHES (2048 8192 32768) x GQA 1 4 8,
#          contiguous, no host section
#   specab the same at SPEC_SQ (4 8) x GQA SPEC_GQA (4 8) with CUFLASH_DECODE_TWO_TILES 1 / 0 (SPEC_MODES), each
#          its own process: the decode kernel with two m16 tiles a warp against the 16-row kernel
#   dgrid2 bench_decode.py's full grid again, as ${N}_2 (two grids on one card)
#   STEPS="dyn dgrid dgrid2" CALL=c1 bash bench/dev/s65_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s64_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s64_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    dyn)
      local sh b l hk
      for sh in ${DYN_SHAPES:-256x2048x32 64x8192x32}; do
        IFS=x read -r b l hk <<< "$sh"
        python3 bench/dev/decode_read_bw.py --only-dyn --batch "$b" --seqlen "$l" --heads-kv "$hk" \
          --json "$OUT/${N}_dyn_$sh.json" > "$OUT/${N}_dyn_$sh.log" 2>&1
        echo "== $sh"; grep -v "pages" "$OUT/${N}_dyn_$sh.log"
      done ;;
    spec)
      local sq
      for sq in ${SPEC_SQ:-2 4 8}; do
        python3 bench/bench_decode.py --seqlen-q "$sq" --batches ${SPEC_BATCHES:-1 16 64} \
          --caches ${SPEC_CACHES:-2048 8192 32768} --gqa 1 4 8 --layouts ${SPEC_LAYOUTS:-contiguous} \
          --impls cuflash sdpa_flash sdpa_cudnn --no-host --json "$OUT/${N}_spec$sq.json" > "$OUT/${N}_spec$sq.log" 2>&1
        echo "== seqlen_q $sq"; grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ +[0-9k]+ " "$OUT/${N}_spec$sq.log" | tail -n 30
        grep -E "MISSED|MET " "$OUT/${N}_spec$sq.log" | head -n 2
      done ;;
    specab)
      local sq m
      for sq in ${SPEC_SQ:-4 8}; do
        for m in ${SPEC_MODES:-1 0}; do
          env CUFLASH_DECODE_TWO_TILES=$m python3 bench/bench_decode.py --seqlen-q "$sq" --batches ${SPEC_BATCHES:-1 16 64} \
            --caches ${SPEC_CACHES:-2048 8192 32768} --gqa ${SPEC_GQA:-4 8} --layouts ${SPEC_LAYOUTS:-contiguous} \
            --impls cuflash sdpa_cudnn --no-host --no-graph --eager-reps 0 \
            --json "$OUT/${N}_specab${sq}_m$m.json" > "$OUT/${N}_specab${sq}_m$m.log" 2>&1
          echo "== seqlen_q $sq CUFLASH_DECODE_TWO_TILES=$m"
          grep -E "^ *[0-9]+ +[0-9]+ +[0-9]+ +[0-9k]+ " "$OUT/${N}_specab${sq}_m$m.log" | tail -n 30
        done
      done ;;
    dgrid2) (N="${N}_2"; common_step dgrid) ;;
    rot|sk|esplit|idleab|beager|nrate|dst|envab) s64_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
