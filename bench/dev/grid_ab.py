"""Compares two bench_decode.py JSON files of one card (A, then B): cuflash's GPU time per point,
contiguous and paged, B / A, and each run's ratio to the faster peer. Prints the points that moved
by more than 1 % and the geomeans.

    python bench/dev/grid_ab.py A.json B.json
"""
import json
import math
import sys


def rows(path):
    out = {}
    for p in json.load(open(path))["points"]:
        if p.get("status") == "ok":
            out[(p["batch"], p["cache"], p["gqa"], p["label"])] = p["ms"]
    return out


def main(a_path, b_path):
    a, b = rows(a_path), rows(b_path)
    shapes = sorted({k[:3] for k in a if k[3] == "cuflash"})
    for label in ("cuflash", "cuflash/paged"):
        logs, moved = [], []
        for s in shapes:
            ka = s + (label,)
            if ka in a and ka in b:
                r = b[ka] / a[ka]
                logs.append(math.log(r))
                if abs(r - 1) > 0.01:
                    moved.append((s, a[ka], b[ka], r))
        print(f"{label}: B / A geomean {math.exp(sum(logs) / len(logs)):.4f} over {len(logs)} shapes")
        for s, ta, tb, r in moved:
            print(f"  b{s[0]} L{s[1]} g{s[2]}: {ta * 1e3:.1f} -> {tb * 1e3:.1f} us ({r:.3f})")
    for name, d in (("A", a), ("B", b)):
        logs = []
        worst = (0, None)
        for s in shapes:
            peers = [d[s + (p,)] for p in ("sdpa-fa", "cudnn") if s + (p,) in d]
            if s + ("cuflash",) in d and peers:
                r = d[s + ("cuflash",)] / min(peers)
                logs.append(math.log(r))
                worst = max(worst, (r, s))
        big = [math.log(d[s + ("cuflash",)] / min(d[s + (p,)] for p in ("sdpa-fa", "cudnn")))
               for s in shapes if s[0] * s[1] >= 8 * 4096 and s + ("cuflash",) in d]
        print(f"{name}: cuflash / faster peer geomean {math.exp(sum(logs) / len(logs)):.4f}, worst {worst[0]:.3f} "
              f"at {worst[1]}; batch x cache >= 8 x 4k geomean {math.exp(sum(big) / max(len(big), 1)):.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
