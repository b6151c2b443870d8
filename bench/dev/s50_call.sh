#!/usr/bin/env bash
# Session 50's device calls: this session's steps below, and those of bench/dev/call_steps.sh (suite, slow,
# dgrid, dtests, dab against OLD, psplit, tl, host, newcache, ...).
#   eparts    bench/dev/eager_parts.py: a single eager decode call taken apart (EP_SHAPES, EP_REPS)
#   epab      eager_parts.py on OLD's tree and this one, alternately (EP_SHAPES, EP_REPS)
#   STEPS="psplit dab dtests newcache" CALL=c1 OLD=.oldtree/main50 bash bench/dev/s50_call.sh
#   (OUT: where logs go; the kernel cache carried as .cache/cf.txz)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main50}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
session_step() {
  case "$1" in
    eparts)
      python3 bench/dev/eager_parts.py --reps "${EP_REPS:-300}" --shapes ${EP_SHAPES:-4x512x1 16x512x8 1x2048x4 16x2048x8} \
        --json "$OUT/${N}_eparts.json" > "$OUT/${N}_eparts.log" 2>&1
      cat "$OUT/${N}_eparts.log" | tail -n 40 ;;
    epab)  # eager_parts.py on OLD's tree and this one, alternately (old new old new), each its own process
      k=0
      for t in "$OLD" . "$OLD" .; do
        k=$((k + 1)); tag=$([ "$t" = . ] && echo new || echo old)
        [ "$t" != . ] && cp bench/dev/eager_parts.py "$t/bench/dev/"
        python3 "$t/bench/dev/eager_parts.py" --reps "${EP_REPS:-200}" --shapes ${EP_SHAPES:-4x512x1 16x512x8 1x2048x4} \
          --json "$OUT/${N}_epab_${k}_${tag}.json" > "$OUT/${N}_epab_${k}_${tag}.log" 2>&1
        echo "== run $k ($tag)"; grep -E " (lib|runcall|cudnn) " "$OUT/${N}_epab_${k}_${tag}.log"
      done ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
# one archive of the call's logs and JSON (the device returns a few files a call), beside the grid's
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" -delete)
