#!/usr/bin/env bash
# Session 41's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# wstests, splitab, threeab, splittest, probe, ab against OLD (default .oldtree/s41a), grid).
#   ncuwait  Nsight Compute source counters on the head_dim 128 forward: the waits by barrier
#   remeasure bench.py at the head_dim 128 non-causal forward points, 12 rounds, cuflash and cuDNN
#   ab3      OLD, OLD2 and this tree in one process
#   chainab, chainoff  calls 1-2's A/Bs of the chained work tiles (that code was not kept; chainoff
#            read its switch CUFLASH_FWD_CHAIN): OLD, the tree, the tree without chaining, and both
#            with every head_dim 128 call on the persistent grid (CUFLASH_FWD_WS_PERSISTENT=1)
#   flex     bench_flex.py: the options against FlexAttention
#   dump     bench/dev/dump_bwd_case.py: call 8's failing backward case, its tensors and dq's error
#   replay   call 8's slow-grid failure by its seed, three times on this tree and on OLD
#   STEPS="suite suite suite" CALL=c1 bash bench/dev/s41_call.sh   (OUT: where logs go; the kernel
#   cache carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/s41a}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    chainab)
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" \
        TREES="old=$OLD new=. pers=." TREE_ENV="pers:CUFLASH_FWD_WS_PERSISTENT=1" \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_chainab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_chainab.log" | cut -c1-220 ;;
    chainoff)  # OLD, this tree, this tree without the chained turns (CUFLASH_FWD_CHAIN=0), and both on the
      # persistent grid at every length (CUFLASH_FWD_WS_PERSISTENT=1)
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" \
        TREES="old=$OLD new=. off=. pers=. persoff=." \
        TREE_ENV="off:CUFLASH_FWD_CHAIN=0 pers:CUFLASH_FWD_WS_PERSISTENT=1 persoff:CUFLASH_FWD_WS_PERSISTENT=1,CUFLASH_FWD_CHAIN=0" \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_chainoff.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_chainoff.log" | cut -c1-250 ;;
    ncuwait)  # Nsight Compute source counters on the forward (bench/dev/ncu_fwd.py: cuflash, then cuDNN),
      # bf16 head_dim 128 non-causal at NCU_SEQ keys (default 4096): where the warps wait
      NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
      for s in ${NCU_SEQ:-4096}; do
        timeout 300 "$NCU" --profile-from-start off --clock-control none --section LaunchStats --section SpeedOfLight \
          --section WarpStateStats --section SourceCounters -f -o /tmp/ncu_$s python3 bench/dev/ncu_fwd.py "$s" 128 0 \
          > "$OUT/${N}_ncu_$s.log" 2>&1
        "$NCU" -i /tmp/ncu_$s.ncu-rep --page details --csv > "$OUT/${N}_ncudet_$s.csv" 2>&1
        "$NCU" -i /tmp/ncu_$s.ncu-rep --page source --print-source sass --csv > /tmp/src_$s.csv 2>/dev/null
        python3 bench/dev/ncu_fwd_waits.py /tmp/src_$s.csv > "$OUT/${N}_ncuwait_$s.txt" 2>&1
        grep -E '"Duration"' "$OUT/${N}_ncudet_$s.csv" | cut -c1-60,200-400 | head -4
        cat "$OUT/${N}_ncuwait_$s.txt"
      done ;;
    remeasure)  # bench.py at the contested forward points, more rounds, cuflash and cuDNN
      python3 bench/bench.py --head-dims 128 --seqlens ${RM_SEQS:-2048 4096 8192} --causal off --passes fwd \
        --providers cuflash sdpa_cudnn --rounds ${RM_ROUNDS:-12} --no-compile-timing --json "$OUT/${N}_remeasure.json" \
        > "$OUT/${N}_remeasure.log" 2>&1
      tail -n 30 "$OUT/${N}_remeasure.log" ;;
    ab3)  # OLD, OLD2, this tree in one process
      HDS="${HDS:-128}" SEQS="${SEQS:-512 1024 2048 4096 8192 16384}" TREES="old=$OLD old2=${OLD2} new=." \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_ab3.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_ab3.log" | cut -c1-200 ;;
    flex)  # the options against FlexAttention, forward and forward + backward (bench_flex.py's grid)
      timeout 400 python3 bench/bench_flex.py --json "$OUT/${N}_flex.json" > "$OUT/${N}_flex.log" 2>&1
      tail -n 30 "$OUT/${N}_flex.log" ;;
    replay)  # call 8's slow-grid failure, replayed by its seed three times on this tree and on OLD
      ROOT="$PWD"
      for tree in . "$OLD"; do
        for k in 1 2 3; do
          # (from the tree's own directory: python -m puts the working directory first on sys.path)
          (cd "$tree" && CUFLASH_TEST_SEED=16977893723196167458 PYTHONPATH=. python3 -m pytest -q -rf -p no:cacheprovider \
            "$ROOT/tests/test_gpu_backward.py" -k "test_backward_grid and bf16-d32-causal-q1023k1024-h4kv4-bshd" \
            > "$OUT/${N}_replay_$(basename "$tree")_$k.log" 2>&1; python3 -c "import cuflash; print(cuflash.__file__)" \
            >> "$OUT/${N}_replay_$(basename "$tree")_$k.log")
          echo "replay $tree $k: $(grep -oE 'max\|dq-ref64\|=[0-9.e-]+|bound [0-9.e-]+' "$OUT/${N}_replay_$(basename "$tree")_$k.log" | tr '\n' ' ') $(grep -E ' passed| failed' "$OUT/${N}_replay_$(basename "$tree")_$k.log" | tail -n 1) $(tail -n 1 "$OUT/${N}_replay_$(basename "$tree")_$k.log")"
        done
      done ;;
    dump)  # call 8's failing backward case by its seed: its tensors and where dq's error comes from
      python3 bench/dev/dump_bwd_case.py "$OUT" > "$OUT/${N}_dump.log" 2>&1; cat "$OUT/${N}_dump.log" | tail -n 20 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
