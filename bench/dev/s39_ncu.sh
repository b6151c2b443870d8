#!/usr/bin/env bash
# Session 39: Nsight Compute on the head_dim 128 causal forward, cuflash's kernel beside SDPA cuDNN's
# (bench/dev/ncu_fwd.py, bf16, 16k tokens), clocks locked at base: at 2048 keys on its work lists
# (the default) and on the kernel's pairs (CUFLASH_FWD_SCHED=0); at 8192 keys on the persistent grid
# (CUFLASH_FWD_WS_PERSISTENT=1) and a block per query block (the default). Per case the summary of
# bench/dev/ncu_summary.py into $OUT/ncu_<case>.txt, and the durations printed.
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)"
# The tensor pipe's share of cycles (wgmma), where this ncu knows the metric (as bench/dev/s20_ncu.sh).
TP="$("$NCU" --query-metrics --chip gh100 2>/dev/null | grep -oE "sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_tensor_cycles_active" | head -n 1)"
EXTRA=()
[ -n "$TP" ] && EXTRA=(--metrics "${TP}.avg.pct_of_peak_sustained_active")
for case in 2048:lists: 2048:pairs:CUFLASH_FWD_SCHED=0 8192:pers:CUFLASH_FWD_WS_PERSISTENT=1 8192:blocks:; do
  IFS=: read -r s tag envset <<< "$case"
  env $envset timeout 200 "$NCU" --profile-from-start off --clock-control base --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section LaunchStats "${EXTRA[@]}" --csv --page details python3 bench/dev/ncu_fwd.py "$s" 128 1 > "$OUT/ncu_$tag.csv" 2> "$OUT/ncu_$tag.err"
  python3 bench/dev/ncu_summary.py "$OUT/ncu_$tag.csv" > "$OUT/ncu_$tag.txt" 2>&1
  python3 - "$OUT/ncu_$tag.csv" "$s $tag" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader([l for l in open(sys.argv[1]) if l.startswith('"')])]
want = ("Duration", "Issue Slots Busy", "Executed Ipc Active", "L2 Hit Rate", "DRAM Throughput", "Grid Size")
by = {}
for r in rows:
    k = "cudnn" if "cudnn" in r["Kernel Name"] else "cuflash"
    n = r["Metric Name"]
    if n in want or "tensor" in n:
        by.setdefault(k, []).append(f"{n.replace('sm__pipe_', '')} {r['Metric Value']}")
for k, v in by.items():
    print(sys.argv[2], k, "; ".join(v))
PY
done
tar -C "$OUT" -czf "$OUT/ncu_csv.tgz" $(cd "$OUT" && ls ncu_*.csv) && rm -f "$OUT"/ncu_*.csv "$OUT"/ncu_*.err
