"""Dev: the rows of an `ncu --csv --page details` log that matter for a kernel comparison, one block
per kernel. Usage: python bench/dev/ncu_summary.py LOG"""
import csv
import sys

KEEP = ("Duration", "Registers Per Thread", "Block Size", "Grid Size", "Dynamic Shared Memory Per Block",
        "Compute (SM) Throughput", "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "DRAM Throughput", "Executed Ipc Active", "Issue Slots Busy", "Achieved Occupancy",
        "Theoretical Occupancy", "No Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
        "Warp Cycles Per Issued Instruction")
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
cur = None
for r in rows:
    kid = (r.get("ID"), r.get("Kernel Name", "")[:90])
    if kid != cur:
        cur = kid
        print(f"\n== {kid[0]} {kid[1]}")
    name = r.get("Metric Name", "")
    if name in KEEP or r.get("Section Name") == "WarpStateStats" and "Stall" in name:
        print(f"  {name}: {r.get('Metric Value')} {r.get('Metric Unit')}")
    elif "Pipe" in name or "stalled" in name or "pipe" in name or "lts__" in name or "l1tex__" in name:
        print(f"  {name}: {r.get('Metric Value')} {r.get('Metric Unit')}")
