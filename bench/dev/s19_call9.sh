#!/usr/bin/env bash
# Session 19, call 9: the forward on FlashAttention-2's grid against SDPA's flash and cuDNN backends,
# with the final kernels (bench/bench.py, fwd only; GPU time and single eager calls). Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 560 python3 bench/bench.py --passes fwd --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
  --budget-s 480 --json "$OUT/fwd_grid_s19.json" > "$OUT/fwd_grid_s19.log" 2>&1
echo "bench rc $?"
tail -60 "$OUT/fwd_grid_s19.log"
