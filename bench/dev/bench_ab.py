"""Compares two bench.py JSON files of one device call (A, then B): per point, cuflash's GPU time and
single-eager time B / A, and in each run cuflash's TFLOP/s ratio to SDPA flash and cuDNN (GPU time,
then eager).

    python bench/dev/bench_ab.py A.json B.json
"""
import json
import sys


def rows(path):
    out = {}
    for r in json.load(open(path))["results"]:
        if r.get("ms"):
            out[(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["provider"])] = r
    return out


def main(a_path, b_path):
    a, b = rows(a_path), rows(b_path)
    pts = sorted({k[:5] for k in a if k[5] == "cuflash" and k in b})
    print("pass dtype d causal seqlen | B/A gpu  B/A eager | A: /fa /cudnn (e /fa /cudnn) | B: /fa /cudnn (e /fa /cudnn)")
    for p in pts:
        ca, cb = a[p + ("cuflash",)], b[p + ("cuflash",)]

        def peer(d, c, name, key):
            r = d.get(p + (name,))
            return r[key] / c[key] if r and r.get(key) and c.get(key) else float("nan")

        def four(d, c):
            return (f"{peer(d, c, 'sdpa_flash', 'ms'):.2f} {peer(d, c, 'sdpa_cudnn', 'ms'):.2f} "
                    f"({peer(d, c, 'sdpa_flash', 'ms_eager'):.2f} {peer(d, c, 'sdpa_cudnn', 'ms_eager'):.2f})")
        ge = cb["ms_eager"] / ca["ms_eager"] if ca.get("ms_eager") and cb.get("ms_eager") else float("nan")
        print(f"{p[0]} {p[1][:4]} d{p[2]} {'causal' if p[3] else 'full  '} {p[4]:6d} | {cb['ms'] / ca['ms']:.3f}  "
              f"{ge:.3f} | A: {four(a, ca)} | B: {four(b, cb)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
