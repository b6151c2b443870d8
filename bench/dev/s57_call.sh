#!/usr/bin/env bash
# Session 57's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, psplit, newcache, ...).
#   soak    the randomized GPU tests (property, bad-input fuzzer, KV-cache device tests, extreme logits,
#           near-equal scores) at CUFLASH_HYPOTHESIS_SCALE=SOAK_SCALE (default 4), fresh seeds, under a
#           wall-clock cap of SOAK_T seconds (default 420); --durations names the long ones
#   gvar    bench/dev/graph_variants.py (GV_SHAPES, GV_VARIANTS): graph replay of forced decode plans
#   wsab    OLD against this tree with the warp-specialized forward forced (CUFLASH_FWD_WS=1; WS_HDS, WS_SEQS)
#   ab3     OLD, VAR (default .oldtree/nomf) and this tree in one process (HDS, SEQS, ROUNDS)
#   wsmin   this tree's table against CUFLASH_FWD_WS=1 at head_dim 64 (WS_SEQS)
#   d64grid bench.py's forward grid at head_dim 64 with SDPA flash and cuDNN (G_ROUNDS)
#   d64c    bench.py at head_dim 64, causal, forward, cuflash against cuDNN (D64_SEQS, D64_ROUNDS)
#   STEPS="soak gvar" CALL=c1 bash bench/dev/s57_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main57}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    soak)
      CUFLASH_HYPOTHESIS_SCALE="${SOAK_SCALE:-4}" timeout "${SOAK_T:-420}" python3 -m pytest -m gpu -q -rf -n 8 \
        -p no:cacheprovider --durations=20 tests/test_property_gpu.py tests/test_fuzz_inputs.py \
        tests/test_kvcache_device.py tests/test_extreme_logits_gpu.py tests/test_near_equal_scores.py \
        > "$OUT/${N}_soak.log" 2>&1
      echo "soak (scale ${SOAK_SCALE:-4}, rc $?): $(tail -n 1 "$OUT/${N}_soak.log")"
      grep -E "^FAILED|seed=" "$OUT/${N}_soak.log" | head -20 ;;
    gvar)
      python3 bench/dev/graph_variants.py ${GV_SHAPES:+--shapes $GV_SHAPES} ${GV_VARIANTS:+--variants $GV_VARIANTS} \
        --json "$OUT/${N}_gvar.json" > "$OUT/${N}_gvar.log" 2>&1
      tail -n 40 "$OUT/${N}_gvar.log" ;;
    wsab)  # the warp-specialized forward forced (CUFLASH_FWD_WS=1) in OLD and in this tree, same process
      HDS="${WS_HDS:-64}" SEQS="${WS_SEQS:-1024 2048}" TREES="old=$OLD new=." \
        TREE_ENV="old:CUFLASH_FWD_WS=1 new:CUFLASH_FWD_WS=1" ROUNDS="${ROUNDS:-7}" \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_wsab.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_wsab.log" | cut -c1-200 ;;
    ab3)  # OLD, a variant tree (VAR, default .oldtree/nomf) and this tree, same process
      HDS="${HDS:-64 256}" SEQS="${SEQS:-2048 4096 8192 16384}" TREES="old=$OLD var=${VAR:-.oldtree/nomf} new=." \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_ab3.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_ab3.log" | cut -c1-200 ;;
    wsmin)  # this tree: the table's kernel against the warp-specialized one forced, head_dim 64
      HDS=64 SEQS="${WS_SEQS:-1024 2048 4096}" TREES="table=. ws=." TREE_ENV="ws:CUFLASH_FWD_WS=1" \
        ROUNDS="${ROUNDS:-9}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_wsmin.log" 2>&1
      grep -E "causal|^geomean|Error|error" "$OUT/${N}_wsmin.log" | cut -c1-200 ;;
    d64grid)  # bench.py's forward at head_dim 64 against SDPA flash and cuDNN (FlashAttention-2's grid)
      python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --head-dims 64 --passes fwd \
        --rounds "${G_ROUNDS:-4}" --no-compile-timing --json "$OUT/${N}_d64grid.json" > "$OUT/${N}_d64grid.log" 2>&1
      grep -E "^fwd |seqlen>=|^cuflash errors" "$OUT/${N}_d64grid.log" | cut -c1-130 | head -n 40 ;;
    d64c)  # issue 12's closest forward point against cuDNN (session 52's step)
      python3 bench/bench.py --providers cuflash sdpa_cudnn --head-dims 64 --seqlens ${D64_SEQS:-4096} \
        --causal on --passes fwd --rounds "${D64_ROUNDS:-12}" --no-compile-timing \
        --json "$OUT/${N}_d64c.json" > "$OUT/${N}_d64c.log" 2>&1
      grep -iE "tflop|cudnn|ratio|Error" "$OUT/${N}_d64c.log" | tail -n 12 ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
