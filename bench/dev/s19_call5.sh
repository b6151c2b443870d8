#!/usr/bin/env bash
# Session 19, call 5: bench/dev/fwd_lp_inproc.py (main vs this tree, one process, fp16), then
# bench/dev/fwd_lp_ab.py twice per tree in separate processes, this tree first (bf16 and fp16).
# Needs the carry of bench/dev/s19_verify.sh (.cache with both trees' forward kernels, .oldtree/main18).
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout 300 python3 bench/dev/fwd_lp_inproc.py 2>&1 | tee "$OUT/inproc.log" | tail -20
for i in 1 2; do
  ACC=0 REPS=50 timeout 100 python3 bench/dev/fwd_lp_ab.py > "$OUT/ab_new_$i.log" 2>&1
  CUFLASH_BENCH_PATH=.oldtree/main18 ACC=0 REPS=50 timeout 100 python3 bench/dev/fwd_lp_ab.py > "$OUT/ab_main_$i.log" 2>&1
done
grep -h "bfloat16\|decode" "$OUT"/ab_new_1.log | head -3
