#!/usr/bin/env bash
# Session 47's device calls: this session's step below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, dab against OLD, ...).
#   ftests    the paged-fill and 2-stage rules' tests (tests/test_kvcache_decode.py -k "paged_fill or shallow")
#   psplit    decode_splits.py on this tree at forced split counts (PS_SPLITS, 0 = the library's), contiguous
#             and 16-row pages (PS_SHAPES): does a split count bring a 16-key-group paged point within 1.1x
#             of the contiguous library plan?
#   STEPS="dab dtests psplit" CALL=c1 OLD=.oldtree/main47 bash bench/dev/s47_call.sh   (OUT: where logs go;
#   the kernel cache carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main47}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    psplit)
      python3 bench/dev/decode_splits.py --paged --splits ${PS_SPLITS:-0 2 4 8} --calls "${CALLS:-30}" \
        --rounds "${ROUNDS:-7}" --json "$OUT/${N}_psplit.json" \
        --shapes ${PS_SHAPES:-16x2048x8 16x512x4 4x512x1 16x512x8 1x131072x4 4x32768x4} > "$OUT/${N}_psplit.log" 2>&1
      grep -c " us " "$OUT/${N}_psplit.log"; tail -n 2 "$OUT/${N}_psplit.log" ;;
    ftests)
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_kvcache_decode.py -k "paged_fill or shallow" \
        > "$OUT/${N}_ftests.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_ftests.log" | head -20
      echo "ftests: $(tail -n 1 "$OUT/${N}_ftests.log")" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
# one archive of the call's logs and JSON (the device returns a few files a call), beside the grid's
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" -delete)
