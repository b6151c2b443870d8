"""Dev: where a forward kernel's warps wait, from Nsight Compute's SASS source page (--page source
--print-source sass --csv, with SourceCounters): per kernel, the warp-stall samples on each waiting
instruction (mbarrier try-waits by their barrier's shared-memory offset, named-barrier syncs, wgmma
waits) and the share of all samples those take, then the samples by opcode.
Usage: python bench/dev/ncu_fwd_waits.py SOURCE_CSV"""
import csv
import re
import sys
from collections import Counter


def tables(path):
    out, cur, header = [], None, None
    for row in csv.reader(open(path, errors="replace")):
        if "Address" in row and "Source" in row:
            header, cur = row, []
            out.append((header, cur))
            continue
        if header is not None and len(row) == len(header):
            cur.append(dict(zip(header, row)))
    return out


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


for k, (header, rows) in enumerate(tables(sys.argv[1])):
    col = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
    if col is None or not rows:
        continue
    total = sum(num(r[col]) for r in rows)
    if not total:
        continue
    print(f"== kernel {k}: {len(rows)} instructions, {total:.0f} samples")
    waits = Counter()
    for r in rows:
        s, n = r["Source"], num(r[col])
        m = re.search(r"SYNCS\.PHASECHK\S*\s+\S+,\s*\[([^\]]+)\]", s)
        if m:
            off = re.search(r"0x[0-9a-f]+", m.group(1))
            waits["mbar try-wait " + (off.group(0) if off else m.group(1))] += n
        elif "BAR.SYNC" in s:
            waits["named barrier sync"] += n
        elif "DEPBAR" in s:
            waits[s.split(";")[0].strip()] += n
    for w, n in sorted(waits.items(), key=lambda x: -x[1]):
        print(f"  {n:8.0f} {n / total:6.1%}  {w}")
    ops = Counter()
    for r in rows:
        op = r["Source"].split()
        if not op:
            continue
        o = op[1] if op[0].startswith("@") and len(op) > 1 else op[0]
        ops[o.split(".")[0]] += num(r[col])
    print("  by opcode: " + ", ".join(f"{o} {n / total:.1%}" for o, n in ops.most_common(12)))
