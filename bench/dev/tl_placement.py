#!/usr/bin/env python3
"""Where a decode grid's blocks ran and when they ended, from the raw slots of bench/dev/decode_timeline.py
--json (slot 0 the block's global-timer start, 22 / 19 its end, 20 its SM) or from
bench/dev/decode_read_bw.py --stamps --json (read_tma_stamp: SM, start, half, end a block).

For each recorded launch: the span (first start to last end), how many of the grid's blocks each SM held,
the blocks' ends as percentiles of the span, the mean end of the blocks on SMs that held 1, 2, 3 ... of
them, and the correlation of a block's end with its SM id's pair (TPC, smid // 2) and with its SM's
position in groups of 16 ids (a rough stand-in for the GPCs, whose mapping is not exposed).

Usage: python bench/dev/tl_placement.py FILE.json [FILE.json ...]
"""

from __future__ import annotations

import json
import sys

import numpy as np


def launches(path):
    """(label, sm, start_ns, end_ns) for each launch recorded in path."""
    data = json.load(open(path))
    if isinstance(data, dict) and "runs" in data:  # decode_read_bw.py --stamps
        for r in data["runs"]:
            yield (f"{r['name']} run {r['run']}", np.array(r["sm"]), np.array(r["t0"], float), np.array(r["t1"], float))
        return
    for row in data:  # decode_timeline.py
        for i, raw in enumerate(row.get("raw_last", [])):
            a = np.array(raw, dtype=np.int64)
            ok = a[:, 0] > 0
            a = a[ok]
            end = np.maximum(a[:, 22], a[:, 19]).astype(float)
            yield (f"{row['shape']} {row['layout']} {row['mode']} {row['kernel'][:60]} rep {i}", a[:, 20],
                   a[:, 0].astype(float), end)


def summary(label, sm, t0, t1):
    base = t0.min()
    span = t1.max() - base
    ends = (t1 - base) / span
    held = np.bincount(sm, minlength=int(sm.max()) + 1)
    n_held = held[sm]
    hist = {int(n): int((held == n).sum()) for n in sorted(set(held.tolist())) if n}
    lines = [f"{label}: span {span / 1e3:.1f} us, {len(sm)} blocks on {int((held > 0).sum())} SMs "
             f"(SMs by blocks held: {hist}); starts within {(t0.max() - base) / 1e3:.2f} us",
             "  ends / span: min {:.4f} p10 {:.4f} p50 {:.4f} p90 {:.4f} max 1".format(
                 ends.min(), *np.percentile(ends, [10, 50, 90]))]
    for n in sorted(set(n_held.tolist())):
        sel = n_held == n
        lines.append(f"  {int(sel.sum())} blocks on SMs holding {n}: end mean {ends[sel].mean():.4f} "
                     f"min {ends[sel].min():.4f} max {ends[sel].max():.4f}")
    grp = sm // 16
    means = [f"{g}: {ends[grp == g].mean():.4f} ({int((grp == g).sum())})" for g in sorted(set(grp.tolist()))]
    lines.append("  by smid // 16: " + ", ".join(means))
    # do the blocks of one SM end together? the mean within-SM spread against the grid's
    spreads = [np.ptp(ends[sm == s]) for s in set(sm.tolist()) if (sm == s).sum() > 1]
    if spreads:
        lines.append(f"  within-SM end spread: mean {np.mean(spreads):.4f}, grid p90 - p10 "
                     f"{np.percentile(ends, 90) - np.percentile(ends, 10):.4f}")
    return "\n".join(lines)


def main():
    for path in sys.argv[1:]:
        for label, sm, t0, t1 in launches(path):
            print(summary(label, sm, t0, t1))


if __name__ == "__main__":
    main()
