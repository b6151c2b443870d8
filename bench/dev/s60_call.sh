#!/usr/bin/env bash
# Session 60's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# host, grid, ...).
#   bab   the backward, single eager calls and GPU time, OLD's tree and this one alternately (old new old
#         new), each in its own process: bench.py --passes bwd, cuflash against cuDNN (BAB_HDS, BAB_SEQS,
#         BAB_CAUSAL, BAB_ROUNDS, BAB_EAGER: eager runs per measurement)
#   hab   bench_host.py's grad rows, OLD's tree and this one alternately (old new old new)
#   srows bench/dev/bwd_single_rows.py: the one-launch backward against the three launches by row count
#   STEPS="suite bab hab" CALL=c1 OLD=.oldtree/main60 bash bench/dev/s60_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main60}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  local t root j
  case "$1" in
    bab)
      j=0
      for t in old new old new; do
        j=$((j + 1))
        if [ "$t" = old ]; then root="$OLD"; else root=.; fi
        PYTHONPATH="$root" python3 "$root/bench/bench.py" --providers cuflash sdpa_cudnn --passes bwd \
          --head-dims ${BAB_HDS:-64 128} --seqlens ${BAB_SEQS:-2048 4096} --causal "${BAB_CAUSAL:-both}" \
          --rounds "${BAB_ROUNDS:-4}" --eager-reps "${BAB_EAGER:-80}" --no-compile-timing \
          --json "$OUT/${N}_bab_$t$j.json" > "$OUT/${N}_bab_$t$j.log" 2>&1
        echo "bab $t$j rc $?"
      done
      python3 bench/dev/bwd_eager_ab.py "$OUT"/${N}_bab_*.json ;;
    hab)
      j=0
      for t in old new old new; do
        j=$((j + 1))
        if [ "$t" = old ]; then root="$OLD"; else root=.; fi
        PYTHONPATH="$root" python3 "$root/bench/bench_host.py" --rounds "${HOST_ROUNDS:-9}" \
          --rows torch.fwd_grad torch.fwdbwd sdpa_flash.fwd_grad sdpa_flash.fwdbwd \
          --json "$OUT/${N}_hab_$t$j.json" > "$OUT/${N}_hab_$t$j.log" 2>&1
        echo "hab $t$j: $(grep -E '^torch.fwdbwd ' "$OUT/${N}_hab_$t$j.log" | tail -n 1 | cut -c1-120)"
      done ;;
    srows)
      python3 bench/dev/bwd_single_rows.py --json "$OUT/${N}_srows.json" > "$OUT/${N}_srows.log" 2>&1
      tail -n 30 "$OUT/${N}_srows.log" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
