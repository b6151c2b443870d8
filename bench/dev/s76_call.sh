#!/usr/bin/env bash
# Session 76's device calls: the steps below and those of bench/dev/call_steps.sh (suite, dtests, layout,
# dgrid, host, envab, ...).
#   rdx      bench/dev/decode_read_bw.py at RX_SHAPE (BxLxHEADS_KV, default 64x131072x4, the x 8 point's cache)
#            once for each argument set in RX_SETS (separated by '|', default "--only-heads --gqa 8|--stamps 5"),
#            RX_ROUNDS rounds (default 9); logs rx_<k>.log / .json, k the set's index
#   STEPS="rdx speers" CALL=c1 bash bench/dev/s76_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    rdx)
      IFS=x read -r rb rl rh <<< "${RX_SHAPE:-64x131072x4}"
      IFS='|' read -r -a sets <<< "${RX_SETS:---only-heads --gqa 8|--stamps 5}"
      for i in "${!sets[@]}"; do
        python3 bench/dev/decode_read_bw.py --batch "$rb" --seqlen "$rl" --heads-kv "$rh" --rounds "${RX_ROUNDS:-9}" \
          ${sets[$i]} --json "$OUT/${N}_rx_$i.json" > "$OUT/${N}_rx_$i.log" 2>&1
        echo "== ${sets[$i]}"; grep -E " us |span|rror" "$OUT/${N}_rx_$i.log" | cut -c1-600
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
