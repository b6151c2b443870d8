#!/usr/bin/env bash
# Session 42's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# wstests, splitab, threeab, splittest, probe, ab against OLD (default .oldtree/main42), grid).
#   bwdab     the backward of this tree against OLD in one process (bench/dev/fwd_ab_inproc.py PASS=bwd;
#             HDS, SEQS, ROUNDS)
#   bwdtests  the backward's GPU test files (quick marks): the grid's default subset, the warp-specialized
#             backward's files
#   remeasure the grid's lowest points against cuDNN with 16 rounds
#   dqtail    bench/dev/dq_tail_sweep.py: the backward grid's error ratio over many draws, causal 1023 x 1024
#   grid8     bench.py's full grid with the peers, 8 rounds per measurement (the plots: bench/plot.py)
#   fuzzfix   the fuzzer's regressions and the stale-lse sink test (tests/test_cpu_features.py), GPU and CPU
#   persab    the backward on the persistent grid against one block per tile, same process
#   fuzzsoak  the GPU fuzzer (test_fuzz_torch_cuda) in FUZZ_PROCS processes at once, fresh draws each
#   STEPS="bwdab bwdtests" CALL=c1 bash bench/dev/s42_call.sh   (OUT: where logs go; the kernel cache
#   carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main42}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    bwdab)
      PASS=bwd HDS="${HDS:-64 128 256}" SEQS="${SEQS:-1024 2048 4096 16384}" TREES="old=$OLD new=." \
        ROUNDS="${ROUNDS:-5}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_bwdab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_bwdab.log" | cut -c1-200 ;;
    bwdtests)
      python3 -m pytest -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider tests/test_gpu_backward.py \
        tests/test_bwd_ws_gpu.py tests/test_bwd_ws_feat_gpu.py > "$OUT/${N}_bwdtests.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_bwdtests.log" | head -20
      echo "bwdtests: $(tail -n 1 "$OUT/${N}_bwdtests.log")" ;;
    remeasure)  # the grid's lowest points against cuDNN, more rounds: the backward at head_dim 128
      # non-causal 2k / 4k, the forward at head_dim 64 causal 2k
      python3 bench/bench.py --head-dims 128 --seqlens 2048 4096 --causal off --passes bwd \
        --providers cuflash sdpa_cudnn --rounds ${RM_ROUNDS:-16} --no-compile-timing --json "$OUT/${N}_rm_bwd.json" \
        > "$OUT/${N}_rm_bwd.log" 2>&1
      python3 bench/bench.py --head-dims 64 --seqlens 2048 --causal on --passes fwd \
        --providers cuflash sdpa_cudnn --rounds ${RM_ROUNDS:-16} --no-compile-timing --json "$OUT/${N}_rm_fwd.json" \
        > "$OUT/${N}_rm_fwd.log" 2>&1
      tail -n 25 "$OUT/${N}_rm_bwd.log"; tail -n 15 "$OUT/${N}_rm_fwd.log" ;;
    dqtail)  # the backward grid's error ratio over many draws (bench/dev/dq_tail_sweep.py)
      python3 bench/dev/dq_tail_sweep.py ${TAIL_N:-400} ${TAIL_HDS:-32,64,128} 1 > "$OUT/${N}_dqtail.log" 2>&1
      cat "$OUT/${N}_dqtail.log" | cut -c1-400 ;;
    grid8)  # bench.py's full grid with the peers, GRID_ROUNDS (8) rounds per measurement
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --rounds ${GRID_ROUNDS:-8} --no-compile-timing \
        --json "$OUT/${N}_grid.json" > "$OUT/${N}_grid.log" 2>&1
      sed -n '/^=== summary/,$p' "$OUT/${N}_grid.log" ;;
    fuzzfix)  # the fuzzer's regressions (GPU and CPU) and the stale-lse sink test, both backends
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_fuzz_inputs.py tests/test_cpu_features.py \
        -k "test_fuzz_regressions or stale_lse" > "$OUT/${N}_fuzzfix.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_fuzzfix.log" | head -20
      echo "fuzzfix: $(tail -n 1 "$OUT/${N}_fuzzfix.log")" ;;
    persab)  # the backward on the persistent grid (CUFLASH_BWD_WS_PERSISTENT=1) against one block per tile
      PASS=bwd HDS="${HDS:-64 128}" SEQS="${SEQS:-1024 2048 4096}" TREES="tile=. pers=." \
        TREE_ENV="pers:CUFLASH_BWD_WS_PERSISTENT=1" ROUNDS="${ROUNDS:-7}" python3 bench/dev/fwd_ab_inproc.py \
        > "$OUT/${N}_persab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_persab.log" | cut -c1-200 ;;
    fuzzsoak)  # the GPU fuzzer in FUZZ_PROCS (8) processes at once, each its own 1000 draws
      local i
      for i in $(seq "${FUZZ_PROCS:-8}"); do
        timeout 300 python3 -m pytest -q -rf -p no:cacheprovider tests/test_fuzz_inputs.py::test_fuzz_torch_cuda \
          > "/tmp/${N}_fuzz$i.log" 2>&1 &
      done
      wait
      for i in $(seq "${FUZZ_PROCS:-8}"); do
        grep -E "^FAILED|Falsifying|reproduce_failure|AssertionError" "/tmp/${N}_fuzz$i.log" | head -4 | cut -c1-400
        echo "fuzz $i: $(tail -n 1 "/tmp/${N}_fuzz$i.log")"
        { echo "==== fuzz process $i"; cat "/tmp/${N}_fuzz$i.log"; } >> "$OUT/${N}_fuzzsoak.log"
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
