#!/usr/bin/env bash
# Session 20's closing figures on the final code: bench.py's grid (forward, backward, forward +
# backward) against SDPA flash and cuDNN, then bench_flex.py (the options against FlexAttention,
# 8k and 16k). Carry: .cache (scripts/carry_cache.sh).
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout "${GRID_S:-330}" python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
  --budget-s "${GRID_BUDGET:-280}" --json "$OUT/grid.json" > "$OUT/grid.log" 2>&1
echo "grid rc $?"
timeout "${FLEX_S:-220}" python3 bench/bench_flex.py --json "$OUT/flex.json" > "$OUT/flex.log" 2>&1
echo "flex rc $?"
sed -n '/=== summary ===/,$p' "$OUT/grid.log" | head -30
tail -25 "$OUT/flex.log"
