#!/usr/bin/env bash
# Session 68's device calls: the steps below, those of bench/dev/call_steps.sh (suite, slow, dtests, dgrid,
# host, newcache, ...) and bench/dev/s67_call.sh's / s66_call.sh's (specF, psq, ...).
#   m4t    the 64-row decode kernel's GPU test (tests/test_kvcache_decode.py::test_two_tiles) and the plan tests
#   m4ab   decode_splits.py at the library's plans with 64 rows a block (CUFLASH_DECODE_FOUR_TILES=1 at depth 3
#          and 4) against two 32-row blocks (=0), contiguous and 16-row pages, at M4_SHAPES (33-64 rows a kv
#          head), twice
#          (m4t and m4ab ran on branch s68-m4-rowgroups, whose decode_splits.py has --four-tiles)
#   route  bench/dev/prefill_route.py: contiguous chunks on the decode kernels against the feature forward (ROUTE_ARGS)
#   chunk  bench/dev/prefill_chunk.py: chunked prefill / long speculative steps, contiguous against paged (CHUNK_SHAPES)
#   STEPS="m4t m4ab newcache" CALL=c2 bash bench/dev/s68_call.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/call_steps.sh"
s67_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s67_call.sh)"; session_step "$1"); }
s66_step() { (source /dev/stdin <<< "$(sed -n '/^session_step()/,/^}/p' bench/dev/s66_call.sh)"; session_step "$1"); }
session_step() {
  case "$1" in
    m4t)
      python3 -m pytest -m gpu -q -rf -n 8 -p no:cacheprovider tests/test_kvcache_decode.py -k "two_tiles" \
        > "$OUT/${N}_m4t.log" 2>&1
      grep -E "^FAILED|^ERROR|seed" "$OUT/${N}_m4t.log" | head -20
      echo "m4t: $(tail -n 1 "$OUT/${N}_m4t.log")" ;;
    m4ab)
      local k
      for k in ${M4_ROUNDS:-1 2}; do
        python3 bench/dev/decode_splits.py --shapes ${M4_SHAPES:-16x8192x8x8 64x8192x8x8 16x32768x8x8 1x32768x8x8 16x8192x4x16 16x8192x8x5} \
          --paged --splits 0 --four-tiles 0 1 --four-stages 3 4 --calls 20 --rounds 5 \
          --json "$OUT/${N}_m4ab$k.json" > "$OUT/${N}_m4ab$k.log" 2>&1
        grep -E " us " "$OUT/${N}_m4ab$k.log"
      done ;;
    chunk)
      python3 bench/dev/prefill_chunk.py ${CHUNK_SHAPES:+--shapes $CHUNK_SHAPES} --json "$OUT/${N}_chunk.json" \
        > "$OUT/${N}_chunk.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_chunk.log" | cut -c1-160 ;;
    route)
      python3 bench/dev/prefill_route.py ${ROUTE_ARGS:-} --json "$OUT/${N}_route.json" > "$OUT/${N}_route.log" 2>&1
      grep -E " us |Error|error" "$OUT/${N}_route.log" | cut -c1-170 ;;
    specE|specF|psq|esq|abx|seed) s66_step "$1" ;;
    dstar|wave|mid|w8|midab|wide2k|bwdt) s67_step "$1" ;;
    *) return 1 ;;
  esac
  return 0
}
run_steps
archive_logs
