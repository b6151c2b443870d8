#!/usr/bin/env bash
# Session 26's last device call: one GPU test file (TESTS), then the grid (bench.py against SDPA flash
# and cuDNN) and the options against FlexAttention (bench_flex.py), JSON and logs to $OUT; a summary
# last. Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L; md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum
timeout "${TESTS_S:-90}" python3 -m pytest ${TESTS:-tests/test_block_order_gpu.py} -m "gpu and not slow" -rf \
  -p no:cacheprovider -q -n 8 > "$OUT/tests.log" 2>&1; echo "tests rc $?"
timeout "${GRID_S:-200}" python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
  --json "$OUT/grid.json" > "$OUT/grid.log" 2>&1; echo "grid rc $?"
timeout "${FLEX_S:-130}" python3 bench/bench_flex.py --json "$OUT/flex.json" > "$OUT/flex.log" 2>&1; echo "flex rc $?"
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -6
tail -25 "$OUT/grid.log"; tail -15 "$OUT/flex.log"
exit 0
