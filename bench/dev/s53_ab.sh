#!/usr/bin/env bash
# Session 53: bench_decode.py on the shapes whose plan the 8-warp long-split rule changes (batch 1 4 16,
# caches 2k-128k, GQA 1 4 8, contiguous and 16-row pages), OLD's tree and this one alternated twice,
# each its own process.   OLD=.oldtree/main53 OUT=... bash bench/dev/s53_ab.sh
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/main53}"
k=0
for t in ${AB_ORDER:-old new old new}; do
  k=$((k + 1)); root=.; [ "$t" = old ] && root="$OLD"
  PYTHONPATH="$root" python3 "$root/bench/bench_decode.py" --batches ${AB_BATCHES:-1 4 16} \
    --caches ${AB_CACHES:-2048 8192 32768 131072} --no-host --json "$OUT/ab_${k}_$t.json" > "$OUT/ab_${k}_$t.log" 2>&1
  echo "== run $k ($t): $(grep -E 'MISSED|MET' "$OUT/ab_${k}_$t.log" | head -2 | cut -c1-200 | tr '\n' '|')"
done
