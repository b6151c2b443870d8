"""Per-call GPU-time distributions of the forward, cuflash beside SDPA's cuDNN backend (session 27).

The grid (bench.py) keeps a point's median and minimum only. Some cuflash forward points read a
median 1.09-1.16x their minimum where cuDNN's reads 1.00-1.02 at the same shape. This prints, for
each shape, per provider and per block of back-to-back calls (the providers alternate block by
block): percentiles, the share of calls over 1.05x the block's fastest, and the block's median per
tenth of its run order (a slow stretch shows as a step, random slow calls as a flat line).

  SHAPES="bfloat16:64:1024:0 float16:64:2048:1"  (dtype:head_dim:seqlen:causal; 16k tokens, hidden 2048)
  REPS=300 BLOCKS=3 GRAD=1 (inputs require grad, as in the grid's fwd pass)
  ENV_B="CUFLASH_X=1"  (optional: a second cuflash provider, a copy of the package loaded under
                        its own name (treeload.py) with its own plan cache, run with these variables
                        set in os.environ around its calls; plans read them when they are made)
Writes $OUT/dist.json (every call's time).
"""
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.getcwd())
import cuflash  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from treeload import EnvSet, load  # noqa: E402

cuflash_b = None

REPS = int(os.environ.get("REPS", "300"))
BLOCKS = int(os.environ.get("BLOCKS", "3"))
GRAD = os.environ.get("GRAD", "1") == "1"
SHAPES = os.environ.get("SHAPES", "bfloat16:64:1024:0 float16:64:512:0 bfloat16:64:2048:1 float16:64:2048:1 "
                                  "bfloat16:128:8192:0 bfloat16:128:2048:0").split()
COMPACT = os.environ.get("COMPACT", "0") == "1"
ENV_B = [kv.split("=", 1) for kv in os.environ.get("ENV_B", "").split() if "=" in kv]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def timed(fn, n):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def main():
    global cuflash_b
    if ENV_B:   # a copy of the package with a plan cache of its own (plans read CUFLASH_* when made)
        cuflash_b = load("cuflash_b", os.getcwd(), "cuflash_b")
    out_dir = os.environ.get("OUT", ".")
    res = []
    print(torch.cuda.get_device_name(), "REPS", REPS, "BLOCKS", BLOCKS, "GRAD", GRAD, "ENV_B", ENV_B)
    for sh in SHAPES:
        dt, hd, s, c = sh.split(":")
        dt, hd, s, c = getattr(torch, dt), int(hd), int(s), c == "1"
        h = 2048 // hd
        b = 16384 // s
        q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=dt, requires_grad=GRAD) for _ in range(3))
        provs = {
            "cuflash": (lambda: cuflash.attention(q, k, v, causal=c), None),
            "cudnn": (lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=c),
                      SDPBackend.CUDNN_ATTENTION),
        }
        if ENV_B:
            provs["cuflash_B"] = (lambda: cuflash_b.attention(q, k, v, causal=c), "env")
        flops = 4 * b * h * s * s * hd / (2 if c else 1)
        for name, (fn, be) in provs.items():     # warm-up, untimed
            ctx = sdpa_kernel(be) if isinstance(be, SDPBackend) else (EnvSet(ENV_B) if be == "env" else EnvSet([]))
            with ctx:
                timed(fn, 5)
        rows = {n: [] for n in provs}
        for blk in range(BLOCKS):
            for name, (fn, be) in provs.items():
                ctx = sdpa_kernel(be) if isinstance(be, SDPBackend) else (EnvSet(ENV_B) if be == "env" else EnvSet([]))
                with ctx:
                    t = timed(fn, REPS)
                rows[name].append(t)
        print(f"\n== {sh}  (b{b} h{h})")
        for name, blks in rows.items():
            if COMPACT:
                print(f"{name:10s} block medians us " + " ".join(f"{statistics.median(t)*1e3:.0f}" for t in blks)
                      + "  mins " + " ".join(f"{min(t)*1e3:.0f}" for t in blks))
                continue
            for i, t in enumerate(blks):
                mn, md = min(t), statistics.median(t)
                slow = sum(x > 1.05 * mn for x in t) / len(t)
                tenth = [statistics.median(t[j * len(t) // 10:(j + 1) * len(t) // 10]) / mn for j in range(10)]
                print(f"{name:10s} blk{i} min {mn*1e3:8.1f} us p10 {pct(t,10)/mn:.3f} p50 {md/mn:.3f} "
                      f"p90 {pct(t,90)/mn:.3f} max {max(t)/mn:.3f} >1.05: {slow:4.0%}  "
                      f"TF(med) {flops/md/1e9:5.0f}  tenths " + " ".join(f"{x:.2f}" for x in tenth))
        allmed = {n: statistics.median([x for t in blks for x in t]) for n, blks in rows.items()}
        allmin = {n: min(min(t) for t in blks) for n, blks in rows.items()}
        bmed = {n: [statistics.median(t) for t in blks] for n, blks in rows.items()}
        pair = sorted(c / f for c, f in zip(bmed["cudnn"], bmed["cuflash"]))
        print("ratio cudnn/cuflash: median %.3f  min %.3f  per-block-pair median %.3f (range %.3f-%.3f)" % (
            allmed["cudnn"] / allmed["cuflash"], allmin["cudnn"] / allmin["cuflash"],
            statistics.median(pair), pair[0], pair[-1]))
        if ENV_B:
            print("ratio cuflash/cuflash_B: median %.3f  min %.3f" % (allmed["cuflash"] / allmed["cuflash_B"],
                                                                     allmin["cuflash"] / allmin["cuflash_B"]))
        res.append(dict(shape=sh, times={n: blks for n, blks in rows.items()}))
        del q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "dist.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
