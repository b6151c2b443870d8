#!/usr/bin/env bash
# Session 29: the paged decode's lookups off warp 0's path (cuda_src/flash_decode.cu). 1) the decode
# GPU tests, 2) bench/dev/paged_locality.py (contiguous / pages in order / random pages) at the
# shapes where paged decodes were slowest, 3) the same with CUFLASH_DECODE_PAGE_TILES=0 (16-key
# groups at every page size). Logs to $OUT; the tables last. Carry: .cache/cf built for this tree.
export PYTHONPATH=.
[ -d .cache/cf ] && export CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
md5sum cuda_src/flash_decode.cu
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest tests/test_kvcache_decode.py tests/test_kvcache_device.py -m "gpu" -rf -p no:cacheprovider -q -n 8 \
    > "$OUT/tests.log" 2>&1
  echo "tests rc $?"
fi
# (paged_locality times eager calls back to back: shapes under ~40 us per step are host-bound there)
SH="${SHAPES:-1x32768x1 16x32768x8 64x32768x8 16x8192x1 4x32768x1}"
python3 bench/dev/paged_locality.py --pages ${PAGES:-16 64 256} --shapes $SH > "$OUT/loc.log" 2>&1
echo "locality rc $?"
CUFLASH_DECODE_PAGE_TILES=0 python3 bench/dev/paged_locality.py --pages 256 --shapes $SH > "$OUT/loc_t0.log" 2>&1
echo "locality t0 rc $?"
for ps in ${DEC_PAGES:-}; do  # bench_decode, cuflash alone, contiguous and paged
  timeout 150 python3 bench/bench_decode.py --impls cuflash --page-size "$ps" --no-host --no-graph --budget-s 120 ${DEC_ARGS:-} \
    --json "$OUT/dec_p$ps.json" > "$OUT/dec_p$ps.log" 2>&1
  echo "bench_decode page $ps rc $?"
done
[ -f "$OUT/tests.log" ] && grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -12
cat "$OUT/loc.log"; echo "== page_tiles 0"; cat "$OUT/loc_t0.log"
for ps in ${DEC_PAGES:-}; do echo "== bench_decode page $ps"; grep -E "paged time|worst" "$OUT/dec_p$ps.log" | tail -2; done
