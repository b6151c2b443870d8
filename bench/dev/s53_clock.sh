#!/usr/bin/env bash
# Session 53: does a decode plan's time depend on the SM clock? Nsight Compute with the clocks locked
# to base and left free, cuflash plan variants beside SDPA flash and cuDNN (bench/dev/ncu_decode_clock.py).
#   SHAPES="16 131072 4" VARIANTS="0:0 2:8 33:4" OUT=... bash bench/dev/s53_clock.sh
source "$(dirname "${BASH_SOURCE[0]}")/call_env.sh"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
echo "ncu: $NCU"
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed
k=0
while read -r b L g; do
  [ -z "$b" ] && continue
  for cc in base none; do
    k=$((k + 1))
    "$NCU" --profile-from-start off --clock-control $cc --metrics $M --csv \
      python3 bench/dev/ncu_decode_clock.py $b $L $g ${VARIANTS:-0:0 2:8 33:4} > "$OUT/clk_${k}_${b}x${L}x${g}_$cc.csv" 2> "$OUT/clk_${k}_${b}x${L}x${g}_$cc.err"
    echo "== $b x $L x $g, clock-control $cc (rc $?): $(grep order "$OUT/clk_${k}_${b}x${L}x${g}_$cc.err")"
    python3 - "$OUT/clk_${k}_${b}x${L}x${g}_$cc.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; data = rows[1:]
i_id, i_k, i_m, i_u, i_v = (hdr.index(x) for x in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
by = {}
for r in data:
    by.setdefault((int(r[i_id]), r[i_k][:60]), {})[r[i_m]] = (r[i_v], r[i_u])
for (i, name), m in sorted(by.items()):
    print(f"  {i:3d} {name:60s} " + "  ".join(f"{k.split('__')[1][:22]}={v[0]} {v[1]}" for k, v in sorted(m.items())))
PY
  done
done <<< "${SHAPES:-16 131072 4}"
