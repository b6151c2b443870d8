#!/usr/bin/env bash
# Session 39's device calls: the persistent causal forward on work lists (cuflash/_schedule.py).
#   wstests  the warp-specialized / TMA forwards' GPU tests and the causal block-order tests
#   schedab  in one process (bench/dev/fwd_ab_inproc.py), against the kernel's own pairs
#            (CUFLASH_FWD_SCHED=0, the baseline): the work lists (the tree), the persistent grid at every
#            length (CUFLASH_FWD_WS_PERSISTENT=1, on the lists) and a block per query block
#            (CUFLASH_FWD_WS_PERSISTENT=0); HDS / SEQS / DTYPES as the script reads them
#   schedctl the work lists against the pairs with a control (the tree run first and last in each round)
#   persab   head_dim 128 causal, the persistent grid at every length (CUFLASH_FWD_WS_PERSISTENT=1)
#            against the default rule (a block per query block from 4096 keys)
#   oldab    this tree against an older one in one process (OLD, default .oldtree/s39a)
#   suite    the quick GPU suite;  grid  bench.py's full grid with the peers and plots
#   STEPS="wstests schedab" CALL=c1 bash bench/dev/s39_call.sh   (OUT: where logs go; the kernel cache
#   carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
STEPS="${STEPS:-wstests schedab}"
md5sum cuflash/_config.py cuflash/_launch.py cuflash/_schedule.py cuda_src/flash_fwd_sm90_ws.cu | cut -c1-12
for step in $STEPS; do
  case "$step" in
    suite) run_suite ;;
    wstests)
      python3 -m pytest -q -rf -n 8 -p no:cacheprovider tests/test_fwd_ws_gpu.py tests/test_block_order_gpu.py \
        tests/test_fwd_tma_gpu.py > "$OUT/${N}_wstests.log" 2>&1
      grep -E "^FAILED|seed" "$OUT/${N}_wstests.log" | head -20
      echo "wstests: $(tail -n 1 "$OUT/${N}_wstests.log")" ;;
    schedab)
      HDS="${HDS:-128 64}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" TREES="pairs=. sched=. all=. blk=." \
        TREE_ENV="pairs:CUFLASH_FWD_SCHED=0 all:CUFLASH_FWD_WS_PERSISTENT=1 blk:CUFLASH_FWD_WS_PERSISTENT=0" \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_schedab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_schedab.log" | cut -c1-200 ;;
    schedctl)  # the same with a control: the tree first (first), then the pairs, then the tree again
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048}" TREES="first=. pairs=. sched=." \
        TREE_ENV="pairs:CUFLASH_FWD_SCHED=0" ROUNDS=11 python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_schedctl.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_schedctl.log" | cut -c1-200 ;;
    persab)  # head_dim 128 causal: the persistent grid on its lists at every length against the default
      HDS=128 SEQS="${PERS_SEQS:-2048 4096 8192 16384}" TREES="blocks=. pers=." \
        TREE_ENV="pers:CUFLASH_FWD_WS_PERSISTENT=1" ROUNDS=11 python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_persab.log" 2>&1
      grep -E "causal=1|^geomean|Error|error" "$OUT/${N}_persab.log" | cut -c1-200 ;;
    oldab)  # this tree against OLD (default .oldtree/s39a: the lists read through a branch), same process
      HDS=128 SEQS="${SEQS:-512 1024 2048}" TREES="old=${OLD:-.oldtree/s39a} new=." ROUNDS=11 \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_oldab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_oldab.log" | cut -c1-200 ;;
    grid)  # FlashAttention-2's grid, every pass, with the peers and the figures (as session 28's)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing --json "$OUT/${N}_grid.json" \
        --plots "$OUT/${N}_plots" > "$OUT/${N}_grid.log" 2>&1
      sed -n '/^cuflash \/ SDPA flash (TFLOP/,/^cuflash errors/p' "$OUT/${N}_grid.log" ;;
  esac
done
