#!/usr/bin/env python3
"""Summarizes an A/B of bench.py runs: files named ..._old1.json, ..._new2.json, ... (s60_call.sh's bab).

Per configuration (dtype, head_dim, causal, seqlen, pass) and per tree (old, new; each tree's runs
pooled by the median of their figures): cuflash's GPU time and single eager call time, cuDNN's (and
SDPA flash's where present), and new / old for cuflash, plus cuflash / cuDNN speed (cuDNN's time over
cuflash's, as bench.py's ratios) for each tree. Last, the geomeans.

Usage: python bench/dev/bwd_eager_ab.py OUT/c1_bab_*.json
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict


def main(paths):
    # fig[(tree, key, provider)] = list of (ms, ms_eager) over that tree's runs
    fig = defaultdict(list)
    keys = []
    for path in paths:
        m = re.search(r"_(old|new)\d+\.json$", path)
        if not m:
            continue
        tree = m.group(1)
        for r in json.load(open(path))["results"]:
            if "ms" not in r:
                continue
            key = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["pass"])
            if key not in keys:
                keys.append(key)
            fig[(tree, key, r["provider"])].append((r["ms"], r.get("ms_eager")))

    def med(tree, key, prov, i):
        xs = [x[i] for x in fig.get((tree, key, prov), []) if x[i] is not None]
        return statistics.median(xs) if xs else None

    print("config                         | cuflash GPU old -> new (new/old) | eager old -> new (new/old) "
          "| vs cuDNN GPU old/new | vs cuDNN eager old/new")
    logs = defaultdict(list)
    for key in keys:
        g_o, g_n = med("old", key, "cuflash", 0), med("new", key, "cuflash", 0)
        e_o, e_n = med("old", key, "cuflash", 1), med("new", key, "cuflash", 1)
        cg_o, cg_n = med("old", key, "sdpa_cudnn", 0), med("new", key, "sdpa_cudnn", 0)
        ce_o, ce_n = med("old", key, "sdpa_cudnn", 1), med("new", key, "sdpa_cudnn", 1)
        if None in (g_o, g_n, e_o, e_n):
            continue
        dt, d, causal, s, ps = key
        name = f"{ps} {dt[:4]} d{d} {'causal' if causal else 'full'} {s}"
        line = (f"{name:30s} | {g_o:.4f} -> {g_n:.4f} ({g_n / g_o:.3f}) | {e_o:.4f} -> {e_n:.4f} ({e_n / e_o:.3f})")
        logs["gpu new/old"].append(math.log(g_n / g_o))
        logs["eager new/old"].append(math.log(e_n / e_o))
        if None not in (cg_o, cg_n, ce_o, ce_n):
            line += f" | {cg_o / g_o:.3f} / {cg_n / g_n:.3f} | {ce_o / e_o:.3f} / {ce_n / e_n:.3f}"
            for tag, v in (("vs cuDNN GPU old", cg_o / g_o), ("vs cuDNN GPU new", cg_n / g_n),
                           ("vs cuDNN eager old", ce_o / e_o), ("vs cuDNN eager new", ce_n / e_n)):
                logs[tag].append(math.log(v))
        print(line)
    for tag, xs in logs.items():
        print(f"geomean {tag}: {math.exp(sum(xs) / len(xs)):.4f} (min {math.exp(min(xs)):.3f}, "
              f"max {math.exp(max(xs)):.3f}, {len(xs)} points)")


if __name__ == "__main__":
    main(sys.argv[1:])
