#!/usr/bin/env bash
# Session 30's paged-decode A/B: this tree's cuda_src/flash_decode.cu against the tree before it
# (.ab/old: `git archive HEAD cuflash cuda_src`, an ignored folder, carried), alternated ROUNDS times:
# bench/dev/paged_locality.py at PAGES-row pages (contiguous, pages in order, pages at random) on
# SHAPES. Then the decode GPU tests on this tree (TESTS=0: none). Calls 2-4: the table's L2 prefetch;
# calls 5-6: warp 0's lanes issue the 16-key groups; call 8: one 5-D box per 16-key group.
export PYTHONPATH=. CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
SH="${SHAPES:-1x32768x1 16x2048x8 1x8192x1 4x8192x4 1x32768x4 16x8192x8 4x512x8}"
for r in $(seq 1 "${ROUNDS:-2}"); do
  echo "== new $r"; python3 bench/dev/paged_locality.py --pages ${PAGES:-16} --shapes $SH 2>&1 | tail -n +2 | tee "$OUT/new$r.txt"
  echo "== old $r"; CUFLASH_CACHE_DIR=/tmp/cf_old PYTHONPATH=.ab/old python3 bench/dev/paged_locality.py --pages ${PAGES:-16} \
    --shapes $SH 2>&1 | tail -n +2 | tee "$OUT/old$r.txt"
done
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest tests/test_kvcache_decode.py tests/test_kvcache_device.py -m "gpu and not slow" -rf \
    -p no:cacheprovider -q -n 8 > "$OUT/decode_tests.log" 2>&1
  echo "decode tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/decode_tests.log" | tail -8
fi
