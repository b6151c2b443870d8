#!/usr/bin/env bash
# Session 61's device calls: the steps below, and those of bench/dev/call_steps.sh (suite, slow, host,
# newcache, ...).
#   knob   the warp-specialized backward's tuning switches at head_dim 128 against the library's
#          settings, one process, interleaved (bench/dev/fwd_ab_inproc.py PASS=bwd): the causal tail
#          group of 2 waves and of none, 3 stages of the Q / dO ring, dQ through sdQ and a bulk
#          reduction (KNOB_SEQS, KNOB_ROUNDS)
#   ncu    Nsight Compute on the final kernels beside cuDNN's, clocks free (bench/dev/ncu_fwd.py: head_dim
#          128 16k non-causal, head_dim 64 4k causal; bench/dev/ncu_bwd.py: head_dim 128 4k, and 2k
#          causal): per case bench/dev/ncu_summary.py's summary, and one line a kernel (duration, the
#          tensor pipe's share of active cycles, issue slots, registers)
#   STEPS="suite slow newcache" CALL=c1 bash bench/dev/s61_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main61}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    knob)
      PASS=bwd HDS=128 SEQS="${KNOB_SEQS:-2048 4096}" ROUNDS="${KNOB_ROUNDS:-9}" \
        TREES="base=. tail2=. tail0=. st3=. bulk=." \
        TREE_ENV="tail2:CUFLASH_BWD_TAIL_WAVES=2 tail0:CUFLASH_BWD_TAIL_WAVES=0 st3:CUFLASH_BWD_WS_STAGES=3 bulk:CUFLASH_BWD_DQ_RED=0" \
        python3 bench/dev/fwd_ab_inproc.py > "$OUT/${N}_knob.log" 2>&1
      grep -E "^bwd|^geomean|Error|error" "$OUT/${N}_knob.log" | cut -c1-200 ;;
    ncu)
      local ncu tp case script args tag
      ncu="$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)"
      tp="$("$ncu" --query-metrics --chip gh100 2>/dev/null | grep -oE "sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_tensor_cycles_active" | head -n 1)"
      for case in "fwd:16384 128 0:f128" "fwd:4096 64 1:f64c" "bwd:128 4096:b128" "bwd:128 2048 causal:b128c"; do
        IFS=: read -r script args tag <<< "$case"
        timeout 150 "$ncu" --profile-from-start off --clock-control none --section SpeedOfLight \
          --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
          ${tp:+--metrics "${tp}.avg.pct_of_peak_sustained_active"} --csv --page details \
          python3 "bench/dev/ncu_$script.py" $args > "$OUT/${N}_ncu_$tag.log" 2> "$OUT/${N}_ncu_$tag.err.log"
        python3 bench/dev/ncu_summary.py "$OUT/${N}_ncu_$tag.log" > "$OUT/${N}_ncu_${tag}_sum.log" 2>&1
        python3 - "$OUT/${N}_ncu_$tag.log" "$tag" <<'PY'
import csv, sys
rows = list(csv.DictReader([l for l in open(sys.argv[1]) if l.startswith('"')]))
want = ("Duration", "Issue Slots Busy", "Registers Per Thread", "Compute (SM) Throughput", "Memory Throughput")
by = {}
for r in rows:
    k = (r["ID"], r["Kernel Name"][:60])
    n = r["Metric Name"]
    if n in want or "tensor" in n:
        by.setdefault(k, []).append(f"{n.replace('sm__pipe_', '')} {r['Metric Value']}")
for k, v in by.items():
    print(sys.argv[2], k[0], k[1], "|", "; ".join(v))
PY
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
