#!/usr/bin/env bash
# Session 37's device calls: the quick GPU suite on this tree (suite); the pad-up tests of calls with
# options below head_dim 64 (feat); bench/dev/padup_small_feat.py, pad-up forced against off (probe)
# and the tree's rule against off (rule); pad-up on the TMA variant of 64 forced against the tree
# (tma) and its tests (tmatests); the final rule against pad-up off with the peers (final); 24, 40, 56
# on the TMA variant with other tiles (tiles).
#   STEPS="feat probe" CALL=c1 bash bench/dev/s37_call.sh   (OUT: where logs go; the kernel cache
#   carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
STEPS="${STEPS:-feat probe}"
md5sum cuflash/_config.py cuflash/_launch.py | cut -c1-12
for step in $STEPS; do
  case "$step" in
    suite) run_suite ;;
    feat)
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_fwd_ws_feat_gpu.py tests/test_plan_wiring.py \
        -k "padded or nan or varlen or padup" > "$OUT/${N}_feat.log" 2>&1
      grep -E "^FAILED|seed" "$OUT/${N}_feat.log" | head -20
      echo "feat: $(tail -n 1 "$OUT/${N}_feat.log")" ;;
    probe)
      python3 bench/dev/padup_small_feat.py > "$OUT/${N}_probe.log" 2>&1
      sed -n '/^worst over/,$p' "$OUT/${N}_probe.log"; grep -m3 FAILED "$OUT/${N}_probe.log" ;;
    rule)
      python3 bench/dev/padup_small_feat.py --variants rule native rule native > "$OUT/${N}_rule.log" 2>&1
      sed -n '/^all points/,/^worst over/p' "$OUT/${N}_rule.log"; grep -m3 FAILED "$OUT/${N}_rule.log" ;;
    tma)  # pad-up on the TMA variant of 64 at every length (CUFLASH_FWD_PAD_TMA=1) against the tree's rule
      ARGS="--passes fwd --dtypes bfloat16 float16 --head-dims 24 32 40 48 56 --seqlens 512 1024 2048 4096 --rounds 2 --eager-reps 10 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      python3 bench/bench.py $ARGS --json "$OUT/${N}_tma_tree.json" > "$OUT/${N}_tma_tree.log" 2>&1
      CUFLASH_FWD_PAD_TMA=1 python3 bench/bench.py $ARGS --json "$OUT/${N}_tma_all.json" > "$OUT/${N}_tma_all.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_tma_tree.json" "$OUT/${N}_tma_all.json" > "$OUT/${N}_tma_ab.txt" 2>&1
      cat "$OUT/${N}_tma_ab.txt" ;;
    final)  # the tree's rule against pad-up off, 512-8192 keys, with the peers
      ARGS="--passes fwd --dtypes bfloat16 --head-dims 24 32 40 48 56 --seqlens 512 1024 2048 4096 8192 --rounds 2 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      CUFLASH_FWD_PAD=0 python3 bench/bench.py $ARGS --json "$OUT/${N}_final_padoff.json" > "$OUT/${N}_final_padoff.log" 2>&1
      python3 bench/bench.py $ARGS --json "$OUT/${N}_final_padon.json" > "$OUT/${N}_final_padon.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_final_padoff.json" "$OUT/${N}_final_padon.json" > "$OUT/${N}_final_ab.txt" 2>&1
      cat "$OUT/${N}_final_ab.txt" ;;
    tiles)  # head dims 24, 40, 56 on the TMA variant of 64 with 128-row blocks (half the K / V reads)
      ARGS="--passes fwd --dtypes bfloat16 --head-dims 24 40 56 --seqlens 512 1024 2048 4096 --rounds 2 --eager-reps 10 --no-compile-timing --providers cuflash"
      python3 bench/bench.py $ARGS --json "$OUT/${N}_tiles_tree.json" > "$OUT/${N}_tiles_tree.log" 2>&1
      for t in 64x128 128x128 128x64; do
        CUFLASH_FWD_PAD_TMA=1 CUFLASH_FWD_TMA_TILE=$t python3 bench/bench.py $ARGS --json "$OUT/${N}_tiles_$t.json" > "$OUT/${N}_tiles_$t.log" 2>&1
        echo "== $t against the tree"; python3 bench/dev/bench_ab.py "$OUT/${N}_tiles_tree.json" "$OUT/${N}_tiles_$t.json" | cut -c1-48
      done ;;
    tile128)  # every head_dim 24-56 on the TMA variant of 64 with 128 x 64 tiles against the tree, both dtypes
      ARGS="--passes fwd --dtypes bfloat16 float16 --head-dims 24 32 40 48 56 --seqlens 512 1024 2048 4096 --rounds 2 --eager-reps 10 --no-compile-timing --providers cuflash sdpa_cudnn"
      python3 bench/bench.py $ARGS --json "$OUT/${N}_t128_tree.json" > "$OUT/${N}_t128_tree.log" 2>&1
      CUFLASH_FWD_PAD_TMA=1 CUFLASH_FWD_TMA_TILE=128x64 python3 bench/bench.py $ARGS --json "$OUT/${N}_t128_all.json" > "$OUT/${N}_t128_all.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_t128_tree.json" "$OUT/${N}_t128_all.json" > "$OUT/${N}_t128_ab.txt" 2>&1
      cut -c1-48 "$OUT/${N}_t128_ab.txt" ;;
    tmatests)
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_fwd_tma_gpu.py tests/test_fwd_ws_gpu.py \
        tests/test_gpu_backward.py -k "padded or tma_forward or default_mode" > "$OUT/${N}_tmatests.log" 2>&1
      grep -E "^FAILED|seed" "$OUT/${N}_tmatests.log" | head -20
      echo "tmatests: $(tail -n 1 "$OUT/${N}_tmatests.log")" ;;
  esac
done
