#!/usr/bin/env bash
# Session 72's device calls: the steps below and those of bench/dev/call_steps.sh (suite, slow, dtests,
# dgrid, host, psplit, ...).
#   tailrd   bench/dev/decode_read_bw.py --only-tail at TAIL_SHAPES (default 256x2048x32 256x8192x32
#            64x8192x32; BxLxHEADS_KV): a block an item against the last items read in splits (read_tma_tail),
#            beside cuflash's decode and cuDNN's at the shape, the list timed TAIL_REPEAT times (default 2)
#   tailab   bench/dev/tailtree/decode_tail_ab.py on the tree bench/dev/tailtree (made by git archive s72-tail
#            cuflash cuda_src bench/dev/decode_tail_ab.py bench/dev/decode_splits.py, then the two scripts
#            moved up to it): TAB_SHAPES, TAB_TAILS ("T,S" or "Nsm,S"; "none+VAR=VAL" an environment alone), TAB_ROUNDS
#   ltest    tests/test_gpu_layout.py and the split tail's tests of tests/test_kvcache_decode.py (-rs)
#   STEPS="tailrd" CALL=c1 bash bench/dev/s72_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    tailrd)
      python3 -c "import sys; sys.path.insert(0, 'bench/dev'); import decode_read_bw as m; m.build('/tmp/drb.cubin')"
      for s in ${TAIL_SHAPES:-256x2048x32 256x8192x32 64x8192x32}; do
        IFS=x read -r tb tl th <<< "$s"
        python3 bench/dev/decode_read_bw.py --cubin /tmp/drb.cubin --only-tail --tail-repeat "${TAIL_REPEAT:-2}" \
          --batch "$tb" --seqlen "$tl" --heads-kv "$th" --json "$OUT/${N}_tailrd_$s.json" > "$OUT/${N}_tailrd_$s.log" 2>&1
        echo "== $s"; grep -E " us |Error|error|WRONG" "$OUT/${N}_tailrd_$s.log" | cut -c1-200
      done ;;
    tailab)  # the split tail in the decode kernel (bench/dev/tailtree: the tree with it), TAB_TAILS, TAB_SHAPES
      PYTHONPATH=bench/dev/tailtree python3 bench/dev/tailtree/decode_tail_ab.py --shapes ${TAB_SHAPES:-256x2048x1 256x8192x1} \
        --tails "" ${TAB_TAILS:-1sm,2 3sm,2 3sm,4 6sm,2} --rounds "${TAB_ROUNDS:-7}" --json "$OUT/${N}_tailab.json" > "$OUT/${N}_tailab.log" 2>&1
      grep -E " us |grid|Error|error" "$OUT/${N}_tailab.log" | cut -c1-200 ;;
    ltest)  # the Params layout probes and the split tail's tests (-rs: their skips named)
      pytest_step ltest tests/test_gpu_layout.py tests/test_kvcache_decode.py -k "layout or offsets or split_tail" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
