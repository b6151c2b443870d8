#!/usr/bin/env bash
# Session 36's device calls: the quick GPU suite on this tree (suite); bench.py's forward at head_dims
# 24-56 with pad-up off (CUFLASH_FWD_PAD=0, A) and on (the tree's rule, B), compared by bench_ab.py
# (ab); the same at 512-4096 keys, both dtypes, with pad-up forced at every length (short); the
# final rule against off at 512-8192 keys (final).
#   STEPS="suite ab" bash bench/dev/s36_call.sh     (OUT: where logs go; the kernel cache carried as
#   .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
STEPS="${STEPS:-suite ab}"
for step in $STEPS; do
  case "$step" in
    suite) run_suite ;;
    ab)
      ARGS="--passes fwd --dtypes bfloat16 --head-dims 24 32 40 48 56 --seqlens 2048 4096 8192 --rounds 2 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      CUFLASH_FWD_PAD=0 python3 bench/bench.py $ARGS --json "$OUT/${N}_fwd_padoff.json" > "$OUT/${N}_fwd_padoff.log" 2>&1
      python3 bench/bench.py $ARGS --json "$OUT/${N}_fwd_padon.json" > "$OUT/${N}_fwd_padon.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_fwd_padoff.json" "$OUT/${N}_fwd_padon.json" > "$OUT/${N}_ab.txt" 2>&1
      cat "$OUT/${N}_ab.txt" ;;
    final)  # the tree's rule against pad-up off, 512-8192 keys
      ARGS="--passes fwd --dtypes bfloat16 --head-dims 24 32 40 48 56 --seqlens 512 1024 2048 4096 8192 --rounds 2 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      CUFLASH_FWD_PAD=0 python3 bench/bench.py $ARGS --json "$OUT/${N}_final_padoff.json" > "$OUT/${N}_final_padoff.log" 2>&1
      python3 bench/bench.py $ARGS --json "$OUT/${N}_final_padon.json" > "$OUT/${N}_final_padon.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_final_padoff.json" "$OUT/${N}_final_padon.json" > "$OUT/${N}_final_ab.txt" 2>&1
      cat "$OUT/${N}_final_ab.txt" ;;
    short)  # pad-up at every length (CUFLASH_FWD_WS=1 lifts head_dim 64's FWD_WS_MIN_SEQLEN_K) against off
      ARGS="--passes fwd --dtypes bfloat16 float16 --head-dims 24 32 40 48 56 --seqlens 512 1024 2048 4096 --rounds 2 --eager-reps 10 --no-compile-timing --providers cuflash sdpa_flash sdpa_cudnn"
      CUFLASH_FWD_PAD=0 python3 bench/bench.py $ARGS --json "$OUT/${N}_short_padoff.json" > "$OUT/${N}_short_padoff.log" 2>&1
      CUFLASH_FWD_WS=1 python3 bench/bench.py $ARGS --json "$OUT/${N}_short_padall.json" > "$OUT/${N}_short_padall.log" 2>&1
      python3 bench/dev/bench_ab.py "$OUT/${N}_short_padoff.json" "$OUT/${N}_short_padall.json" > "$OUT/${N}_short_ab.txt" 2>&1
      cat "$OUT/${N}_short_ab.txt" ;;
  esac
done
