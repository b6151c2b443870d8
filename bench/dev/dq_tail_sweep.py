"""Dev: the distribution of the backward grid's error ratio (max |g - g64| over its bound, 3 x the naive
in-dtype error + 1e-4; tests/test_gpu_backward.py) over many fresh draws of one grid shape, per
head_dim and dtype, on the GPU's default (atomic) backward path. Session 41's slow-grid failure (bf16
head_dim 32, causal 1023 x 1024, dq 1.17x its bound) came from D = rowsum(dO * O) formed from the
stored O at rows that see two keys; this counts how often such a draw passes 0.5x, 0.8x and 1x of the
bound at each head_dim.

    python bench/dev/dq_tail_sweep.py [N per config] [head dims] [causal 0/1]"""
import math
import os
import statistics as st
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import cuflash  # noqa: E402
from test_gpu_backward import GRID_BATCH, grad_bounds, make_dout  # noqa: E402
from test_gpu_forward import make_qkv  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
hds = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "32,64,128").split(",")]
causal = bool(int(sys.argv[3])) if len(sys.argv) > 3 else True
sq, sk, h, hkv = 1023, 1024, 4, 4
for dt in [getattr(torch, x) for x in os.environ.get("TAIL_DTYPES", "bfloat16 float16").split()]:
    for d in hds:
        t0 = time.perf_counter()
        ratios = {"dq": [], "dk": [], "dv": []}
        worst = (0.0, None)
        for _ in range(n):
            seed = int(torch.seed())
            q, k, v = make_qkv(GRID_BATCH, sq, sk, h, hkv, d, dt, "bshd")
            dout = make_dout(GRID_BATCH, sq, h, d, dt, "bshd")
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
            ref, bounds = grad_bounds(q, k, v, dout, causal, 1.0 / math.sqrt(d))
            for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, bounds):
                x = (g.double() - r).abs().max().item() / b
                ratios[name].append(x)
                if name == "dq" and x > worst[0]:
                    worst = (x, seed)
        line = f"{str(dt)[6:]:8s} d{d:<3d} causal={int(causal)} n={n} ({time.perf_counter() - t0:.0f} s):"
        for name, xs in ratios.items():
            xs.sort()
            line += (f" {name} median {st.median(xs):.3f} p99 {xs[int(0.99 * (len(xs) - 1))]:.3f} max {xs[-1]:.3f}"
                     f" >0.5 {sum(x > 0.5 for x in xs)} >0.8 {sum(x > 0.8 for x in xs)} >1 {sum(x > 1 for x in xs)};")
        print(line + f" worst dq seed {worst[1]}", flush=True)
