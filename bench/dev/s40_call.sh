#!/usr/bin/env bash
# Session 40's device calls (the steps are bench/dev/call_steps.sh's since session 41).
#   suite    the quick GPU suite (each run numbered: ${CALL}_suite_runK.log)
#   slow     the slow GPU grid (-m "gpu and slow")
#   wstests  the warp-specialized / TMA forwards' GPU tests and the causal block-order tests
#   splitab  the split tail (cuflash/_schedule.py split_schedule) against none, in one process
#   probe    bench/dev/tail_probe.py: the non-causal forward's last wave of work tiles
#   ab       this tree against OLD (default .oldtree/s40a) in one process (HDS, SEQS, CAUSAL as
#            fwd_ab_inproc.py reads them)
#   grid     bench.py's full grid with the peers and plots
#   STEPS="suite suite suite" CALL=c1 bash bench/dev/s40_call.sh   (OUT: where logs go; the kernel
#   cache carried as .cache/cf.tgz)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
OLD="${OLD:-.oldtree/s40a}"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
run_steps
