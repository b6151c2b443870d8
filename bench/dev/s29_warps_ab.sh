#!/usr/bin/env bash
# Session 29: 16-row pages through TMA (16-key groups), the 4-warp kernel against the 8-warp one at
# the same split count (CUFLASH_DECODE_WARPS=8), bench_decode's grid without 128k caches or batch 256,
# cuflash alone; default / 8 / default / 8, then the contiguous layout once. JSON to $OUT.
export PYTHONPATH=. CUFLASH_CACHE_DIR=$PWD/.cache/cf
OUT="${OUT:-./out}"; mkdir -p "$OUT"
A="--impls cuflash --page-size ${PAGE:-16} --no-host --no-graph --caches 512 2048 8192 32768 --batches 1 4 16 64 --budget-s 100"
for r in 1 2; do
  python3 bench/bench_decode.py $A --layouts paged --json "$OUT/w4_$r.json" > "$OUT/w4_$r.log" 2>&1; echo "w4 $r rc $?"
  CUFLASH_DECODE_WARPS=8 python3 bench/bench_decode.py $A --layouts paged --json "$OUT/w8_$r.json" > "$OUT/w8_$r.log" 2>&1; echo "w8 $r rc $?"
done
python3 bench/bench_decode.py $A --layouts contiguous --json "$OUT/contig.json" > "$OUT/contig.log" 2>&1; echo "contig rc $?"
python3 - "$OUT" <<'PY'
import json, sys, os
o = sys.argv[1]
def load(n):
    return {(p["batch"], p["cache"], p["gqa"]): p["ms"] for p in json.load(open(os.path.join(o, n)))["points"] if p.get("status") == "ok"}
c, a1, b1, a2, b2 = (load(n) for n in ("contig.json", "w4_1.json", "w8_1.json", "w4_2.json", "w8_2.json"))
print("   b     L  g   contig us | paged/contig: w4 w8 w4 w8")
for k in sorted(c, key=lambda k: c[k]):
    print(f"{k[0]:4d} {k[1]:5d} {k[2]:2d} {c[k]*1e3:9.1f} | " + " ".join(f"{d[k]/c[k]:.3f}" for d in (a1, b1, a2, b2)))
PY
