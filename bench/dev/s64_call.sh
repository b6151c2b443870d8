#!/usr/bin/env bash
# Session 64's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s62_call.sh's envab.
#   rot    bench/dev/decode_read_bw.py --only-rot at ROT_SHAPES (BxLxHKV, default 4x8192x32 16x8192x8
#          256x2048x32 64x8192x32): the whole-tile TMA readers walking each block's keys in order and
#          from a rotated start, beside cuflash's decode (contiguous; 16-, 64- and 256-row pages) and
#          cuDNN's. Does the contiguous cache's regular layout cost time (4 x 8k x 1 reads 1.3 % slower
#          than 16 x 8k x 4 with the same kernel and bytes; 64-row random pages read 0.55 % faster than
#          contiguous at 64 x 8k x 32 in session 63)?
#   sk     the same at SK_SHAPES with --only-sk: the stream-K readers (the items' tiles as one sequence cut
#          into equal ranges, 1-3 blocks an SM) against a block an item
#   esplit bench/dev/eager_splits.py (single eager calls at forced split counts beside the library's plan)
#          at ES_SHAPES, ES_SPLITS, with the library's warps and with CUFLASH_DECODE_WARPS=8 (ES_WARPS)
#   idleab eager_splits.py (the library's plan, cuDNN, SDPA flash) at ES_SHAPES with CUFLASH_DECODE_IDLE
#          1 / 0 / 1 / 0 (IDLE_MODES), each its own process: the idle variant (DecodePlan.idle) against none
#   beager bench_decode.py at BE_BATCHES (1 2) x BE_CACHES (2k-32k) x GQA 8, contiguous, 200 single eager
#          calls a point, with CUFLASH_DECODE_IDLE=1 and =0 (BE_MODES)
#   nrate  bench/dev/near_equal_rate.py on the GPU: how often the near-equal-scores criterion fails in
#          NR_DRAWS (4000) draws a setting (bf16: 4 and 8 keys, tiny queries and softcap; fp16: 8 keys,
#          tiny queries; head_dim 16 / 64 / 128)
#   dst    bench/dev/decode_splits.py at DST_SHAPES with --stages DST_STAGES (0 2 3 4) --splits DST_SPLITS (0) (the depth at the
#          one-block-an-SM points)
#   STEPS="rot dst" CALL=c1 bash bench/dev/s64_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s62_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s62_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    rot)
      local sh b l hk
      for sh in ${ROT_SHAPES:-4x8192x32 16x8192x8 256x2048x32 64x8192x32}; do
        IFS=x read -r b l hk <<< "$sh"
        python3 bench/dev/decode_read_bw.py --only-rot --batch "$b" --seqlen "$l" --heads-kv "$hk" \
          --json "$OUT/${N}_rot_$sh.json" > "$OUT/${N}_rot_$sh.log" 2>&1
        echo "== $sh"; cat "$OUT/${N}_rot_$sh.log"
      done ;;
    sk)
      local sh b l hk
      for sh in ${SK_SHAPES:-4x8192x32 16x8192x8 4x32768x32 1x32768x32 256x2048x32}; do
        IFS=x read -r b l hk <<< "$sh"
        python3 bench/dev/decode_read_bw.py --only-sk --batch "$b" --seqlen "$l" --heads-kv "$hk" \
          --json "$OUT/${N}_sk_$sh.json" > "$OUT/${N}_sk_$sh.log" 2>&1
        echo "== $sh"; grep -v "pages" "$OUT/${N}_sk_$sh.log"
      done ;;
    esplit)  # eager_splits.py at ES_SHAPES, splits ES_SPLITS, the library's warps and 8 (CUFLASH_DECODE_WARPS=8)
      local w
      for w in ${ES_WARPS:-0 8}; do
        env $([ "$w" != 0 ] && echo CUFLASH_DECODE_WARPS=$w) python3 bench/dev/eager_splits.py --reps "${ES_REPS:-300}" \
          --shapes ${ES_SHAPES:-1x2048x8 1x4096x8 1x8192x8 1x32768x8 2x2048x8 2x8192x8} --splits ${ES_SPLITS:-4 8} \
          --json "$OUT/${N}_esplit_w$w.json" > "$OUT/${N}_esplit_w$w.log" 2>&1
        echo "== warps $w"; grep -E "==|contig|cudnn" "$OUT/${N}_esplit_w$w.log"
      done ;;
    idleab)  # eager_splits.py (the library's plan only) with CUFLASH_DECODE_IDLE 1 / 0 / 1 / 0, each its own process
      local k=0 m
      for m in ${IDLE_MODES:-1 0 1 0}; do
        k=$((k + 1))
        env CUFLASH_DECODE_IDLE=$m python3 bench/dev/eager_splits.py --reps "${ES_REPS:-300}" --splits \
          --shapes ${ES_SHAPES:-1x2048x8 1x4096x8 1x8192x8 1x32768x8 2x2048x8 2x8192x8} \
          --json "$OUT/${N}_idleab_m${m}_$k.json" > "$OUT/${N}_idleab_m${m}_$k.log" 2>&1
        echo "== CUFLASH_DECODE_IDLE=$m ($k)"; grep -E "contig|cudnn" "$OUT/${N}_idleab_m${m}_$k.log"
      done ;;
    beager)  # bench_decode.py: single eager calls (200 a point) at BE_BATCHES x BE_CACHES x GQA 8, with the idle variant and without
      local m
      for m in ${BE_MODES:-1 0}; do
        env CUFLASH_DECODE_IDLE=$m python3 bench/bench_decode.py --batches ${BE_BATCHES:-1 2} \
          --caches ${BE_CACHES:-2048 4096 8192 32768} --gqa ${BE_GQA:-8} --layouts contiguous \
          --impls cuflash sdpa_flash sdpa_cudnn --eager-reps 200 --rounds 11 --no-host \
          --json "$OUT/${N}_beager_m$m.json" > "$OUT/${N}_beager_m$m.log" 2>&1
        echo "== bench_decode CUFLASH_DECODE_IDLE=$m"; tail -n 14 "$OUT/${N}_beager_m$m.log"
      done ;;
    nrate)
      python3 bench/dev/near_equal_rate.py --path gpu --draws "${NR_DRAWS:-4000}" --head-dims 16 64 128 \
        --keys 4 8 --modes tiny_q softcap --dtypes bf16 --json "$OUT/${N}_nrate.json" > "$OUT/${N}_nrate.log" 2>&1
      python3 bench/dev/near_equal_rate.py --path gpu --draws "${NR_DRAWS:-4000}" --head-dims 16 64 128 \
        --keys 8 --modes tiny_q --dtypes fp16 --json "$OUT/${N}_nrate16.json" >> "$OUT/${N}_nrate.log" 2>&1
      cat "$OUT/${N}_nrate.log" ;;
    dst)
      python3 bench/dev/decode_splits.py --splits ${DST_SPLITS:-0} --stages ${DST_STAGES:-0 2 3 4} --calls 30 --rounds 9 \
        --shapes ${DST_SHAPES:-4x8192x1 16x8192x4 4x32768x1 16x32768x4} --json "$OUT/${N}_dst.json" \
        > "$OUT/${N}_dst.log" 2>&1
      tail -n 30 "$OUT/${N}_dst.log" ;;
    envab) s62_step envab ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
