export PYTHONPATH=. CUFLASH_CACHE_DIR=$PWD/.cache/cf
nvidia-smi -L
python3 bench/dev/paged_locality.py 2>&1 | tee $OUT/locality.log
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
timeout 200 $NCU --profile-from-start off --clock-control none -k regex:flash_decode --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --csv --page details \
  python3 bench/dev/paged_locality.py --ncu --shapes 1x32768x1 --pages 256 > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc $?"
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/ncu.csv")))
hdr = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
H = rows[hdr]
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread", "Grid Size", "Block Size",
        "Warp Cycles Per Issued Instruction", "Stall Long Scoreboard", "Stall Barrier", "L2 Hit Rate",
        "Mem Busy", "Max Bandwidth", "Stall Wait", "Stall Short Scoreboard", "Stall No Instruction")
for r in rows[hdr + 1:]:
    d = dict(zip(H, r))
    if any(w in d.get("Metric Name", "") for w in want):
        print(d.get("ID"), d.get("Kernel Name", "")[:40], "|", d["Metric Name"], d.get("Metric Unit", ""), d["Metric Value"])
PY
