#!/usr/bin/env python3
"""Compares bench_decode.py JSON files of one device call (the same shapes, run with different
environment variables): per shape and layout, cuflash's GPU µs in each file, the faster peer's
(SDPA flash or cuDNN, from every file that timed one: the median of those), and each variant's
ratio to that peer. Usage: decode_variants_cmp.py NAME=PATH [NAME=PATH ...]"""

from __future__ import annotations

import json
import math
import statistics
import sys


def load(path):
    pts = {}
    for r in json.load(open(path))["points"]:
        if r.get("status") != "ok":
            continue
        pts[(r["batch"], r["cache"], r["gqa"], r["layout"], r["impl"])] = r["ms"] * 1000
    return pts


def main(argv):
    runs = [(a.split("=", 1)[0], load(a.split("=", 1)[1])) for a in argv]
    shapes = sorted({k[:4] for _, p in runs for k in p if k[4] == "cuflash"})
    names = [n for n, _ in runs]
    print("shape (batch x cache x gqa, layout) | peer µs | " + " | ".join(f"{n} µs (x peer)" for n in names))
    logs = {n: [] for n in names}
    for s in shapes:
        peers = [p[s + (i,)] for _, p in runs for i in ("sdpa_flash", "sdpa_cudnn") if s + (i,) in p]
        # the faster peer of each file, then the median over files
        per_file = []
        for _, p in runs:
            v = [p[s + (i,)] for i in ("sdpa_flash", "sdpa_cudnn") if s + (i,) in p]
            if v:
                per_file.append(min(v))
        peer = statistics.median(per_file) if per_file else None
        cells = []
        for n, p in runs:
            t = p.get(s + ("cuflash",))
            if t is None:
                cells.append("-")
            elif peer:
                cells.append(f"{t:8.1f} ({t / peer:.3f})")
                logs[n].append(math.log(t / peer))
            else:
                cells.append(f"{t:8.1f}")
        print(f"{s[0]:>3} x {s[1]:>6} x {s[2]} {s[3][:5]} | {peer if peer is None else round(peer, 1)} | "
              + " | ".join(cells))
    for n in names:
        if logs[n]:
            print(f"{n}: geomean x peer {math.exp(sum(logs[n]) / len(logs[n])):.3f} over {len(logs[n])} points, "
                  f"worst {math.exp(max(logs[n])):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
