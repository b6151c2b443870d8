#!/bin/bash
# Session 22: the preprocess A/B (this tree against .oldtree/main22), then the quick GPU suite.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2 3; do
  PYTHONPATH=.oldtree/main22 python bench/dev/bwd_pre_ab.py old 2>&1 | grep -v Warn | grep -v _warn_once
  PYTHONPATH=. python bench/dev/bwd_pre_ab.py new 2>&1 | grep -v Warn | grep -v _warn_once
done > $OUT/pre_ab.log
cat $OUT/pre_ab.log
if [ "${SUITE:-1}" = 1 ]; then
  PYTHONPATH=. timeout ${SUITE_TIMEOUT:-400} python -m pytest tests -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider > $OUT/suite.log 2>&1
  tail -5 $OUT/suite.log
fi
