#!/usr/bin/env bash
# Session 26: where the head_dim 128 forward's consumer warps wait. Nsight Compute with launch
# statistics and per-instruction warp-stall sampling (SourceCounters) on bench/dev/ncu_fwd.py (one
# cuflash call and one SDPA cuDNN call after a warm-up; bf16, 16k tokens, hidden 2048). SHAPES:
# "seqlen:head_dim:causal:persistent" (persistent: CUFLASH_FWD_WS_PERSISTENT, "-" for the default).
# Writes to $OUT: details csv (all sections) and the source page (SASS, per-instruction samples) of
# each report (EXTRA_SECTIONS: more ncu sections). Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
echo "ncu: $NCU"; "$NCU" --version | tail -1
REP=/tmp/ncu_s26; mkdir -p "$REP"
for shape in ${SHAPES:-512:128:0:- 2048:128:0:0 2048:128:0:1}; do
  IFS=: read -r s d c pers <<< "$shape"
  tag="${s}_${d}_${c}_p${pers}"
  if [ "$pers" = "-" ]; then unset CUFLASH_FWD_WS_PERSISTENT; else export CUFLASH_FWD_WS_PERSISTENT=$pers; fi
  timeout 300 "$NCU" --profile-from-start off --clock-control none --section LaunchStats --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --section Occupancy ${EXTRA_SECTIONS:-} -f -o "$REP/$tag" \
    python3 bench/dev/ncu_fwd.py "$s" "$d" "$c" > "$REP/ncu_$tag.log" 2>&1
  echo "== $shape rc $?"
  "$NCU" -i "$REP/$tag.ncu-rep" --page details --csv > "$OUT/det_$tag.csv" 2>&1
  "$NCU" -i "$REP/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/src_$tag.csv" 2> "$REP/src_$tag.err"
  echo "   source page rc $? ($(wc -c < "$OUT/src_$tag.csv") bytes)"
  python3 bench/dev/ncu_summary.py "$OUT/det_$tag.csv" 2>&1 | grep -E "^==|Duration|Grid Size|Block Size|Registers|Shared Memory|tensor|Issue Slots|Warp Cycles" | cut -c1-120
done
unset CUFLASH_FWD_WS_PERSISTENT
exit 0
