"""Dev: Nsight Compute's SASS source page (--page source --print-source sass --csv) of a decode step,
kernel by kernel: the durations from the details page, then for each kernel the share of warp-stall
samples before the first HMMA (the prologue), from there to the last HMMA (the loop and the warps'
merge), and after (the epilogue), and the instructions holding the most samples.
Usage: python bench/dev/ncu_src_summary.py DETAILS_CSV SOURCE_CSV [TOP]"""
import csv
import sys


def details(path):
    lines = [l for l in open(path) if l.startswith('"')]
    out = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "Duration":
            out.append((r.get("Kernel Name", "")[:70], r.get("Metric Value"), r.get("Metric Unit")))
    return out


def sections(path):
    """The source page's tables: a header row holding 'Address' and 'Source' starts one."""
    cur, header = None, None
    for row in csv.reader(open(path, errors="replace")):
        if "Address" in row and "Source" in row:
            header = row
            cur = []
            yield_ = (header, cur)
            sections.out.append(yield_)
            continue
        if header is not None and len(row) == len(header):
            cur.append(dict(zip(header, row)))
    return sections.out


sections.out = []


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    for name, val, unit in details(sys.argv[1]):
        print(f"duration {val} {unit}  {name}")
    for k, (header, rows) in enumerate(sections(sys.argv[2])):
        col = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
        if col is None or not rows:
            continue
        total = sum(num(r[col]) for r in rows)
        hmma = [i for i, r in enumerate(rows) if "HMMA" in r["Source"]]
        if not total:
            continue
        a, z = (hmma[0], hmma[-1]) if hmma else (len(rows), len(rows))
        pro = sum(num(r[col]) for r in rows[:a])
        mid = sum(num(r[col]) for r in rows[a:z + 1])
        print(f"== kernel {k}: {len(rows)} instructions, {total:.0f} samples; prologue {pro / total:.0%} "
              f"(to instruction {a}), loop+merge {mid / total:.0%}, epilogue {(total - pro - mid) / total:.0%}")
        reasons = [c for c in header if c.startswith("stall_") or c.startswith("Warp Stall Sampling (All Samples)_")]
        best = sorted(range(len(rows)), key=lambda i: -num(rows[i][col]))[:top]
        for i in sorted(best):
            r = rows[i]
            print(f"  {i:5d} {r['Address']:>8} {num(r[col]):7.0f}  {r['Source'][:70]}")
        del reasons


if __name__ == "__main__":
    main()
