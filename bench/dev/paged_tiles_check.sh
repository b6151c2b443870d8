#!/usr/bin/env bash
# Branch paged-tma-tiles: the first GPU run of the whole-tile paged decode (cuda_src/flash_decode.cu,
# page_tiles). 1) the decode GPU tests (test_kvcache_decode.py, whole file), 2) bench_decode,
# cuflash alone, contiguous and paged, on the shapes where session 28 (H200) found paged decodes
# slowest against contiguous ones, with pages of 16 rows (16-key groups whatever page_tiles says),
# and 64 / 256 rows with CUFLASH_DECODE_PAGE_TILES=1 (default) and 0. Logs and JSON to $OUT; the
# paged / contiguous table last. Carry: a cache built for this branch's cuda_src
# (scripts/carry_cache.sh), or none (the kernels then compile there).
export PYTHONPATH=.
[ -d .cache/cf ] && export CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
nvidia-smi -L
md5sum cuda_src/flash_decode.cu
timeout "${TESTS_S:-300}" python3 -m pytest tests/test_kvcache_decode.py -m "gpu" -rf -p no:cacheprovider -q -n 8 \
  > "$OUT/tests.log" 2>&1
echo "tests rc $?"
run() {  # page_size page_tiles
  CUFLASH_DECODE_PAGE_TILES=$2 timeout 120 python3 bench/bench_decode.py --batches ${BATCHES:-1 16 64} \
    --caches ${CACHES:-512 2048 32768} --gqa 1 8 --impls cuflash --page-size "$1" --no-host --no-graph \
    --budget-s 100 --json "$OUT/dec_p$1_t$2.json" > "$OUT/dec_p$1_t$2.log" 2>&1
  echo "page $1 tiles $2 rc $?"
}
run 16 1
for ps in ${PAGES:-64 256}; do run "$ps" 1; run "$ps" 0; done
grep -E "^E .*(seed|out:)|^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-300 | tail -12
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = sorted(glob.glob(os.path.join(sys.argv[1], "dec_p*_t*.json")))
table, shapes = {}, set()
for f in runs:
    pts = json.load(open(f))["points"]
    ms = {(p["batch"], p["cache"], p["gqa"], p["layout"]): p["ms"] for p in pts if p.get("status") == "ok"}
    tag = os.path.basename(f)[4:-5]
    for (b, c, g, lay), t in ms.items():
        if lay == "paged" and (b, c, g, "contiguous") in ms:
            table[(tag, b, c, g)] = (t / ms[(b, c, g, "contiguous")], t, ms[(b, c, g, "contiguous")])
            shapes.add((b, c, g))
tags = [os.path.basename(f)[4:-5] for f in runs]
print("paged / contiguous time (cuflash), per run:")
print("  b     L   g  " + "  ".join(f"{t:>9}" for t in tags) + "   contig ms")
for s in sorted(shapes, key=lambda s: (s[0] * s[1] / s[2], s)):
    cells = [table.get((t,) + s) for t in tags]
    print(f"{s[0]:3d} {s[1]:5d} {s[2]:3d}  " + "  ".join(f"{c[0]:9.3f}" if c else "        -" for c in cells)
          + f"   {next((c[2] for c in cells if c), 0):.4f}")
PY
exit 0
