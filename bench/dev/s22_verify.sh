#!/bin/bash
# Session 22: the quick GPU suite three times in a row on the final code (logs to $OUT).
set -u
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
for r in 1 2 3; do
  timeout ${T:-175} python -m pytest tests -m "gpu and not slow" -q -rf -n 8 -p no:cacheprovider > $OUT/suite$r.log 2>&1
  echo "run $r rc $?: $(tail -1 $OUT/suite$r.log)"
done
