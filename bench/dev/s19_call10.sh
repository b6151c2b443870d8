#!/usr/bin/env bash
# Session 19, call 10: the full GPU tests (slow ones included) of the forward and decode files (not
# test_gpu_features.py: every head_dim from 8 to 256, beyond the carried cache), on the final kernels. Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 540 python3 -m pytest tests/test_gpu_forward.py tests/test_fwd_ws_gpu.py tests/test_fwd_ws_feat_gpu.py \
  tests/test_fwd_tma_gpu.py tests/test_kvcache_decode.py tests/test_near_equal_scores.py tests/test_extreme_logits_gpu.py \
  -m gpu --dist loadgroup -rf -p no:cacheprovider -q -n 8 > "$OUT/fwd_full.log" 2>&1
echo "rc $?"
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/fwd_full.log" | cut -c1-300 | tail -14
