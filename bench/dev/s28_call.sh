#!/usr/bin/env bash
# Session 28's device call (an H200 session): nvidia-smi samples clocks / power every 100 ms in the
# background (call_lib.sh smi_start); then, each when its variable is set: the quick GPU suite first
# (SUITE_FIRST=1 with SUITE_RUNS), the dev scripts PROBES, the grid against SDPA flash and cuDNN
# (GRID=1, GRID_ARGS), a second grid (GRID2_ARGS), bench_host.py (HOST=1, HOST_ARGS), bench_decode.py
# (DECODE=quick|full, DECODE_ARGS), bench_flex.py (FLEX=1, FLEX_ARGS), gpt2.py (GPT2_ARGS), the A/B
# sets of call_lib.sh (AB_SETS), the GPU test files TESTS, the quick GPU suite SUITE_RUNS times (unless
# it ran first). Logs and JSON to $OUT; a summary last. Carry: .cache.
export CUFLASH_CACHE_DIR=$PWD/.cache/cf PYTHONPATH=.
OUT="${OUT:-./out}"; mkdir -p "$OUT"
. "$(dirname "${BASH_SOURCE[0]}")/call_lib.sh"
smi_start
run_suites_first() { [ "${SUITE_FIRST:-0}" = 1 ] && run_suites; return 0; }
run_suites_first
i=0
for script in ${PROBES:-}; do  # dev scripts, each with the environment of this call: $OUT/probe1.log, ...
  i=$((i + 1))
  timeout "${PROBE_S:-200}" python3 "$script" > "$OUT/probe$i.log" 2>&1; echo "probe$i ($script) rc $?"
done
if [ "${GRID:-0}" = 1 ]; then
  timeout "${GRID_S:-300}" python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
    ${GRID_ARGS:-} --json "$OUT/grid.json" > "$OUT/grid.log" 2>&1; echo "grid rc $?"
fi
if [ -n "${GRID2_ARGS:-}" ]; then  # a second grid (another order or subset): grid2.json, grid2.log
  timeout "${GRID2_S:-200}" python3 bench/bench.py --providers cuflash sdpa_flash sdpa_cudnn --no-compile-timing \
    $GRID2_ARGS --json "$OUT/grid2.json" > "$OUT/grid2.log" 2>&1; echo "grid2 rc $?"
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout "${HOST_S:-200}" python3 bench/bench_host.py ${HOST_ARGS:-} --markdown --json "$OUT/host.json" \
    > "$OUT/host.log" 2>&1; echo "host rc $?"
fi
if [ -n "${DECODE:-}" ]; then
  q=""; [ "$DECODE" = quick ] && q="--quick"
  timeout "${DECODE_S:-560}" python3 bench/bench_decode.py $q ${DECODE_ARGS:-} --json "$OUT/decode.json" --plot "$OUT/decode.png" \
    > "$OUT/decode.log" 2>&1; echo "decode rc $?"
fi
if [ "${FLEX:-0}" = 1 ]; then
  timeout "${FLEX_S:-300}" python3 bench/bench_flex.py ${FLEX_ARGS:-} --json "$OUT/flex.json" \
    > "$OUT/flex.log" 2>&1; echo "flex rc $?"
fi
if [ -n "${GPT2_ARGS:-}" ]; then
  timeout "${GPT2_S:-300}" python3 bench/gpt2.py $GPT2_ARGS --json "$OUT/gpt2.json" > "$OUT/gpt2.log" 2>&1
  echo "gpt2 rc $?"
fi
run_ab_sets
run_tests
[ "${SUITE_FIRST:-0}" = 1 ] || run_suites
smi_stop
for f in "$OUT"/probe*.log; do
  [ -e "$f" ] && { echo "== $(basename "$f")"; grep -v "^\s*$" "$f" | tail -"${PROBE_TAIL:-40}" | cut -c1-220; }
done
[ -e "$OUT/grid.log" ] && { echo "== grid.log"; tail -"${GRID_TAIL:-25}" "$OUT/grid.log"; }
[ -e "$OUT/grid2.log" ] && { echo "== grid2.log"; tail -"${GRID2_TAIL:-12}" "$OUT/grid2.log"; }
[ -e "$OUT/host.log" ] && { echo "== host.log"; tail -"${HOST_TAIL:-20}" "$OUT/host.log"; }
[ -e "$OUT/decode.log" ] && { echo "== decode.log"; tail -"${DECODE_TAIL:-20}" "$OUT/decode.log"; }
[ -e "$OUT/flex.log" ] && { echo "== flex.log"; tail -"${FLEX_TAIL:-20}" "$OUT/flex.log"; }
[ -e "$OUT/gpt2.log" ] && { echo "== gpt2.log"; tail -"${GPT2_TAIL:-20}" "$OUT/gpt2.log"; }
show_ab_logs 40
show_tests
exit 0
