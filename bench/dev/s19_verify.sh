#!/usr/bin/env bash
# One device call that verifies the forward's division by the sum of the rounded P (softmax.cuh):
#   1. the quick GPU suite (-m "gpu and not slow", with tests/test_near_equal_scores.py's GPU cases);
#   2. tests/test_near_equal_scores.py's GPU cases on main's kernels (.oldtree/main18), to show that
#      they can fail where the kernels divide by the float32 sum;
#   3. bench/dev/fwd_lp_ab.py on main's kernels, on the ALU version of the sum (.oldtree/alu) and on
#      this tree, three rounds, alternating: accuracy at nearly equal scores (first round), forward
#      GPU time, single eager calls; then each row's ratio to main.
# Before the call, on the build machine:
#   mkdir -p .oldtree/main18 && git archive main cuflash cuda_src | tar -x -C .oldtree/main18
#   (and .oldtree/alu: cuflash and cuda_src of commit 63a84a7)
#   rm -rf .cache && bash scripts/carry_cache.sh      (this tree's kernels, sm_90a, NVRTC 13.0)
#   and both old trees' forward kernels into the same cache (precompile head_dims 16 64 96 128 256,
#   features, backward=False, with NVRTC 13.0 and PYTHONPATH=<tree>)
# then run it with carry [".cache", ".oldtree"]. Logs go to $OUT.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 240 python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 > "$OUT/suite.log" 2>&1
echo "suite rc $?"
(cd tests && PYTHONPATH=../.oldtree/main18 python3 -c "import cuflash; print('old-kernel tests use', cuflash.__file__)")
(cd tests && PYTHONPATH=../.oldtree/main18 timeout 120 python3 -m pytest test_near_equal_scores.py -m gpu -rf \
  -p no:cacheprovider -q -n 8 > "$OUT/near_equal_main.log" 2>&1)
echo "near-equal tests on main's kernels: rc $?"
for i in 1 2 3; do
  acc=$([ "$i" = 1 ] && echo 1 || echo 0)
  for tag in main $([ -d .oldtree/alu ] && echo alu) new; do
    case $tag in main) tree=.oldtree/main18;; alu) tree=.oldtree/alu;; new) tree=;; esac
    CUFLASH_BENCH_PATH=$tree ACC=$acc REPS=50 HDS="64 96 128" timeout 120 python3 bench/dev/fwd_lp_ab.py > "$OUT/ab_${tag}_$i.log" 2>&1
  done
done
grep -h "^acc\|from" "$OUT"/ab_*_1.log
OUT="$OUT" python3 - <<'PY'
import os, re, statistics as st
out = os.environ["OUT"]
def load(tag):
    d = {}
    for i in (1, 2, 3):
        try:
            lines = open(f"{out}/ab_{tag}_{i}.log").read().splitlines()
        except OSError:
            continue
        for line in lines:
            m = re.match(r"^(fwd .*?|eager .*?|decode .*?): ([\d.]+) (ms|us)", line)
            if m:
                d.setdefault(m.group(1), []).append(float(m.group(2)))
    return d
old, alu, new = load("main"), load("alu"), load("new")
ra, rn = [], []
for k in old:
    if k in new:
        n, o = min(new[k]), min(old[k])
        rn.append(n / o)
        extra = ""
        if k in alu:
            ra.append(min(alu[k]) / o)
            extra = f" alu/main {ra[-1]:.3f}"
        print(f"{k:50s} main {o:8.4f} new {n:8.4f} new/main {n / o:.3f}{extra}")
if rn:
    print(f"geomean over {len(rn)} rows: new/main {st.geometric_mean(rn):.4f}"
          + (f"  alu/main {st.geometric_mean(ra):.4f}" if ra else ""))
PY
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/near_equal_main.log" | cut -c1-250 | tail -8
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-300 | tail -14
