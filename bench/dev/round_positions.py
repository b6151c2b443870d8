#!/usr/bin/env python3
"""cuflash against a peer, matched by what ran just before each turn (session 28).

Under the GPU's power cap a provider's turn starts at the clock the turn before it left: in bench.py's
grid (session 28, H200), with the fixed order cuflash, SDPA flash, cuDNN, cuflash's turns after cuDNN's
ran 1.07-1.12x its fastest run at head_dim 128 while cuDNN's, after SDPA flash's, stayed within 1.03.
bench.py keeps each round's median per row (ms_rounds); this script rebuilds each GPU-time round's
predecessor from the JSON's order (meta.timing.order; JSONs without it used "fixed") and compares the
two providers only over rounds whose predecessor was the same kind:
  after PROV   both turns followed PROV's turn (one of the others)
  after self   both turns followed their own turn (sustained, under their own power draw; serpentine
               order only: the last provider of a round runs first in the next)
The pass's first turn follows the previous pass's eager rounds (light, host-bound); it is left out.

Usage: python bench/dev/round_positions.py GRID.json [--a cuflash] [--b sdpa_cudnn] [--min-seqlen 2048]
       [--order serpentine|fixed]
Prints per pass and class: the geomean of b/a time ratios (> 1: a is faster), the min, how many
points are below 1.0, and the worst points."""
import argparse
import json
import math
from collections import defaultdict


def predecessors(provs, rounds, order):
    """{provider: [its predecessor in round r]} of the GPU-time rounds; None for the pass's first turn."""
    out = defaultdict(list)
    prev = None
    for r in range(rounds):
        for p in (list(provs)[::-1] if order == "serpentine" and r % 2 else list(provs)):
            out[p].append(prev)
            prev = p
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grid")
    ap.add_argument("--a", default="cuflash")
    ap.add_argument("--b", default="sdpa_cudnn")
    ap.add_argument("--min-seqlen", type=int, default=2048)
    ap.add_argument("--order", choices=("serpentine", "fixed"),
                    help="the order the grid ran in, where its JSON does not say (bench.py wrote it from "
                         "session 28 on; its grids before then ran fixed)")
    args = ap.parse_args(argv)
    d = json.load(open(args.grid))
    timing = d["meta"]["timing"]
    order = args.order or timing.get("order", "fixed")
    provs = [p for p in d["meta"]["grid"]["providers"]]
    rows = defaultdict(dict)
    for r in d["results"]:
        if "ms_rounds" in r:
            rows[(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"])][r["provider"]] = r
    ran = sorted({p for g in rows.values() for p in g}, key=provs.index)
    pred = predecessors(ran, timing["rounds"], order)
    print(f"{args.grid}: order {order}, rounds {timing['rounds']}, providers {' '.join(ran)}")
    print(f"{args.b} time / {args.a} time over rounds with the same kind of predecessor; seqlen >= {args.min_seqlen}")
    for ps in ("fwd", "bwd", "fwd+bwd"):
        classes = defaultdict(list)
        for key, g in sorted(rows.items()):
            if key[0] != ps or key[4] < args.min_seqlen or args.a not in g or args.b not in g:
                continue
            ra, rb = g[args.a]["ms_rounds"], g[args.b]["ms_rounds"]
            kinds = {}
            for who, ms in ((args.a, ra), (args.b, rb)):
                for r, x in enumerate(ms):
                    p = pred[who][r]
                    if p is None:
                        continue
                    kind = "self" if p == who else p
                    kinds.setdefault((who, kind), []).append(x)
            for kind in {k for (_w, k) in kinds}:
                if (args.a, kind) in kinds and (args.b, kind) in kinds:
                    ta = sum(kinds[(args.a, kind)]) / len(kinds[(args.a, kind)])
                    tb = sum(kinds[(args.b, kind)]) / len(kinds[(args.b, kind)])
                    classes[kind].append((tb / ta, key))
        if not classes:
            print(f"  {ps:8s} no rounds where both followed the same kind of turn")
        for kind, vals in sorted(classes.items()):
            ratios = [v for v, _ in vals]
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            worst = sorted(vals)[:3]
            print(f"  {ps:8s} after {kind:11s} geomean {gm:.3f}  min {min(ratios):.3f}  below 1.0: "
                  f"{sum(v < 1 for v in ratios)}/{len(ratios)}  worst: "
                  + ", ".join(f"{k[1][:4]} d{k[2]} {'causal' if k[3] else 'full'} {k[4]} {v:.3f}" for v, k in worst))


if __name__ == "__main__":
    main()
