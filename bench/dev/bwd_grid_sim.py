"""Monte-Carlo of the backward grid's check (max|g - ref64| <= 3 max|naive - ref64| + 1e-4 over the whole
gradient; tests/test_gpu_backward.py) on one grid shape with the NumPy mirror of the tiled backward
(cuflash/_cpu_backward.py), fresh standard-normal draws each time: how often each gradient fails, and
the worst error / bound. A grid failure on the GPU whose shape fails in the mirror at a like rate is the
check's statistic, not the kernels.

    python bench/dev/bwd_grid_sim.py SEED DRAWS [--dtype bf16] [--d 40] [--batch 16] [--sq 1] [--sk 300]
                                     [--h 4] [--hkv 2] [--causal]"""
import argparse
import math
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _grad_reference import attention_grad_reference  # noqa: E402

from cuflash._cpu import attention_forward_numpy  # noqa: E402
from cuflash._cpu_backward import attention_backward_numpy  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("seed", type=int)
ap.add_argument("draws", type=int)
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--d", type=int, default=40)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--sq", type=int, default=1)
ap.add_argument("--sk", type=int, default=300)
ap.add_argument("--h", type=int, default=4)
ap.add_argument("--hkv", type=int, default=2)
ap.add_argument("--causal", action="store_true")
a = ap.parse_args()
dt = np.dtype(ml_dtypes.bfloat16) if a.dtype == "bf16" else np.dtype(np.float16)
rng = np.random.default_rng(a.seed)
fails, worst, ratios = {}, {}, {"dq": [], "dk": [], "dv": []}
t0 = time.time()
for it in range(a.draws):
    q = rng.standard_normal((a.batch, a.sq, a.h, a.d)).astype(dt)
    k = rng.standard_normal((a.batch, a.sk, a.hkv, a.d)).astype(dt)
    v = rng.standard_normal((a.batch, a.sk, a.hkv, a.d)).astype(dt)
    do = rng.standard_normal((a.batch, a.sq, a.h, a.d)).astype(dt)
    sc = 1 / math.sqrt(a.d)
    out, lse = attention_forward_numpy(q, k, v, a.causal, sc, block_m=64, block_n=64)
    g = attention_backward_numpy(do, q, k, v, out, lse, a.causal, sc, block_m=64, block_n=128)
    ref = attention_grad_reference(do, q, k, v, a.causal, sc)
    nai = attention_grad_reference(do, q, k, v, a.causal, sc, compute_dtype="input")
    for name, x, r, n in zip(("dq", "dk", "dv"), g, ref, nai):
        ratio = np.abs(x.astype(np.float64) - r).max() / (3 * np.abs(n.astype(np.float64) - r).max() + 1e-4)
        ratios[name].append(ratio)
        worst[name] = max(worst.get(name, 0.0), ratio)
        if ratio > 1:
            fails[name] = fails.get(name, 0) + 1
print(f"{a.dtype} d{a.d} batch {a.batch} {a.sq}x{a.sk} h{a.h}kv{a.hkv} causal={a.causal}: {a.draws} draws, "
      f"fails {fails}, worst {dict((n, round(w, 3)) for n, w in worst.items())}, "
      f"p99.9 {dict((n, round(float(np.quantile(r, 0.999)), 3)) for n, r in ratios.items())} "
      f"({time.time() - t0:.0f} s)")
