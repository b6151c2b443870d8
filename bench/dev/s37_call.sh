#!/usr/bin/env bash
# Session 37's device calls: the quick GPU suite on this tree (suite); the pad-up tests of calls with
# options below head_dim 64 (feat); bench/dev/padup_small_feat.py, pad-up forced against off (probe)
# and the tree's rule against off (rule).
#   STEPS="feat probe" CALL=c1 bash bench/dev/s37_call.sh   (OUT: where logs go; the kernel cache
#   carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
STEPS="${STEPS:-feat probe}"
md5sum cuflash/_config.py cuflash/_launch.py | cut -c1-12
for step in $STEPS; do
  case "$step" in
    suite) run_suite ;;
    feat)
      python3 -m pytest -q -rf -p no:cacheprovider tests/test_fwd_ws_feat_gpu.py tests/test_plan_wiring.py \
        -k "padded or nan or varlen or padup" > "$OUT/${N}_feat.log" 2>&1
      grep -E "^FAILED|seed" "$OUT/${N}_feat.log" | head -20
      echo "feat: $(tail -n 1 "$OUT/${N}_feat.log")" ;;
    probe)
      python3 bench/dev/padup_small_feat.py > "$OUT/${N}_probe.log" 2>&1
      sed -n '/^worst over/,$p' "$OUT/${N}_probe.log"; grep -m3 FAILED "$OUT/${N}_probe.log" ;;
    rule)
      python3 bench/dev/padup_small_feat.py --variants rule native rule native > "$OUT/${N}_rule.log" 2>&1
      sed -n '/^all points/,/^worst over/p' "$OUT/${N}_rule.log"; grep -m3 FAILED "$OUT/${N}_rule.log" ;;
  esac
done
