#!/usr/bin/env bash
# Session 26's device call: GPU test files (TESTS, -m "gpu and not slow" unless MARK), then
# bench/dev/fwd_ab_inproc.py once per AB_SETS entry ("TREES|TREE_ENV|HDS|SEQS", ";"-separated), then
# (SUITE_RUNS > 0) the quick GPU suite that many times. Logs to $OUT; a summary last. Carry: .cache,
# .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum
run_tests
run_ab_sets
run_suites
show_ab_logs
show_tests
exit 0
