#!/usr/bin/env bash
# Session 19's same-process A/B (calls 6, 7, 8 and 11, each on its tree): with SUITE=1 (default) the
# quick GPU suite on this tree first; then bench/dev/fwd_ab_inproc.py over TREES (default: main's
# kernels in .oldtree/main18, a1bf6e7's in .oldtree/c, this tree), bf16 and fp16 (DECODE=1: decode
# steps instead of the forward); with SUITE=1 also the accuracy part of bench/dev/fwd_lp_ab.py.
# Carry: .cache (this tree's carry cache plus the old trees' kernels) and .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
if [ "${SUITE:-1}" = 1 ]; then
  timeout 240 python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 > "$OUT/suite.log" 2>&1
  echo "suite rc $?"
fi
TREES="${TREES:-main=.oldtree/main18 c=.oldtree/c new=.}" timeout 300 python3 bench/dev/fwd_ab_inproc.py 2>&1 | tee "$OUT/inproc3.log" | tail -40
[ "${SUITE:-1}" = 1 ] || exit 0
ACC=1 HDS=64 SEQS=1024 REPS=5 timeout 120 python3 bench/dev/fwd_lp_ab.py 2>&1 | grep "^acc" | tee "$OUT/acc.log"
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-300 | tail -14
