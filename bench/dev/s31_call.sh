#!/usr/bin/env bash
# Session 31's device call (the decode's cluster merge): each step when its variable is set, in this
# order: the GPU test files TESTS (call_lib.sh run_tests), bench/dev/decode_splits.py with SPLITS_ARGS
# ($OUT/splits.log, .json), a second SPLITS2_ARGS, bench_decode.py (DECODE=quick|full, DECODE_ARGS),
# bench_host.py (HOST=1), the quick GPU suite SUITE_RUNS times. Logs and JSON to $OUT; a summary
# last. Carry: .cache/cf.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cuda_src md5 $(md5sum cuda_src/*.cu cuda_src/*.cuh | sort | md5sum | cut -c1-12)"
run_tests
if [ -n "${SPLITS_ARGS:-}" ]; then
  timeout "${SPLITS_S:-200}" python3 bench/dev/decode_splits.py $SPLITS_ARGS --json "$OUT/splits.json" \
    > "$OUT/splits.log" 2>&1; echo "splits rc $?"
fi
if [ -n "${SPLITS2_ARGS:-}" ]; then
  timeout "${SPLITS2_S:-200}" python3 bench/dev/decode_splits.py $SPLITS2_ARGS --json "$OUT/splits2.json" \
    > "$OUT/splits2.log" 2>&1; echo "splits2 rc $?"
fi
if [ -n "${DECODE:-}" ]; then
  q=""; [ "$DECODE" = quick ] && q="--quick"
  timeout "${DECODE_S:-300}" python3 bench/bench_decode.py $q ${DECODE_ARGS:-} --json "$OUT/decode.json" \
    --plot "$OUT/decode.png" > "$OUT/decode.log" 2>&1; echo "decode rc $?"
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout "${HOST_S:-200}" python3 bench/bench_host.py ${HOST_ARGS:-} --markdown --json "$OUT/host.json" \
    > "$OUT/host.log" 2>&1; echo "host rc $?"
fi
run_suites
for f in splits splits2; do
  [ -e "$OUT/$f.log" ] && { echo "== $f.log"; grep -v "^\s*$" "$OUT/$f.log" | tail -"${SPLITS_TAIL:-80}" | cut -c1-160; }
done
[ -e "$OUT/decode.log" ] && { echo "== decode.log"; tail -"${DECODE_TAIL:-20}" "$OUT/decode.log"; }
[ -e "$OUT/host.log" ] && { echo "== host.log"; tail -"${HOST_TAIL:-20}" "$OUT/host.log"; }
show_tests
exit 0
