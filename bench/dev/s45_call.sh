#!/usr/bin/env bash
# Session 45's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# wstests, splitab, threeab, splittest, probe, ab against OLD, grid, dgrid, dtests, dab against OLD).
#   pages     decode_splits.py at the library's plans: contiguous, and paged at PG_SIZES rows, pages in a
#             random order and in order (PG_SHAPES): is the paged gap the 16-key groups' or the table's?
#   ncu       Nsight Compute with per-instruction warp-stall samples on cuflash's decode kernel, one step
#             per NCU_SHAPES entry ("batch:cache:gqa:splits:stages:page", bench/dev/ncu_decode.py; page 0:
#             contiguous), summarized by bench/dev/ncu_src_summary.py
#   pairab    decode_splits.py at the library's plans, contiguous and paged (PA_SIZES rows, PA_SHAPES), with
#             CUFLASH_DECODE_KV_PAIR=0 and 1 alternated (0 1 0 1), each in its own process (the switch is
#             the branch s45-kv-pair's; main does not have it)
#   STEPS="pages ncu" CALL=c1 bash bench/dev/s45_call.sh   (OUT: where logs go; the kernel cache carried as
#   .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main45}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    pages)
      python3 bench/dev/decode_splits.py --paged --page-sizes ${PG_SIZES:-16 32 64 128 256} --in-order --splits 0 \
        --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" --json "$OUT/${N}_pages.json" \
        --shapes ${PG_SHAPES:-4x512x1 16x512x4 1x512x1 16x2048x8 1x8192x1 4x32768x4 16x8192x8} > "$OUT/${N}_pages.log" 2>&1
      grep -c " us " "$OUT/${N}_pages.log"; tail -n 2 "$OUT/${N}_pages.log" ;;
    ncu)
      NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
      echo "ncu: $NCU"
      REP=/tmp/ncu_s45; mkdir -p "$REP"
      for shape in ${NCU_SHAPES:-4:512:1:0:0:0 4:512:1:0:0:16}; do
        IFS=: read -r b L g s st pg <<< "$shape"
        tag="${b}_${L}_${g}_s${s}_st${st}_p${pg}"
        timeout 240 "$NCU" --profile-from-start off --clock-control none --kernel-name regex:flash_decode \
          --section LaunchStats --section SpeedOfLight --section WarpStateStats --section SourceCounters \
          -f -o "$REP/$tag" python3 bench/dev/ncu_decode.py "$b" "$L" "$g" "$s" "$st" "$pg" > "$OUT/${N}_ncu_$tag.log" 2>&1
        echo "ncu $shape rc $?"
        "$NCU" -i "$REP/$tag.ncu-rep" --page details --csv > "$OUT/${N}_ncu_det_$tag.csv" 2>&1
        "$NCU" -i "$REP/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/${N}_ncu_src_$tag.csv" \
          2> "$OUT/${N}_ncu_src_$tag.err"
        python3 bench/dev/ncu_src_summary.py "$OUT/${N}_ncu_det_$tag.csv" "$OUT/${N}_ncu_src_$tag.csv" 30 \
          > "$OUT/${N}_ncu_sum_$tag.txt" 2>&1
        head -n 4 "$OUT/${N}_ncu_sum_$tag.txt"
      done
      (cd "$OUT" && tar czf "${N}_ncu.tgz" ${N}_ncu_det_* ${N}_ncu_src_*.csv && rm -f ${N}_ncu_det_* ${N}_ncu_src_*.csv) ;;
    pairab)
      # CUFLASH_DECODE_KV_PAIR off / on, alternated (0 1 0 1), each in its own process on the same card
      PK=0
      for f in 0 1 0 1; do
        PK=$((PK + 1))
        CUFLASH_DECODE_KV_PAIR=$f python3 bench/dev/decode_splits.py --paged --page-sizes ${PA_SIZES:-16} --splits 0 \
          --calls "${CALLS:-30}" --rounds "${ROUNDS:-9}" --json "$OUT/${N}_pairab_$f$PK.json" \
          --shapes ${PA_SHAPES:-4x512x1 16x512x4 16x512x8 1x512x1 16x2048x8 1x8192x1 4x32768x4 16x8192x8 1x8192x4 4x8192x4} \
          > "$OUT/${N}_pairab_$f$PK.log" 2>&1
        echo "pairab kv_pair=$f run $PK: $(grep -c ' us ' "$OUT/${N}_pairab_$f$PK.log") rows"
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
