#!/usr/bin/env bash
# Session 49's device calls: the steps of bench/dev/call_steps.sh (suite, slow, dgrid, dtests, dab against
# OLD, psplit, tl, host, newcache, ...; psplit, tl, host and newcache were this script's own then).
#   STEPS="psplit dab dtests newcache" CALL=c1 OLD=.oldtree/main49 bash bench/dev/s49_call.sh
#   (OUT: where logs go; the kernel cache carried as .cache/cf.txz)
set -u
T0="$(mktemp)"
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main49}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
run_steps
# one archive of the call's logs and JSON (the device returns a few files a call), beside the grid's
(cd "$OUT" && tar czf "${N}_logs.tgz" ${N}_*.log ${N}_*.json 2>/dev/null && find . -maxdepth 1 -name "${N}_*" \
  ! -name "${N}_logs.tgz" ! -name "${N}_dgrid.json" ! -name "${N}_dgrid.png" ! -name "${N}_newcache.tgz" -delete)
