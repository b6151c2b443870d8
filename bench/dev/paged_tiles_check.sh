#!/usr/bin/env bash
# Branch paged-tma-tiles: the first GPU run of the whole-tile paged decode (cuda_src/flash_decode.cu,
# page_tiles). 1) the decode GPU tests (test_kvcache_decode.py: test_decode_warps' paged cases and
# test_decode_paged_whole_tiles_plan, whole file), 2) bench_decode on the shapes where session 28
# (H200) found paged decodes at 82-86 % of the copy bandwidth, with pages of 16 / 64 / 256 rows and
# CUFLASH_DECODE_PAGE_TILES=1 (default) and 0. Logs to $OUT; the tables last. Carry: a cache built
# for this branch's cuda_src (scripts/carry_cache.sh), or none (the kernels then compile there).
export PYTHONPATH=.
[ -d .cache/cf ] && export CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
timeout "${TESTS_S:-300}" python3 -m pytest tests/test_kvcache_decode.py -m "gpu" -rf -p no:cacheprovider -q -n 8 \
  > "$OUT/tests.log" 2>&1
echo "tests rc $?"
for ps in ${PAGES:-16 64 256}; do
  for pt in 1 0; do
    CUFLASH_DECODE_PAGE_TILES=$pt timeout 90 python3 bench/bench_decode.py --batches 1 16 64 --caches 2048 32768 \
      --gqa 1 8 --impls cuflash sdpa_cudnn --page-size "$ps" --no-host --no-graph --budget-s 80 \
      > "$OUT/dec_p${ps}_t${pt}.log" 2>&1
    echo "page $ps tiles $pt rc $?"
  done
done
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -12
for f in "$OUT"/dec_p*.log; do
  echo "== $(basename "$f")"; grep -E "^ *[18] +(32|4) " "$f" | cut -c1-120
done
exit 0
