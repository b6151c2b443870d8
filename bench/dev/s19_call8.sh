#!/usr/bin/env bash
# Session 19, call 8: the quick GPU suite on this tree (the wgmma forwards sum the rounded P on the
# tensor cores up to head_dim 128, on the ALU at 256: fwd_sm90_steps.cuh), then bench/dev/fwd_ab_inproc.py with main's kernels
# (.oldtree/main18), a1bf6e7's (.oldtree/c: the rounded sum on the ALU) and this tree's in one
# process, bf16 and fp16; then the accuracy part of bench/dev/fwd_lp_ab.py. Carry: .cache (this
# tree's carry cache plus both old trees' forward kernels, head_dim 64-256) and .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 240 python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 > "$OUT/suite.log" 2>&1
echo "suite rc $?"
TREES="main=.oldtree/main18 c=.oldtree/c new=." timeout 300 python3 bench/dev/fwd_ab_inproc.py 2>&1 | tee "$OUT/inproc3.log" | tail -40
ACC=1 HDS=64 SEQS=1024 REPS=5 timeout 120 python3 bench/dev/fwd_lp_ab.py 2>&1 | grep "^acc" | tee "$OUT/acc.log"
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-300 | tail -14
