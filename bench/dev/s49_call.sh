#!/usr/bin/env bash
# Session 49's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, dab against OLD, ...).
#   psplit    decode_splits.py on this tree at forced split counts (PS_SPLITS) and warps (PS_WARPS),
#             contiguous and 16-row pages (PS_SHAPES)
#   tl        bench/dev/decode_timeline.py on this tree (TL_SHAPES, --paged, TL_SPLITS)
#   host      bench/bench_host.py on HOST_ROWS (host time per call against SDPA flash and cuDNN)
#   newcache  the kernel cache entries this call compiled (newer than the call's start), as
#             ${CALL}_newcache.tgz, to merge into the carried cache here
#   STEPS="psplit dab dtests newcache" CALL=c1 OLD=.oldtree/main49 bash bench/dev/s49_call.sh
#   (OUT: where logs go; the kernel cache carried as .cache/cf.txz)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main49}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    tl)
      python3 bench/dev/decode_timeline.py --paged --reps "${TL_REPS:-10}" --modes ${TL_MODES:-idle graph} \
        --splits "${TL_SPLITS:-0}" --shapes ${TL_SHAPES:-16x2048x8 16x512x4} --json "$OUT/${N}_tl.json" \
        > "$OUT/${N}_tl.log" 2>&1
      echo "tl: $(grep -c span "$OUT/${N}_tl.log") rows" ;;
    psplit)
      python3 bench/dev/decode_splits.py --paged --splits ${PS_SPLITS:-0 1 2 4} --warps ${PS_WARPS:-0 4 8} \
        --calls "${CALLS:-30}" --rounds "${ROUNDS:-7}" --json "$OUT/${N}_psplit.json" \
        --shapes ${PS_SHAPES:-16x2048x8 16x2048x4 16x512x4 4x512x1 16x512x8} > "$OUT/${N}_psplit.log" 2>&1
      echo "psplit: $(grep -c ' us ' "$OUT/${N}_psplit.log") rows"; tail -n 2 "$OUT/${N}_psplit.log" ;;
    host)
      python3 bench/bench_host.py --rounds "${HOST_ROUNDS:-9}" --json "$OUT/${N}_host.json" \
        --rows ${HOST_ROWS:-torch.fwd torch.fwd_grad torch.fwdbwd sdpa_flash.* sdpa_cudnn.* cupy.fwd} \
        > "$OUT/${N}_host.log" 2>&1
      tail -n 14 "$OUT/${N}_host.log" ;;
    newcache)
      (cd .cache && find cf -type f -newer "$T0" > "$T0.list" && tar czf "$OUT/${N}_newcache.tgz" -T "$T0.list")
      echo "newcache: $(wc -l < "$T0.list") files, $(du -h "$OUT/${N}_newcache.tgz" | cut -f1)" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
# one archive of the call's logs and JSON (the device returns a few files a call), beside the grid's
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" -delete)
