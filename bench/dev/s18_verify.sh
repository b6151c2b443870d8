#!/usr/bin/env bash
# One device call that verifies this branch (s18-gpu-rounded-sum) on a GPU:
#   1. the quick GPU suite (-m "gpu and not slow", with tests/test_near_equal_scores.py's GPU cases);
#   2. bench/dev/fwd_lp_ab.py on main's kernels and on this tree, twice each, alternating: accuracy at
#      nearly equal scores, forward GPU time, single eager calls; then the new/main ratio per row.
# Before the call, on the build machine:
#   mkdir -p .oldtree/main18 && git archive main cuflash cuda_src | tar -x -C .oldtree/main18
#   rm -rf .cache && bash scripts/carry_cache.sh      (this tree's kernels, sm_90a, NVRTC 13.0)
#   and main's forward kernels into the same cache (precompile on a checkout of main, backward=False)
# then run it with carry [".cache", ".oldtree/main18"]. Logs go to $OUT.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 200 python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 > "$OUT/suite.log" 2>&1
echo "suite rc $?"
for i in 1 2; do
  acc=$([ "$i" = 1 ] && echo 1 || echo 0)
  CUFLASH_BENCH_PATH=.oldtree/main18 ACC=$acc timeout 100 python3 bench/dev/fwd_lp_ab.py > "$OUT/ab_main_$i.log" 2>&1
  ACC=$acc timeout 100 python3 bench/dev/fwd_lp_ab.py > "$OUT/ab_new_$i.log" 2>&1
done
grep -h "^acc\|from" "$OUT/ab_main_1.log" "$OUT/ab_new_1.log"
OUT="$OUT" python3 - <<'PY'
import os, re, statistics as st
out = os.environ["OUT"]
def load(tag):
    d = {}
    for i in (1, 2):
        try:
            lines = open(f"{out}/ab_{tag}_{i}.log").read().splitlines()
        except OSError:
            continue
        for line in lines:
            m = re.match(r"^(fwd .*?|eager .*?|decode .*?): ([\d.]+) (ms|us)", line)
            if m:
                d.setdefault(m.group(1), []).append(float(m.group(2)))
    return d
old, new = load("main"), load("new")
rs = []
for k in old:
    if k in new:
        r = min(new[k]) / min(old[k])
        rs.append(r)
        print(f"{k:52s} main {min(old[k]):8.4f} new {min(new[k]):8.4f} new/main {r:.3f}")
if rs:
    print(f"geomean new/main {st.geometric_mean(rs):.4f} over {len(rs)} rows")
PY
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-300 | tail -14
