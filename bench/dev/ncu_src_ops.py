"""Dev: where a kernel's executed instructions go, from Nsight Compute's SASS source page
(--page source --print-source sass --csv, with the SourceCounters section): per kernel, the total
warp instructions executed, how often the most executed instructions ran (the loop's trip count times
its warps), and the instructions executed per opcode, over the whole kernel and over the hot ones (those
executed at least HOT of the maximum count), per execution of the hottest instruction (per warp and
loop trip where that is the loop); then the hot instructions in address order with their counts and
stall samples. Usage: python bench/dev/ncu_src_ops.py DETAILS_CSV SOURCE_CSV [HOT (0.5)]"""
import collections
import csv
import re
import sys


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def tables(path):
    """The source page's tables: a header row holding 'Address' and 'Source' starts one."""
    out, header = [], None
    for row in csv.reader(open(path, errors="replace")):
        if "Address" in row and "Source" in row:
            header = row
            out.append((header, []))
        elif header is not None and len(row) == len(header):
            out[-1][1].append(dict(zip(header, row)))
    return out


def names(path):
    seen = []
    for line in open(path, errors="replace"):
        m = re.search(r'"(void [^"]*flash_decode[^"]*|[^"]*flash_decode_kernel[^"]*)"', line)
        if m and m.group(1) not in seen:
            seen.append(m.group(1))
    return seen


def opcode(src):
    s = src.strip()
    if s.startswith("@"):
        s = s.split(None, 1)[1] if " " in s else s
    return s.split(" ", 1)[0].split(".")[0] if s else "?"


def main():
    hot_frac = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    for i, n in enumerate(names(sys.argv[1])):
        print(f"kernel name {i}: {n[:160]}")
    for k, (header, rows) in enumerate(tables(sys.argv[2])):
        ex = next((c for c in header if c == "Instructions Executed"), None)
        st = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
        if ex is None or not rows:
            print(f"== table {k}: no 'Instructions Executed' column ({header[:8]})")
            continue
        counts = [num(r[ex]) for r in rows]
        total = sum(counts)
        if not total:
            continue
        top = max(counts)
        samples = [num(r[st]) if st else 0.0 for r in rows]
        hist = collections.Counter(int(c) for c in counts if c >= hot_frac * top)
        print(f"\n== table {k}: {len(rows)} SASS instructions, {total:.4g} warp instructions executed, "
              f"{sum(samples):.0f} stall samples; the most executed ran {top:.0f} times")
        print("   counts of the hot instructions (count: how many instructions): "
              + ", ".join(f"{c}: {n}" for c, n in sorted(hist.items(), key=lambda x: -x[0])[:12]))
        hot = [i for i, c in enumerate(counts) if c >= hot_frac * top]
        hot_total = sum(counts[i] for i in hot)
        print(f"   hot instructions (>= {hot_frac} of the top): {len(hot)}, {hot_total:.4g} executed "
              f"({hot_total / total:.1%} of all), {hot_total / top:.1f} per execution of the top one; "
              f"stall samples {sum(samples[i] for i in hot) / max(1.0, sum(samples)):.1%}")
        by_all, by_hot, smp = collections.Counter(), collections.Counter(), collections.Counter()
        hot_set = set(hot)
        for i, r in enumerate(rows):
            op = opcode(r["Source"])
            by_all[op] += counts[i]
            if i in hot_set:
                by_hot[op] += counts[i]
                smp[op] += samples[i]
        print(f"   {'opcode':10s} {'all':>10s} {'hot':>10s} {'hot/top':>8s} {'samples':>8s}")
        for op, c in by_all.most_common(40):
            print(f"   {op:10s} {c:10.4g} {by_hot[op]:10.4g} {by_hot[op] / top:8.2f} {smp[op]:8.0f}")
        print("   the hot instructions, address order (executions / top, stall samples):")
        for i in hot:
            r = rows[i]
            print(f"   {i:5d} {r['Address']:>6} {counts[i] / top:5.2f} {samples[i]:6.0f}  {r['Source'][:90]}")


if __name__ == "__main__":
    main()
