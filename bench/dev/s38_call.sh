#!/usr/bin/env bash
# Session 38's device calls: the quick GPU suite on this tree (suite); the warp-specialized backward's
# GPU tests (wstests; with RED_ENV=CUFLASH_BWD_DQ_RED=1 in call 1, before that became the default:
# redtests); the backward with dQ from registers (the tree) against dQ by bulk reductions
# (CUFLASH_BWD_DQ_RED=0) in one process (redab; call 2 compared bulk = the tree then, red, and red with
# 3 stages); the same through bench.py with SDPA flash and cuDNN, one run per variant (redbench); the
# full bench.py grid with plots (grid); GPT-2 355M eager (gpt2); bench_flex.py (flex).
#   STEPS="wstests redab" CALL=c3 bash bench/dev/s38_call.sh   (OUT: where logs go; the kernel
#   cache carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
STEPS="${STEPS:-wstests redab}"
md5sum cuflash/_config.py cuflash/_launch.py cuda_src/flash_bwd_sm90_ws.cu | cut -c1-12
for step in $STEPS; do
  case "$step" in
    suite) run_suite ;;
    redtests|wstests)
      env ${RED_ENV:-} python3 -m pytest -q -rf -n 8 -p no:cacheprovider tests/test_bwd_ws_gpu.py \
        tests/test_bwd_ws_feat_gpu.py > "$OUT/${N}_${step}.log" 2>&1
      grep -E "^FAILED|seed" "$OUT/${N}_${step}.log" | head -20
      echo "$step: $(tail -n 1 "$OUT/${N}_${step}.log")" ;;
    redab)
      PASS=bwd HDS="${HDS:-64 128}" SEQS="${SEQS:-1024 2048 4096 8192 16384}" TREES="bulk=. red=." \
        TREE_ENV="bulk:CUFLASH_BWD_DQ_RED=0" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_redab.log" 2>&1
      grep -E "^bwd|^geomean|Error|error" "$OUT/${N}_redab.log" | cut -c1-160 ;;
    redbench)
      ARGS="--passes bwd --dtypes bfloat16 float16 --head-dims 64 128 --seqlens 1024 2048 4096 8192 16384 --rounds 2 --eager-reps 10 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      CUFLASH_BWD_DQ_RED=0 python3 bench/bench.py $ARGS --json "$OUT/${N}_bwd_bulk.json" > "$OUT/${N}_bwd_bulk.log" 2>&1
      python3 bench/bench.py $ARGS --json "$OUT/${N}_bwd_red.json" > "$OUT/${N}_bwd_red.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_bwd_bulk.json" "$OUT/${N}_bwd_red.json" > "$OUT/${N}_bwd_ab.txt" 2>&1
      cat "$OUT/${N}_bwd_ab.txt"
      grep -A3 "^summary\|bwd     seqlen" "$OUT/${N}_bwd_red.log" | head -20 ;;
    grid)  # FlashAttention-2's grid, every pass, with the peers and the figures (as session 28's)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing --json "$OUT/${N}_grid.json" \
        --plots "$OUT/${N}_plots" > "$OUT/${N}_grid.log" 2>&1
      sed -n '/^cuflash \/ SDPA flash (TFLOP/,/^cuflash errors/p' "$OUT/${N}_grid.log" ;;
    gpt2)  # GPT-2 355M at 4096 tokens, eager, the attention backends that train it
      python3 bench/gpt2.py --models 355M --modes eager --impls cuflash sdpa_flash sdpa_cudnn --json "$OUT/${N}_gpt2.json" \
        > "$OUT/${N}_gpt2.log" 2>&1
      tail -n 25 "$OUT/${N}_gpt2.log" ;;
    flex)  # the options against FlexAttention, forward and forward + backward (bench_flex.py's grid)
      timeout 400 python3 bench/bench_flex.py --json "$OUT/${N}_flex.json" > "$OUT/${N}_flex.log" 2>&1
      tail -n 30 "$OUT/${N}_flex.log" ;;
  esac
done
