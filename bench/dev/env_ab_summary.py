#!/usr/bin/env python3
"""Summary of s62_call.sh's envab step (and the lsuab step of its first call): decode_splits.py JSON
files named *_envab_m<MODE>_<K>.json (the step's variable set to MODE, run K). Prints, per shape and
layout, each mode's times (us, in run order), the kernel it ran, and each mode's median against mode
0's.

    python bench/dev/env_ab_summary.py out/c2_envab_m*.json"""
import json
import re
import statistics
import sys


def main(paths):
    by = {}  # (shape, layout) -> mode -> [(k, us, kernel)]
    for path in paths:
        m = re.search(r"_(?:lsu|env)ab_m(\w+?)_(\d+)\.json$", path)
        if not m:
            continue
        mode, k = m.group(1), int(m.group(2))
        for r in json.load(open(path))["rows"]:
            by.setdefault((r["shape"], r["layout"]), {}).setdefault(mode, []).append((k, r["ms"] * 1e3, r["kernel"]))
    modes = sorted({mo for v in by.values() for mo in v})
    for (shape, layout), per in by.items():
        base = statistics.median(us for _, us, _ in per.get("0", [])) if "0" in per else None
        parts = []
        for mo in modes:
            runs = sorted(per.get(mo, []))
            if not runs:
                continue
            med = statistics.median(us for _, us, _ in runs)
            ratio = f" x{med / base:.3f}" if base and mo != "0" else ""
            parts.append(f"m{mo} {' '.join(f'{us:.2f}' for _, us, _ in runs)} [{runs[-1][2]}]{ratio}")
        print(f"{shape:>11} {layout:8} | " + " | ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:])
