#!/usr/bin/env bash
# Session 54's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, host, ...).
#   src    Nsight Compute's source counters (SASS, instructions executed and warp-stall samples per
#          instruction) of one decode step per plan variant in SRC_VARIANTS (bench/dev/ncu_decode_clock.py's
#          SPLITS:WARPS; default the library's plan and the 8-warp unsplit one) at SRC_SHAPE (16 32768 4),
#          once per --clock-control setting in SRC_CLOCKS (default none: clocks left free); summarized by
#          bench/dev/ncu_src_ops.py
#   clock  bench/dev/s53_clock.sh: Nsight Compute at base and free clocks, CLOCK_SHAPES (16 131072 4 and
#          16 32768 4) x CLOCK_VARIANTS (0:0 1:8: the library's plan and the 8-warp unsplit one), with
#          SDPA flash and cuDNN
#   dab54  bench/dev/s53_ab.sh: bench_decode.py on batch 1 4 16 x caches 2k-128k x GQA 1 4 8, OLD's tree
#          (.oldtree/main54: git archive of HEAD's cuflash, cuda_src and bench_decode.py) and this one
#          alternated twice, each its own process
#   STEPS="src" CALL=c1 bash bench/dev/s54_call.sh   (OUT: where logs go)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main54}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
session_step() {
  case "$1" in
    src)
      for cc in ${SRC_CLOCKS:-none}; do
        local f="$OUT/${N}_src_$cc"
        "$NCU" --profile-from-start off --clock-control $cc --import-source no \
          --section SourceCounters --section InstructionStats --section WarpStateStats --section SpeedOfLight \
          -k regex:flash_decode -f -o "$f" \
          python3 bench/dev/ncu_decode_clock.py ${SRC_SHAPE:-16 32768 4} ${SRC_VARIANTS:-0:0 1:8} > "${f}_run.log" 2>&1
        echo "ncu ($cc) rc $?: $(grep order "${f}_run.log")"
        "$NCU" -i "$f.ncu-rep" --page source --print-source sass --csv > "${f}_sass.csv" 2> "${f}_sass.err"
        "$NCU" -i "$f.ncu-rep" --page details --csv > "${f}_details.csv" 2>&1
        python3 bench/dev/ncu_src_ops.py "${f}_details.csv" "${f}_sass.csv" > "${f}_ops.log" 2>&1
        grep -E "^kernel|^== |counts of|hot instructions \(|^   (HMMA|LDSM|FMUL|MUFU|LOP3|BRA|IMAD|SYNCS|BAR|FADD|FFMA|FMNMX|SHFL|ISETP) " "${f}_ops.log"
        grep -E '"Duration"' "${f}_details.csv" | cut -c1-200
      done ;;
    clock)
      SHAPES="${CLOCK_SHAPES:-16 131072 4
16 32768 4}" VARIANTS="${CLOCK_VARIANTS:-0:0 1:8}" OUT="$OUT" bash bench/dev/s53_clock.sh > "$OUT/${N}_clock.log" 2>&1
      grep -E "^==|flash_decode|cudnn|flash_fwd|fmha|Kernel" "$OUT/${N}_clock.log" | cut -c1-230 ;;
    dab54)
      OLD="$OLD" OUT="$OUT" bash bench/dev/s53_ab.sh 2>&1 | tail -n 8
      (cd "$OUT" && tar czf "${N}_ab.tgz" ab_*.json ab_*.log && rm -f ab_*.json ab_*.log) ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json ${N}_*.csv 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_src_*.ncu-rep" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" ! -name "${N}_host.json" ! -name "${N}_ab.tgz" -delete)
