#!/usr/bin/env bash
# Session 32's device call: s31_call.sh's steps (TESTS, SPLITS_ARGS, SPLITS2_ARGS, DECODE, HOST,
# SUITE_RUNS), then Nsight Compute with per-instruction warp-stall sampling on one decode step per
# NCU_SHAPES entry ("batch:cache:gqa:splits:stages", bench/dev/ncu_decode.py: cuflash's kernels, SDPA
# flash's and cuDNN's): $OUT/ncu_det_<tag>.csv (every section) and ncu_src_<tag>.csv (the SASS
# source page), summarized by bench/dev/ncu_src_summary.py. Everything under $OUT goes into
# $OUT/all.tgz at the end (the device tool returns 8 files at most); decode.json / .png and
# host.json also stay as they are. Carry: .cache/cf.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
SUITE_RUNS_SAVED="${SUITE_RUNS:-0}"
SUITE_RUNS=0 bash "$(dirname "${BASH_SOURCE[0]}")/s31_call.sh"
if [ -n "${NCU_SHAPES:-}" ]; then
  NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
  echo "ncu: $NCU"
  REP=/tmp/ncu_s32; mkdir -p "$REP"
  for shape in $NCU_SHAPES; do
    IFS=: read -r b L g s st <<< "$shape"
    tag="${b}_${L}_${g}_s${s}_st${st}"
    timeout 240 "$NCU" --profile-from-start off --clock-control none --section LaunchStats --section SpeedOfLight \
      --section WarpStateStats --section SourceCounters --section Occupancy -f -o "$REP/$tag" \
      python3 bench/dev/ncu_decode.py "$b" "$L" "$g" "$s" "$st" > "$OUT/ncu_$tag.log" 2>&1
    echo "ncu $shape rc $?"
    "$NCU" -i "$REP/$tag.ncu-rep" --page details --csv > "$OUT/ncu_det_$tag.csv" 2>&1
    "$NCU" -i "$REP/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_src_$tag.csv" 2> "$OUT/ncu_src_$tag.err"
    python3 bench/dev/ncu_src_summary.py "$OUT/ncu_det_$tag.csv" "$OUT/ncu_src_$tag.csv" 2>&1 | tail -60
  done
fi
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
SUITE_RUNS=$SUITE_RUNS_SAVED run_suites
TESTS= show_tests
(cd "$OUT" && tar czf /tmp/s32_all.tgz . && find . -type f ! -name decode.json ! -name decode.png ! -name host.json \
  -delete && mv /tmp/s32_all.tgz all.tgz)
exit 0
