#!/usr/bin/env bash
# Session 26's device call: GPU test files (TESTS, -m "gpu and not slow" unless MARK), then
# bench/dev/fwd_ab_inproc.py once per AB_SETS entry ("TREES|TREE_ENV|HDS|SEQS", ";"-separated), then
# (SUITE_RUNS > 0) the quick GPU suite that many times. Logs to $OUT; a summary last. Carry: .cache,
# .oldtree.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest $TESTS -m "${MARK:-gpu and not slow}" -rf -p no:cacheprovider -q -n 8 \
    > "$OUT/tests.log" 2>&1
  echo "tests rc $?"
fi
i=0
IFS=';' read -ra SETS <<< "${AB_SETS:-}"
for set in "${SETS[@]}"; do
  i=$((i + 1))
  IFS='|' read -r trees tenv hds seqs <<< "$set"
  TREES="$trees" TREE_ENV="$tenv" HDS="$hds" SEQS="$seqs" DTYPES="${DTYPES:-bfloat16 float16}" \
    timeout "${AB_S:-300}" python3 bench/dev/fwd_ab_inproc.py > "$OUT/ab$i.log" 2>&1
  echo "ab$i rc $?"
done
for r in $(seq 1 "${SUITE_RUNS:-0}"); do
  timeout "${SUITE_S:-300}" python3 -m pytest tests -m "gpu and not slow" -rf -p no:cacheprovider -q -n 8 \
    > "$OUT/suite$r.log" 2>&1
  echo "suite run $r rc $?"
done
for f in "$OUT"/ab*.log; do
  [ -e "$f" ] || continue
  echo "== $(basename "$f")"; grep -v " from " "$f" | tail -"${AB_TAIL:-60}"
done
[ -n "${TESTS:-}" ] && grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -12
for f in "$OUT"/suite*.log; do
  [ -e "$f" ] || continue
  echo "== $(basename "$f")"; grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$f" | cut -c1-300 | tail -8
done
exit 0
