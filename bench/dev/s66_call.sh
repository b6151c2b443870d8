#!/usr/bin/env bash
# Session 66's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, newcache, ...) and bench/dev/s65_call.sh's (dyn, spec, specab, dgrid2).
#   specE  bench_decode.py --seqlen-q SQ (SPECE_SQ, default 1 2 4 8) at batch 1 / 4 x 2k / 8k x GQA 8 4 1,
#          contiguous, EAGER_REPS (300) single eager calls a point and the host-time section at batch 1 x 2k
#          x GQA 8 (HOST_G): are cuflash's single speculative calls at batch 1 slower than the faster
#          peer's (session 65: 1.02-1.20x at 6 of 81 points, 20 calls a point on a noisy host)?
#   specF  bench_decode.py --seqlen-q SQ (SPECF_SQ, 2 4 8) over SPEC_BATCHES (1 16 64) x SPEC_CACHES (2k 8k
#          32k) x GQA 1 4 8, contiguous and paged (16-row pages), 100 single eager calls a point: the
#          library's plans (two m16 tiles where the rule takes them) in GPU time, single calls and graphs
#   psq    bench/dev/decode_splits.py at PSQ_SHAPES (BxLxGxSQ: the speculative shapes where 16-row pages read
#          1.13-1.18x the contiguous cache's time with two m16 tiles) at splits PSQ_SPLITS, contiguous and
#          16-row pages, CUFLASH_DECODE_TWO_TILES 1 / 0: the 16-key-group twin with two tiles against one
#   esq    bench/dev/eager_splits.py at ESQ_SHAPES (batch 1 x 2k speculative shapes) at ESQ_SPLITS, 300 single
#          calls a variant: the single call's GPU time (gpu1) apart from its host time, beside both peers
#   abx    the two plan rules of this session (CUFLASH_DECODE_NARROW_CLUSTERS, CUFLASH_DECODE_PAGED_TWO_TILE_SPLITS)
#          on and off (AB_MODES, default "new old new old"), each its own process: bench_decode.py at 8 query
#          positions (batch 1 / 16 x 2k-32k x GQA 4 / 8, contiguous and 16-row pages, 200 single calls), and
#          at 2 and 1 positions at 4 x 2k x GQA 8 (300 single calls, 9 graph rounds)
#   seed   replays call 4's slow-grid failure, test_backward_grid[bf16-d8-full-q1k300-h4kv2-bhsd-det], three times
#          with its seed (CUFLASH_TEST_SEED=14363466586248944331)
#   STEPS="specE specF" CALL=c1 bash bench/dev/s66_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s65_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s65_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    specE)
      local sq
      for sq in ${SPECE_SQ:-1 2 4 8}; do
        python3 bench/bench_decode.py --seqlen-q "$sq" --batches ${SPECE_BATCHES:-1 4} --caches ${SPECE_CACHES:-2048 8192} \
          --gqa ${HOST_G:-8} 4 1 --layouts contiguous --impls cuflash sdpa_flash sdpa_cudnn --no-graph --rounds 5 \
          --eager-reps ${EAGER_REPS:-300} --host-cache 2048 --host-rounds 11 \
          --json "$OUT/${N}_specE$sq.json" > "$OUT/${N}_specE$sq.log" 2>&1
        echo "== seqlen_q $sq"; grep -E "host|us/call|MISSED|MET " "$OUT/${N}_specE$sq.log" | head -n 12
      done ;;
    specF)
      local sq
      for sq in ${SPECF_SQ:-2 4 8}; do
        python3 bench/bench_decode.py --seqlen-q "$sq" --batches ${SPEC_BATCHES:-1 16 64} \
          --caches ${SPEC_CACHES:-2048 8192 32768} --gqa 1 4 8 --layouts contiguous paged \
          --impls cuflash sdpa_flash sdpa_cudnn --no-host --eager-reps ${EAGERF_REPS:-100} \
          --json "$OUT/${N}_specF$sq.json" > "$OUT/${N}_specF$sq.log" 2>&1
        echo "== seqlen_q $sq"; grep -E "MISSED|MET " "$OUT/${N}_specF$sq.log" | head -n 6
      done ;;
    psq)
      python3 bench/dev/decode_splits.py --shapes ${PSQ_SHAPES:-16x8192x4x8 16x32768x4x8 16x8192x8x8 64x8192x8x8 16x32768x8x8} \
        --paged --splits ${PSQ_SPLITS:-0 1 2 4} --two-tiles 1 0 --json "$OUT/${N}_psq.json" > "$OUT/${N}_psq.log" 2>&1
      cat "$OUT/${N}_psq.log" | tail -n 90 ;;
    esq)
      python3 bench/dev/eager_splits.py --shapes ${ESQ_SHAPES:-1x2048x8x8 1x2048x4x8 1x2048x8x4 1x2048x1x8} \
        --splits ${ESQ_SPLITS:-1 2 4 8 16} --reps ${ESQ_REPS:-300} --json "$OUT/${N}_esq.json" > "$OUT/${N}_esq.log" 2>&1
      cat "$OUT/${N}_esq.log" | tail -n 50 ;;
    abx)
      local m k=0 envs
      for m in ${AB_MODES:-new old new old}; do
        k=$((k + 1))
        envs=""
        [ "$m" = old ] && envs="CUFLASH_DECODE_NARROW_CLUSTERS=0 CUFLASH_DECODE_PAGED_TWO_TILE_SPLITS=0"
        env $envs python3 bench/bench_decode.py --seqlen-q 8 --batches 1 16 --caches 2048 8192 32768 --gqa 4 8 \
          --layouts contiguous paged --impls cuflash sdpa_flash sdpa_cudnn --no-host --eager-reps 200 \
          --json "$OUT/${N}_abx8_${k}_$m.json" > "$OUT/${N}_abx8_${k}_$m.log" 2>&1
        for sq in 2 1; do
          env $envs python3 bench/bench_decode.py --seqlen-q $sq --batches 4 --caches 2048 --gqa 8 \
            --layouts contiguous paged --impls cuflash sdpa_flash sdpa_cudnn --no-host --eager-reps 300 --graph-rounds 9 \
            --json "$OUT/${N}_abx${sq}_${k}_$m.json" > "$OUT/${N}_abx${sq}_${k}_$m.log" 2>&1
        done
        echo "== $k $m"; grep -E "MISSED|MET " "$OUT/${N}_abx8_${k}_$m.log" | head -n 3
      done ;;
    seed)
      local i
      for i in 1 2 3; do
        CUFLASH_TEST_SEED=14363466586248944331 python3 -m pytest -q -rf -p no:cacheprovider \
          "tests/test_gpu_backward.py::test_backward_grid[bf16-d8-full-q1k300-h4kv2-bhsd-det]" > "$OUT/${N}_seed$i.log" 2>&1
        grep -E "max\|" "$OUT/${N}_seed$i.log" | head -n 1 | cut -c1-300; echo "seed replay $i: $(tail -n 1 "$OUT/${N}_seed$i.log")"
      done ;;
    dyn|spec|specab|dgrid2) s65_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
