#!/usr/bin/env bash
# Session 20's device call: the quick GPU suite on this tree (SUITE=1, default), the forward and decode
# test files in full (FULL=1), then
# bench/dev/fwd_ab_inproc.py over TREES (default: HEAD's kernels in .oldtree/main, this tree) at SEQS
# and HDS, then (AB2_TREES set) a second such A/B, then (GRID=1) bench.py's forward grid against SDPA
# flash and cuDNN.
# Carry: .cache (scripts/carry_cache.sh plus the old tree's forward kernels) and .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
if [ "${SUITE:-1}" = 1 ]; then
  # SUITE_RUNS times in a row (suite.log, suite2.log, ...): fresh hypothesis draws and random inputs each run.
  for r in $(seq 1 "${SUITE_RUNS:-1}"); do
    log="$OUT/suite$([ "$r" = 1 ] || echo "$r").log"
    timeout "${SUITE_S:-300}" python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 > "$log" 2>&1
    echo "suite run $r rc $?"
  done
fi
if [ "${FULL:-0}" = 1 ]; then
  # The forward and decode GPU test files in full, slow cases included (session 19's call 10).
  timeout "${FULL_S:-300}" python3 -m pytest tests/test_gpu_forward.py tests/test_fwd_ws_gpu.py tests/test_fwd_ws_feat_gpu.py \
    tests/test_fwd_tma_gpu.py tests/test_kvcache_decode.py tests/test_near_equal_scores.py tests/test_extreme_logits_gpu.py \
    -m gpu --dist loadgroup -rf -p no:cacheprovider -q -n 8 > "$OUT/fwd_full.log" 2>&1
  echo "full rc $?"
fi
if [ "${AB:-1}" = 1 ]; then
  TREES="${TREES:-main=.oldtree/main new=.}" SEQS="${SEQS:-512 1024 2048 4096}" HDS="${HDS:-64 128 256}" \
    timeout "${AB_S:-240}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/inproc.log" 2>&1
  echo "inproc rc $?"
fi
# A second A/B with its own trees and per-tree environment (AB2_TREES, AB2_ENV: TREE_ENV's form;
# AB2_OPTS: fwd_ab_inproc.py's OPTS, the options instead of the plain grid).
if [ -n "${AB2_TREES:-}" ]; then
  TREES="$AB2_TREES" TREE_ENV="${AB2_ENV:-}" OPTS="${AB2_OPTS:-}" SEQS="${AB2_SEQS:-1024 2048 4096}" HDS="${AB2_HDS:-128}" \
    timeout "${AB2_S:-180}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/inproc2.log" 2>&1
  echo "inproc2 rc $?"; tail -22 "$OUT/inproc2.log"
fi
if [ "${GRID:-0}" = 1 ]; then
  timeout "${GRID_S:-200}" python3 bench/bench.py --passes fwd --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
    --budget-s "${GRID_BUDGET:-150}" --json "$OUT/fwd_grid.json" > "$OUT/grid.log" 2>&1
  echo "grid rc $?"; tail -25 "$OUT/grid.log"
fi
[ "${AB:-1}" = 1 ] && tail -52 "$OUT/inproc.log"
[ "${FULL:-0}" = 1 ] && grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/fwd_full.log" | cut -c1-300 | tail -8
[ "${SUITE:-1}" = 1 ] && for f in "$OUT"/suite*.log; do
  echo "== $(basename "$f")"; grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$f" | cut -c1-300 | tail -8
done
exit 0
