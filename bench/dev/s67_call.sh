#!/usr/bin/env bash
# Session 67's device calls: the steps below, those of bench/dev/call_steps.sh (suite, slow, dtests, dgrid,
# host, ...) and bench/dev/s66_call.sh's (specE, specF, psq, esq, abx, seed).
#   dstar  bench/dev/bwd_dstar_ab.py: below head_dim 32, the dQ kernel first (D* for the dK/dV kernel) against
#          the former order, in one process: dk's accuracy on shared-component values, and the backward's
#          GPU time at head_dim 8 / 16 / 24 (DSTAR_ENV: environment for it, e.g. "ROUNDS=7")
#   wave   the 1024-block decodes that read 1.14x their time on some cards (256 x 2k / 8k x GQA 8, unsplit 4-warp
#          2-stage blocks, three a SM: 2.59 waves): bench_decode.py at batch 256 / 64 x 2k / 8k / 32k x GQA 8 / 4
#          (cuflash, cuDNN), then decode_splits.py at splits 0 1 2 4 x warps 0 4 8 and at stages 3 4 (4 warps,
#          1-2 splits), twice (WAVE_SHAPES)
#   mid    decode_splits.py at the library's split count, stages 0 (the library's) 2 3, contiguous and 16-row pages, at
#          MID_SHAPES (1024- and 2048-block grids of batch 256 x GQA 8), twice: decode_shallow_tma's mid-waves clause
#   w8     at MID_SHAPES (default the 1024-block ones): bench_decode.py (cuflash, cuDNN), then decode_splits.py unsplit
#          on 4 warps at 2 / 3 stages and on 8 warps (3 stages), alternated twice: 2 stages, 3, or the 8-warp kernel?
#   midab  decode_splits.py at the library's plans with CUFLASH_DECODE_MID_WIDE on / off (new old new old, each its own
#          process) at MIDAB_SHAPES: the shapes _config.decode_mid_wide moves (1024-1536 blocks of 1k-8k keys,
#          speculative ones too) and a 512-key one it leaves
#   wide2k decode_splits.py at the library's split count on its own warps / forced 8 warps, at 2048-block grids that
#          run 2 stages (decode_shallow_tma's many-waves clause; WIDE2K_SHAPES), twice
#   bwdt   the backward GPU test files (tests/test_gpu_backward.py and the feature backward's)
#   STEPS="seed dstar suite slow" CALL=c1 bash bench/dev/s67_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s66_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s66_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    dstar)
      env ${DSTAR_ENV:-} python3 bench/dev/bwd_dstar_ab.py > "$OUT/${N}_dstar.log" 2>&1
      grep -E "^acc|^geomean|Error|error" "$OUT/${N}_dstar.log" | cut -c1-200 ;;
    wave)
      python3 bench/bench_decode.py --batches 256 64 --caches 2048 8192 32768 --gqa 8 4 --layouts contiguous \
        --impls cuflash sdpa_cudnn --no-graph --no-host --eager-reps 10 --json "$OUT/${N}_wave_grid.json" > "$OUT/${N}_wave_grid.log" 2>&1
      grep -E "^ *256|^ *64|copy" "$OUT/${N}_wave_grid.log" | head -n 20
      local k
      for k in 1 2; do
        python3 bench/dev/decode_splits.py --shapes ${WAVE_SHAPES:-256x2048x8 256x8192x8 64x8192x8 256x8192x4} \
          --splits 0 1 2 4 --warps 0 4 8 --calls 20 --rounds 5 --json "$OUT/${N}_wave_sw$k.json" > "$OUT/${N}_wave_sw$k.log" 2>&1
        python3 bench/dev/decode_splits.py --shapes ${WAVE_SHAPES:-256x2048x8 256x8192x8 64x8192x8 256x8192x4} \
          --splits 1 2 --stages 3 4 --warps 4 --calls 20 --rounds 5 --json "$OUT/${N}_wave_st$k.json" > "$OUT/${N}_wave_st$k.log" 2>&1
      done
      tail -n 40 "$OUT/${N}_wave_sw1.log"; tail -n 20 "$OUT/${N}_wave_st1.log" ;;
    mid)
      local k
      for k in 1 2; do
        python3 bench/dev/decode_splits.py --shapes ${MID_SHAPES:-256x512x8 256x2048x8 256x8192x8 256x32768x8} --paged \
          --splits 0 --stages 0 2 3 --calls 20 --rounds 5 --json "$OUT/${N}_mid$k.json" > "$OUT/${N}_mid$k.log" 2>&1
      done
      grep -E " us " "$OUT/${N}_mid1.log"; grep -E " us " "$OUT/${N}_mid2.log" ;;
    w8)
      local k sh="${MID_SHAPES:-256x512x8 256x2048x8 256x8192x8}"
      python3 bench/bench_decode.py --batches 256 --caches 512 2048 8192 --gqa 8 --layouts contiguous \
        --impls cuflash sdpa_cudnn --no-graph --no-host --eager-reps 10 --json "$OUT/${N}_w8_grid.json" > "$OUT/${N}_w8_grid.log" 2>&1
      grep -E "^\[|copy bandwidth:" "$OUT/${N}_w8_grid.log" | head -n 8
      for k in 1 2; do
        python3 bench/dev/decode_splits.py --shapes $sh --splits 1 --warps 4 --stages 2 3 --calls 20 --rounds 5 \
          --json "$OUT/${N}_w8_s$k.json" > "$OUT/${N}_w8_s$k.log" 2>&1
        python3 bench/dev/decode_splits.py --shapes $sh --splits 1 --warps 8 --calls 20 --rounds 5 \
          --json "$OUT/${N}_w8_w$k.json" > "$OUT/${N}_w8_w$k.log" 2>&1
        grep -hE " us " "$OUT/${N}_w8_s$k.log" "$OUT/${N}_w8_w$k.log"
      done ;;
    midab)
      local k=0 m
      for m in new old new old; do
        k=$((k + 1))
        env $([ "$m" = old ] && echo CUFLASH_DECODE_MID_WIDE=0) python3 bench/dev/decode_splits.py --splits 0 --calls 20 \
          --rounds 5 --shapes ${MIDAB_SHAPES:-256x2048x8 256x8192x8 256x4096x8 128x2048x4 64x8192x2 256x2048x8x2 256x8192x8x4 256x512x8} \
          --json "$OUT/${N}_midab_${k}_$m.json" > "$OUT/${N}_midab_${k}_$m.log" 2>&1
        echo "== $k $m"; grep -E " us " "$OUT/${N}_midab_${k}_$m.log"
      done ;;
    wide2k)
      local k
      for k in 1 2; do
        python3 bench/dev/decode_splits.py --splits 0 --warps 0 8 --calls 20 --rounds 5 \
          --shapes ${WIDE2K_SHAPES:-64x2048x1 64x8192x1 64x32768x1 256x2048x4 256x8192x4 256x32768x8 256x8192x8} \
          --json "$OUT/${N}_wide2k_$k.json" > "$OUT/${N}_wide2k_$k.log" 2>&1
        grep -E " us " "$OUT/${N}_wide2k_$k.log"
      done ;;
    bwdt)
      python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider tests/test_gpu_backward.py \
        $(ls tests/test_*feat*gpu*.py tests/test_gpu_*feat*.py 2>/dev/null) > "$OUT/${N}_bwdt.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_bwdt.log" | head -20
      echo "bwdt: $(tail -n 1 "$OUT/${N}_bwdt.log")" ;;
    *) s66_step "$1" ;;
  esac
}
run_steps
archive_logs
