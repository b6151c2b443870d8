#!/usr/bin/env bash
# Session 20: Nsight Compute on the final forward (bench/dev/ncu_fwd.py) against SDPA cuDNN's, at
# FlashAttention-2's grid shapes (SHAPES: "seqlen:head_dim:causal ..."). Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
echo "ncu: $NCU"
# The tensor pipe's share of cycles (wgmma), where this ncu knows the metric.
TP="$("$NCU" --query-metrics --chip gh100 2>/dev/null | grep -oE "sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_tensor_cycles_active" | head -n 1)"
EXTRA=()
[ -n "$TP" ] && EXTRA=(--metrics "${TP}.avg.pct_of_peak_sustained_active")
echo "tensor pipe metric: ${TP:-none}"
for shape in ${SHAPES:-1024:128:0 16384:128:0 2048:64:1}; do
  IFS=: read -r s d c <<< "$shape"
  timeout 240 "$NCU" --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section Occupancy "${EXTRA[@]}" --csv --page details \
    python3 bench/dev/ncu_fwd.py "$s" "$d" "$c" > "$OUT/ncu_fwd_${s}_${d}_${c}.csv" 2> "$OUT/ncu_fwd_${s}_${d}_${c}.err"
  echo "== $shape rc $?"
  python3 bench/dev/ncu_summary.py "$OUT/ncu_fwd_${s}_${d}_${c}.csv" > "$OUT/ncu_fwd_${s}_${d}_${c}.txt" 2>&1
  grep -E "^==|Duration|Issue Slots Busy|Warp Cycles Per Issued|Eligible Warps|pipe|Stall" "$OUT/ncu_fwd_${s}_${d}_${c}.txt" \
    | cut -c1-130 | head -40
done
