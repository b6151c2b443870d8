#!/usr/bin/env bash
# Session 23's device call: GPU test files (TESTS, -m "gpu and not slow" unless MARK), then the same
# tree loaded twice by bench/dev/fwd_ab_inproc.py, the causal forward's tail order off
# (CUFLASH_FWD_TAIL_BLOCKS=0, the order before session 23) and on (the default), both wrapped in
# their environment (OPTS: fwd_ab_inproc.py's options instead of the plain grid); then (BWD_TREES) the
# same for the backward (BWD_OPTS likewise); then (SUITE_RUNS > 0) the quick GPU suite that many times.
# Carry: .cache (scripts/carry_cache.sh).
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
run_tests
if [ "${AB:-1}" = 1 ]; then
  TREES="${TREES:-off=. on=.}" TREE_ENV="${TREE_ENV:-off:CUFLASH_FWD_TAIL_BLOCKS=0 on:CUFLASH_FWD_TAIL_BLOCKS=}" OPTS="${OPTS:-}" \
    SEQS="${SEQS:-1024 2048 4096 8192}" HDS="${HDS:-32 64 128 256}" DTYPES="${DTYPES:-bfloat16 float16}" \
    timeout "${AB_S:-240}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/inproc.log" 2>&1
  echo "inproc rc $?"
fi
if [ -n "${BWD_TREES:-}" ]; then
  TREES="$BWD_TREES" TREE_ENV="${BWD_ENV:-}" PASS=bwd OPTS="${BWD_OPTS:-}" SEQS="${BWD_SEQS:-1024 2048 4096 8192}" HDS="${BWD_HDS:-64 128}" \
    DTYPES="${DTYPES:-bfloat16 float16}" timeout "${BWD_S:-240}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/inproc_bwd.log" 2>&1
  echo "inproc bwd rc $?"
fi
run_suites
[ "${AB:-1}" = 1 ] && grep -v "^\(off\|on\) from" "$OUT/inproc.log" | tail -70
[ -n "${BWD_TREES:-}" ] && grep -v " from " "$OUT/inproc_bwd.log" | tail -50
show_tests
exit 0
