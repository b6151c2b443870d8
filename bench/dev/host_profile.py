"""Host time of one cuflash call (torch, requires_grad inputs, as bench.py times them): the median
wall time of a call with the GPU idle, and the cProfile top functions over 300 calls. Used to check
that the feature options add no host cost to plain calls, and what a call with options costs.

Usage: python bench/dev/host_profile.py [window]
  default: plain causal, batch 32 x seqlen 512, both dtypes
  window:  window (256, 0), causal, bf16, batch 2 x seqlen 16384 (bench_features.py's window shape),
           forward and backward (autograd)"""
import cProfile
import pstats
import statistics
import sys
import time

import torch

import cuflash


def profile(label, f):
    for _ in range(20):
        f()
    ts = []
    for _ in range(100):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(label, "host us per call (median of 100, GPU idle):", round(statistics.median(ts) * 1e6, 1))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        f()
        torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if "window" in sys.argv:
    q, k, v = (torch.randn(2, 16384, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    profile("window fwd", lambda: cuflash.attention(q, k, v, causal=True, window=(256, 0)))
    out = cuflash.attention(q, k, v, causal=True, window=(256, 0))
    profile("window bwd", lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
else:
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(32, 512, 16, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        profile(str(dtype), lambda: cuflash.attention(q, k, v, causal=True))
